"""The shipped (standalone) code validates its ``focus`` settings as strictly as ``FocusConfig``:
the same values accepted and refused, at load and when edited on a loaded model."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from focus_pretrain.convert.hf_export import EXPORTED_FOCUS_FIELDS, load_modeling
from focus_pretrain.focus import FocusConfig
from tests.unit.test_hf_generation import focus_model

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)

modeling = load_modeling()
configuration = sys.modules[modeling.FocusLlamaConfig.__module__]  # configuration_focus

# values to try per field: valid ones, edge ones and wrong types
TRIALS = {
    "num_groups": [1, 2, 4, 8, 64, 65, 0, -3, 2.0, "8", None, True],
    "group_dim": [1, 16, 0, -1, 16.0, None],
    "window": [0, 1, 128, -1, 3.5, "128", None],
    "top_k": [1, 2, 3, 4, 8, 9, 0, -1, 1.0, None, False],
    "sinks": [0, 1, 4, -1, 0.5, None],
    "tau": [0.1, 1, 1e-6, 0, -0.1, float("inf"), float("nan"), "0.1", None, True],
    "gate_lambda": [10.0, 1, 0.0, -5.0, float("inf"), None],
    "inference_mode": ["hard", "soft", "hrad", "HARD", "", None],
    "backend": ["auto", "reference", "flex", "triton", "decomposed", "fast", None],
    "inference_backend": ["auto", "reference", "flex", "decomposed", "triton", "fast", None],
    "key_groups": ["own", "own_and_previous", "own_and_previous", "previous", None],
    "gate_form": ["sigmoid", "dot", "Dot", None],
}


def _package_accepts(focus: dict) -> bool:
    try:
        FocusConfig(**{k: v for k, v in focus.items() if k in EXPORTED_FOCUS_FIELDS})
    except (ValueError, TypeError):
        return False
    return True


def _shipped_accepts(focus: dict) -> bool:
    try:
        configuration.validate_focus(focus)
    except ValueError:
        return False
    return True


def _cases(seed: int, count: int) -> list[dict]:
    """Defaults with one to three fields changed (several together reach the cross rules:
    top_k vs num_groups, backends vs mode and top_k)."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        focus = dict(configuration.FOCUS_DEFAULTS)
        for name in rng.sample(sorted(TRIALS), rng.randint(1, 3)):
            focus[name] = rng.choice(TRIALS[name])
        cases.append(focus)
    return cases


@pytest.mark.parametrize("seed", range(3))
def test_the_shipped_copy_accepts_and_refuses_what_focus_config_does(seed):
    cases = _cases(seed, 400)
    verdicts = [(_package_accepts(c), _shipped_accepts(c)) for c in cases]
    differ = [c for c, (ours, shipped) in zip(cases, verdicts, strict=True) if ours != shipped]
    assert not differ, differ[:3]
    assert any(a for a, _ in verdicts) and not all(a for a, _ in verdicts)  # both kinds seen


def test_the_shipped_code_is_stricter_only_where_it_must_be():
    """Flags must be booleans (the recipe loader checks them for FocusConfig); unknown keys are
    refused; ``dense`` is the shipped code's own backend."""
    base = dict(configuration.FOCUS_DEFAULTS)
    for flag in ("enabled", "window_only", "normalize"):
        with pytest.raises(ValueError, match=rf"focus.{flag} must be true or false, got 'yes'"):
            configuration.validate_focus({**base, flag: "yes"})
    with pytest.raises(ValueError, match=r"unknown focus key\(s\) topk; allowed keys: enabled"):
        configuration.validate_focus({**base, "topk": 2})
    configuration.validate_focus({**base, "backend": "dense", "inference_backend": "dense"})


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(top_k=0), r"focus.top_k must be >= 1, got 0"),
        (dict(window=-1), r"focus.window must be >= 0, got -1"),
        (dict(inference_mode="hrad"), r"focus.inference_mode must be one of 'hard', 'soft'"),
        (dict(top_k=5), r"focus.top_k must be <= num_groups \(4\), got 5"),
    ],
)
def test_bad_settings_are_refused_at_load_and_when_edited(change, message):
    """At config construction (what ``from_pretrained`` of an edited config.json does) and on a
    loaded model whose ``config.focus`` is edited (it ran the soft pattern silently before)."""
    with pytest.raises(ValueError, match=message):
        focus_model(**change)
    model = focus_model()
    ids = torch.randint(0, 50, (1, 6))
    with torch.no_grad():
        model(ids)
        model.config.focus.update(change)
        with pytest.raises(ValueError, match=message):
            model(ids)
        model.config.focus.update({k: focus_model().config.focus[k] for k in change})
        model(ids)  # restored: runs again


def test_every_registered_backend_exports_to_a_config_the_shipped_code_loads():
    """The shipped code's backend names are the registry's (plus its own ``dense``), and an
    export of any setting FocusConfig accepts, whatever backend it trained or inferred with, is
    accepted by the shipped code: a backend it lacks becomes ``auto`` (a speed choice, not the
    pattern), the others stay as they were."""
    from focus_pretrain.convert.hf_export import _focus_section
    from focus_pretrain.focus.backends import backend_names, training_backend_names

    choices = configuration.FOCUS_CHOICES
    assert set(choices["backend"]) - {"dense"} <= set(training_backend_names())
    assert set(choices["inference_backend"]) - {"dense"} <= set(backend_names())
    exported = 0
    for backend in training_backend_names():
        for inference_backend in backend_names():
            for extra in ({}, {"training_mode": "hard"}, {"top_k": 2}, {"window_only": True}):
                settings = dict(backend=backend, inference_backend=inference_backend, **extra)
                try:
                    focus = FocusConfig(**settings)
                except ValueError:
                    continue
                section = _focus_section(focus)
                configuration.validate_focus(section)  # loads
                for key in ("backend", "inference_backend"):
                    kept = settings[key] in choices[key]
                    assert section[key] == (settings[key] if kept else "auto"), settings
                exported += 1
    assert exported > 20  # a real sweep, with the segments and sdpa cases among them


@pytest.mark.parametrize(
    "built,edit",
    [
        (dict(), dict(enabled=False)),
        (dict(), dict(window_only=True)),
        (dict(enabled=False), dict(enabled=True)),
        (dict(window_only=True), dict(window_only=False)),
        (dict(window_only=True), dict(window=5)),
    ],
)
def test_editing_what_building_fixed_after_loading_is_refused(built, edit):
    """``enabled`` and ``window_only`` decide which layers get a router when the model is
    built (and a window-only model's layers keep their window): an edit of them on a loaded
    model would silently run the layers as built (the Focus pattern for a model meant dense),
    so it is refused, naming how to load it instead; the same settings given at load time
    run (with a router or without, as asked)."""
    model = focus_model(**built)
    ids = torch.randint(1, 50, (1, 8))
    before = {k: model.config.focus[k] for k in edit}
    with torch.no_grad():
        model(ids)
        model.config.focus.update(edit)
        with pytest.raises(ValueError, match=r"load it again with them set, e\.g\. from_pretr"):
            model(ids)
        model.config.focus.update(before)
        model(ids)  # restored: runs again
    rebuilt = focus_model(**{**built, **edit})
    routers = [m for m in rebuilt.modules() if hasattr(m, "router")]
    focus = rebuilt.config.focus
    assert bool(routers) == (focus["enabled"] and not focus["window_only"])
    with torch.no_grad():
        rebuilt(ids)


def test_a_replaced_focus_dict_is_refused_and_a_partial_one_at_load_is_completed(tmp_path):
    """The routers read the dict the model was built with: ``config.focus`` replaced by
    another (``model.config.focus = {...}``) would be ignored by them, so it is refused; a
    ``focus`` given to ``from_pretrained`` (set without the config's ``__init__``) is completed
    with the defaults and checked when the model is built, and runs as the same settings
    built in code."""
    model = focus_model(top_k=1)
    ids = torch.randint(1, 50, (1, 12))
    with torch.no_grad():
        expected = model(ids).logits
        model.config.focus = {**model.config.focus, "top_k": 2}
        with pytest.raises(ValueError, match=r"config.focus was replaced by another dict"):
            model(ids)
    model.save_pretrained(tmp_path)
    cls = type(model)
    partial = {k: v for k, v in model.config.focus.items() if k != "gate_lambda"}
    partial["top_k"] = 1
    loaded = cls.from_pretrained(tmp_path, focus=partial).eval()
    assert loaded.config.focus["gate_lambda"] == configuration.FOCUS_DEFAULTS["gate_lambda"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected)
    with pytest.raises(ValueError, match=r"focus.top_k must be <= num_groups \(4\), got 5"):
        cls.from_pretrained(tmp_path, focus={**partial, "top_k": 5})


def test_the_keys_rules_and_their_backends_are_the_registrys():
    """``key_groups``: the shipped choices are the package's rules, and the backends the
    shipped code lets compute ``own_and_previous`` are those whose capabilities include it
    (plus ``auto`` and the shipped ``dense`` path); a named other one is refused by name."""
    from focus_pretrain.focus.backends import backend_names, get_backend
    from focus_pretrain.focus.pattern_settings import KEY_GROUPS

    assert tuple(configuration.FOCUS_CHOICES["key_groups"]) == tuple(KEY_GROUPS)
    computes = {
        name
        for name in backend_names()[1:]  # [0]: auto
        if "own_and_previous" in get_backend(name).capabilities.key_groups
    }
    assert set(configuration.KEY_GROUPS_BACKENDS) == computes | {"auto", "dense"}
    base = {**configuration.FOCUS_DEFAULTS, "key_groups": "own_and_previous"}
    configuration.validate_focus(base)
    with pytest.raises(ValueError, match=r"focus.inference_backend 'decomposed' does not comp"):
        configuration.validate_focus({**base, "inference_backend": "decomposed"})
    with pytest.raises(ValueError, match=r"needs focus.gate_form='sigmoid', got 'dot'"):
        configuration.validate_focus({**base, "gate_form": "dot"})
