"""The two copies of the pattern spec (``focus_pretrain/focus/pattern.py``) equal it.

* the standalone HF copy shipped with every export (``convert/hf_modeling/focus_rules.py``:
  it cannot import the package), function by function on random inputs;
* the Triton rules (``focus/pattern_triton.py``): ``tests/unit/test_pattern_triton.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from focus_pretrain.convert.hf_modeling import focus_rules
from focus_pretrain.focus import pattern


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hf_soft_gate_and_soft_cap_equal_the_spec(seed, dtype):
    g = _generator(seed)
    affinity = torch.rand(64, 32, generator=g, dtype=torch.float64).to(dtype)
    affinity[0, :4] = torch.tensor([0.0, 0.5, 1.0, 0.25]).to(dtype)  # the gate's edges and x = 0
    lam = float(torch.empty(()).uniform_(0.5, 40.0, generator=g))
    want = pattern.soft_gate(affinity, lam)
    got = focus_rules.soft_gate(affinity, lam)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = F.logsigmoid(lam * (affinity.double() - 0.5))  # and both are log sigmoid
    torch.testing.assert_close(want.double(), exact, rtol=1e-6, atol=1e-6)

    scores = torch.randn(8, 16, generator=g, dtype=torch.float64).mul(30).to(dtype)
    cap = float(torch.empty(()).uniform_(1.0, 50.0, generator=g))
    torch.testing.assert_close(
        focus_rules.soft_cap(scores, cap), pattern.soft_cap(scores, cap), rtol=0, atol=0
    )
    assert focus_rules.soft_cap(scores, None) is scores and pattern.soft_cap(scores, None) is scores
    assert pattern.soft_cap(scores, cap).abs().max() <= cap


def test_hf_soft_gate_gradient_equals_the_spec():
    affinity = torch.rand(40, dtype=torch.float64, generator=_generator(5))
    affinity[0] = 0.5  # x = 0: the derivative is lambda * sigmoid(0) = lambda / 2
    grads = []
    for fn in (pattern.soft_gate, focus_rules.soft_gate):
        leaf = affinity.clone().requires_grad_(True)
        fn(leaf, 7.0).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
    torch.testing.assert_close(grads[0], 7.0 * torch.sigmoid(-7.0 * (affinity - 0.5)))


@pytest.mark.parametrize("seed", range(6))
def test_hf_pair_rule_and_groups_equal_the_spec(seed):
    g = _generator(seed)
    b, n = 3, 48
    pos = torch.arange(n)
    ids = torch.randint(0, 4, (b, n), generator=g).sort(dim=1).values  # packed documents
    docs = pattern.document_starts(ids)  # [b, n]
    window = int(torch.randint(0, n, (), generator=g))
    sinks = int(torch.randint(0, 6, (), generator=g))
    grid = dict(q_pos=pos[None, :, None], k_pos=pos[None, None, :], window=window, sinks=sinks)
    for extra in (
        {},
        {"q_doc": docs[:, :, None], "k_doc": docs[:, None, :]},
        {"k_doc": docs[:, None, :]},
    ):
        want = pattern.pair_rule(**grid, **extra)
        got = focus_rules.pair_rule(**grid, **extra)
        for w, o in zip(want, got, strict=True):
            assert torch.equal(w, o)
    # the spec's masks are built from the same rule: the copy gives the same always-attended set
    causal, near = focus_rules.pair_rule(**grid, q_doc=docs[:, :, None], k_doc=docs[:, None, :])
    _, local = pattern.causal_and_local(pos, pos, window, sinks, q_doc=docs, k_doc=docs)
    assert torch.equal(causal & near, local)
    members = torch.randint(1, 1 << 10, (b, n), generator=g)
    assert torch.equal(
        focus_rules.groups_intersect(members[:, :, None], members[:, None, :]),
        pattern.shares_group(members, members),
    )


def test_hf_rules_file_is_standalone():
    """The copy imports nothing but torch (it ships inside exports)."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(focus_rules.__file__).read_text())
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= {"__future__", "torch"}, imported


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hf_dot_gate_equals_the_package_channels(dtype):
    """The HF copy's dot-gate term equals what the package's extra channels add to the scores
    (``focus/gate_forms.py``)."""
    from focus_pretrain.focus.gate_forms import dot_gate_channels

    g = _generator(11)
    b, s, heads, d, groups, lam, scale = 2, 9, 2, 6, 5, 7.5, 0.3
    q, k, v = (torch.randn(b, s, heads, d, generator=g, dtype=dtype) for _ in range(3))
    probs = torch.softmax(torch.randn(b, s, groups, generator=g, dtype=dtype), dim=-1)
    q2, k2, _ = dot_gate_channels(q, k, v, probs, gate_lambda=lam, scale=scale)
    added = torch.einsum("bqhd,bkhd->bhqk", q2, k2) - torch.einsum("bqhd,bkhd->bhqk", q, k)
    want = focus_rules.dot_gate(probs, probs, lam)  # [b, q, kv]
    torch.testing.assert_close(added * scale, want[:, None].expand_as(added))


@pytest.mark.parametrize("seed", range(4))
def test_hf_key_rule_equals_the_spec(seed):
    """``key_groups="own_and_previous"``: the copy's predecessor, bitmasks and soft assignments
    equal the spec's, with and without packed documents; the copy's padding rule
    (``key_documents``) gives a real token after padding no predecessor and keeps the
    documents' starts."""
    g = _generator(seed)
    b, n, groups = 3, 40, 6
    ids = torch.randint(0, 4, (b, n), generator=g).sort(dim=1).values
    docs = pattern.document_starts(ids)  # [b, n]
    members = torch.randint(1, 1 << groups, (b, n), generator=g)
    probs = torch.softmax(torch.randn(b, n, groups, generator=g, dtype=torch.float64), dim=-1)
    for documents in (None, docs):
        for want, got in zip(
            pattern.previous_in_document(probs, documents),
            focus_rules.previous_in_document(probs, documents),
            strict=True,
        ):
            assert torch.equal(want, got)
        assert torch.equal(
            focus_rules.key_memberships(members, documents),
            pattern.key_memberships(members, documents),
        )
        torch.testing.assert_close(
            focus_rules.key_assignments(probs, documents),
            pattern.key_assignments(probs, documents),
            rtol=0,
            atol=0,
        )
    valid = torch.ones(b, n, dtype=torch.bool)
    pad = [0, 5, 17]  # left padding of each row
    for r, p in enumerate(pad):
        valid[r, :p] = False
    starts = focus_rules.key_documents(valid, docs)  # [b, n]
    positions = torch.arange(n)
    for r, p in enumerate(pad):
        has_previous = (starts[r] != positions).tolist()
        want = [j > 0 and bool(valid[r, j - 1]) and int(docs[r, j]) != j for j in range(n)]
        assert has_previous == want, r
        assert not has_previous[p]  # the first real token
    own_probs, own_members = focus_rules.key_routing(probs, members, valid, "own", docs)
    assert own_probs is probs and own_members is members
    key_probs, key_members = focus_rules.key_routing(
        probs, members, valid, "own_and_previous", docs
    )
    assert torch.equal(key_members, pattern.key_memberships(members, starts))
    torch.testing.assert_close(key_probs, pattern.key_assignments(probs, starts), rtol=0, atol=0)
