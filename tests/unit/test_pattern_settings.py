"""The pattern as one object (issue 44 item 5): :class:`FocusPattern` carries every setting
from the recipe to the backends, so the code between them never names a gate parameter."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from focus_pretrain.focus import FocusConfig, Routing, focus_attention
from focus_pretrain.focus import attention as dispatcher
from focus_pretrain.focus.backends import AttentionPattern
from focus_pretrain.focus.pattern_settings import PATTERN_FIELDS, FocusPattern, with_settings

ROOT = Path(__file__).resolve().parents[2]
# the code that carries the pattern from the recipe to a backend (not the rule, not a kernel)
PLUMBING = (
    "focus_pretrain/focus/attention.py",
    "focus_pretrain/focus/backends.py",
    "focus_pretrain/focus/sorted_triton.py",
    "focus_pretrain/model/attention.py",
    "focus_pretrain/parallel/context_parallel.py",
    "focus_pretrain/parallel/ring.py",
    "focus_pretrain/parallel/ring_kernels.py",
)
GATE_PARAMETERS = ("gate_lambda",)  # the soft gate's parameters (the rule's and its copies')

CASES = [
    dict(mode="soft", window=3, gate_lambda=4.0, sinks=2),
    dict(mode="hard", window=2, top_k=2, softcap=5.0),
    dict(mode="hard_gated", window=4, gate_lambda=2.5, scale=0.3),
    dict(mode="soft", window=3, gate_form="dot", gate_lambda=3.0),
    dict(window=5, local_only=True, sinks=1),
]


def inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 24, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]  # [b, s, Hkv, D]: GQA
    probs = torch.softmax(torch.randn(2, 24, 4, generator=gen, dtype=torch.float64) * 2, -1)
    return q, k, v, Routing(probs)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_pattern_object_computes_what_its_settings_by_name_compute(case):
    settings = CASES[case]
    q, k, v, routing = inputs(case)
    by_name = focus_attention(q, k, v, routing, backend="reference", **settings)
    whole = focus_attention(q, k, v, routing, FocusPattern(**settings), backend="reference")
    torch.testing.assert_close(whole, by_name, rtol=0, atol=0)
    # a pattern with some settings replaced by name: the replaced ones win
    lam = settings.get("gate_lambda", 10.0)
    replaced = dict(window=settings["window"] + 7, sinks=0, gate_lambda=lam + 1.5)
    other = FocusPattern(**{**settings, **replaced})
    mixed = focus_attention(
        q, k, v, routing, other, backend="reference",
        window=settings["window"], sinks=settings.get("sinks", 0), gate_lambda=lam,
    )  # fmt: skip
    torch.testing.assert_close(mixed, by_name, rtol=0, atol=0)
    # and the pattern's settings matter (not a test that cannot fail)
    changed = focus_attention(q, k, v, routing, other, backend="reference")
    assert not torch.equal(changed, by_name)


def test_an_unknown_setting_is_refused_by_name():
    q, k, v, routing = inputs(0)
    with pytest.raises(TypeError, match=r"unknown pattern setting\(s\) \['gate_lamda'\]"):
        focus_attention(q, k, v, routing, gate_lamda=3.0)
    with pytest.raises(TypeError, match="pattern must be a FocusPattern"):
        with_settings({"window": 3}, {}, caller="focus_attention")
    with pytest.raises(ValueError, match="gate_lambda must be > 0"):
        focus_attention(q, k, v, routing, FocusPattern(gate_lambda=-1.0))


def test_the_recipe_settings_reach_the_backend_whole(monkeypatch):
    """Every setting the recipe shares by name with :class:`FocusPattern` arrives in the
    backend's :class:`AttentionPattern` unchanged, with the call's own (mode, softcap)."""
    config = FocusConfig(num_groups=4, window=5, top_k=2, gate_lambda=3.5, sinks=2)
    seen = []
    real = dispatcher.select_backend

    def recording(name, request):
        chosen = real(name, request)
        return dataclasses.replace(chosen, fn=lambda *a: seen.append(a[3]) or chosen.fn(*a))

    monkeypatch.setattr(dispatcher, "select_backend", recording)
    q, k, v, routing = inputs(3)
    focus_attention(q, k, v, routing, config.pattern(mode="hard", softcap=6.0))
    (got,) = seen
    assert isinstance(got, AttentionPattern)
    shared = [name for name in PATTERN_FIELDS if hasattr(config, name)]
    assert set(shared) >= {"window", "top_k", "gate_lambda", "gate_form", "sinks"}
    assert {name: getattr(got, name) for name in shared} == {
        name: getattr(config, name) for name in shared
    }
    assert (got.mode, got.softcap, got.scale) == ("hard", 6.0, 8**-0.5)
    assert got.member is not None and got.groups == 4


def test_the_model_side_pattern_compiles_whole():
    """The model builds its pattern per call (:meth:`FocusConfig.pattern`): that compiles with
    ``fullgraph=True`` together with the attention (no graph break)."""
    config = FocusConfig(num_groups=4, window=3, sinks=1, gate_lambda=4.0)
    q, k, v, routing = inputs(5)

    def attend(q, k, v, probs):
        pattern = config.pattern(mode="soft", scale=0.25)
        return focus_attention(q, k, v, probs, pattern, check_finite=False)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager", dynamic=False)
    torch.testing.assert_close(compiled(q, k, v, routing.probs), attend(q, k, v, routing.probs))


def names_in_code(path: Path) -> set[str]:
    """The identifiers a module's code uses (names, attributes, keywords, parameters, string
    keys), docstrings excepted."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.keyword | ast.arg) and (node.arg is not None):
            found.add(node.arg)
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            found.add(str(node.value))
    return found


@pytest.mark.parametrize("module", PLUMBING)
def test_the_code_that_carries_the_pattern_names_no_gate_parameter(module):
    """A new gate parameter is a :class:`FocusPattern` field, the recipe's field of the same
    name, the rule and its copies (docs/architecture.md): the dispatcher, the model, context
    parallelism and the ring carry the pattern whole and never name one."""
    named = names_in_code(ROOT / module) & set(GATE_PARAMETERS)
    assert not named, f"{module} names {sorted(named)}: pass the FocusPattern instead"


def test_the_plumbing_check_sees_a_named_parameter(tmp_path):
    """The check above can fail: a module passing the gate by name is caught."""
    module = tmp_path / "m.py"
    docstring = '"""gate_lambda in a docstring is fine."""\n'
    module.write_text(docstring + "f(x, gate_lambda=p.gate_lambda)\n")
    assert "gate_lambda" in names_in_code(module)
    module.write_text(docstring + "f(x, pattern)\n")
    assert "gate_lambda" not in names_in_code(module)
