"""Capturable Focus: the hot paths compile whole and ask nothing of the host.

* ``torch.compile(fullgraph=True)`` (which raises on any graph break) over ``focus_attention``
  for hard top-1 (``decomposed``), hard top-k (``flex``, k = 2, 3), the soft training pattern
  (forward through ``flex``; forward + backward through ``reference``, the CPU training path)
  and sliding-window layers, with packed documents and sinks, and the keys' rule
  (``key_groups``: flex hard, sparse training and soft); each output equals the eager
  reference. Calls that reach FlexAttention compile with the ``aot_eager`` backend: the whole
  graph is captured (dynamo and AOT autograd), but Inductor's CPU FlexAttention takes no
  log-sum-exp (torch 2.13: "CPU only supports inference and return_lse is not supported"), which
  the Focus merge needs; on CUDA Inductor lowers it. The rest compiles with Inductor.
* Eager calls of the paths CUDA runs (``flex``: the group-sorted layout, its block masks, the
  band) dispatch no host sync (:class:`~focus_pretrain.bench.dispatch.DispatchCounter`).
* A training step's Focus parts (routers, attention, the balance update over the ranks) sync
  with the host 0 times; the interval's statistics once.
"""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.bench.dispatch import DispatchCounter
from focus_pretrain.focus.attention import focus_attention
from focus_pretrain.focus.decomposed import flash_attn_available, torch_varlen_installed
from focus_pretrain.focus.flex import SortedSide, flex_available_on, same_group_blocks
from focus_pretrain.focus.pattern import document_starts, key_memberships
from focus_pretrain.focus.router import Routing, hard_membership
from focus_pretrain.focus.sorted_layout import GroupSortedLayout, layout_tensors
from tests.distributed import run_workers
from tests.helpers import random_probs, random_qkv

pytestmark = [pytest.mark.capture, pytest.mark.torch]

B, N, H, HKV, D, GROUPS, WINDOW = 2, 256, 4, 2, 16, 5, 24


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its own graph: no recompile counted against the test before."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(seed: int, *, requires_grad: bool = False):
    q, k, v = random_qkv(B, N, H, HKV, D, seed=seed, dtype=torch.float32)
    probs = random_probs(B, N, GROUPS, seed=seed + 1, sharpness=2.0).float()
    documents = torch.zeros(B, N, dtype=torch.int64)  # [b, n] ids: 3 documents, then 2
    documents[0, 90:], documents[0, 200:], documents[1, 150:] = 1, 2, 1
    tensors = [t.requires_grad_(requires_grad) for t in (q, k, v, probs)]
    return tensors, documents


def _attend(backend: str, mode: str, top_k: int, packed: bool, key_groups: str = "own"):
    def attend(q, k, v, probs, documents):
        return focus_attention(
            q, k, v, probs, window=WINDOW, mode="hard" if mode == "local" else mode,
            top_k=top_k, backend=backend, local_only=mode == "local", check_finite=False,
            sinks=3 if packed else 0, documents=documents if packed else None,
            key_groups=key_groups,
        )  # fmt: skip

    return attend


RULE = "own_and_previous"  # key_groups: a key in its predecessor's groups too
CASES = [  # (backend, mode, top_k, key_groups); triton's: tests/unit/test_triton_capture.py
    ("decomposed", "hard", 1, "own"),
    ("flex", "hard", 1, "own"),
    ("flex", "hard", 2, "own"),
    ("flex", "hard", 3, "own"),
    ("flex", "soft", 1, "own"),
    ("flex", "local", 1, "own"),
    ("decomposed", "local", 1, "own"),
    ("flex", "hard", 1, RULE),  # the keys sorted by their own bitmasks
    ("flex", "hard", 2, RULE),
    ("flex", "hard_gated", 2, RULE),
    ("flex", "soft", 1, RULE),
]


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents+sinks"])
@pytest.mark.parametrize("backend, mode, top_k, key_groups", CASES)
def test_attention_compiles_whole_and_equals_the_reference(
    backend, mode, top_k, key_groups, packed
):
    (q, k, v, probs), documents = _inputs(seed=top_k + 3 * packed)
    reaches_flex = backend == "flex" or mode == "hard"  # the decomposed CPU graph: flex + band
    compiler = "aot_eager" if reaches_flex else "inductor"
    attend = _attend(backend, mode, top_k, packed, key_groups)
    compiled = torch.compile(attend, fullgraph=True, backend=compiler, dynamic=False)
    got = compiled(q, k, v, probs, documents)
    want = _attend("reference", mode, top_k, packed, key_groups)(q, k, v, probs, documents)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mode", ["soft", "local"])
def test_training_pattern_compiles_whole_forward_and_backward(mode):
    """The CPU training path (``reference``): compiled forward + backward, gradients of ``q``,
    ``k``, ``v`` and the soft assignments equal to eager ones."""
    inputs, documents = _inputs(seed=11, requires_grad=True)
    attend = _attend("reference", mode, 1, packed=True)
    grad_out = torch.randn(B, N, H, D, generator=torch.Generator().manual_seed(12))
    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    wrt = inputs if mode == "soft" else inputs[:3]  # a sliding-window layer has no routing
    got = torch.autograd.grad((compiled(*inputs, documents) * grad_out).sum(), wrt)
    want = torch.autograd.grad((attend(*inputs, documents) * grad_out).sum(), wrt)
    for name, g, w in zip(("q", "k", "v", "probs"), got, want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents+sinks"])
@pytest.mark.parametrize(
    "mode, top_k, key_groups",
    [("hard", 1, "own"), ("hard", 3, "own"), ("soft", 1, "own"), ("local", 1, "own"),
     ("hard", 2, RULE), ("hard_gated", 1, RULE), ("soft", 1, RULE)],
)  # fmt: skip
def test_cuda_paths_dispatch_no_host_sync(mode, top_k, key_groups, packed):
    """The FlexAttention path (what CUDA runs for hard top-k, soft and local layers, and for
    the decomposed backend's same-group part with documents; the keys' rule too), counted
    eagerly."""
    (q, k, v, probs), documents = _inputs(seed=5)
    with DispatchCounter() as counter:
        _attend("flex", mode, top_k, packed, key_groups)(q, k, v, probs, documents)
    assert counter.host_syncs == 0, counter.sync_ops
    assert counter.launches > 0  # the counter saw the call


def test_group_sorted_layout_dispatches_no_host_sync():
    member = 1 << torch.randint(0, GROUPS, (B, N))
    _, documents = _inputs(seed=1)
    for docs, slots in ((None, GROUPS), (documents, None)):
        with DispatchCounter() as counter:
            layout = GroupSortedLayout.build(member, docs, slots=slots)
        assert counter.host_syncs == 0, counter.sync_ops
        assert layout.cu_seqlens.shape == (B * (slots or N) + 1,)


def test_counter_sees_host_syncs():
    """The counter itself: ``.item()``, ``nonzero`` and boolean indexing are syncs; a view is no
    launch."""
    x = torch.randn(10)
    with DispatchCounter() as counter:
        x.sum().item()
        torch.nonzero(x > 0)
        x[x > 0]
        x.view(2, 5)
    assert counter.sync_ops == {"_local_scalar_dense": 1, "nonzero": 1, "index": 1}
    assert counter.ops["view"] == 0 and counter.ops["sum"] == 1


@pytest.mark.multiprocess
def test_training_step_focus_parts_cause_no_host_sync():
    """Two micro-batches of a tiny Focus model (megatron-core GPTModel, routers with the causal
    balance) forward and backward, then the balance update over the ranks: 0 host syncs; the
    interval's largest group share: 1 (read once per log interval)."""
    for result in run_workers(
        "tests.multiprocess.workers_capture:training_step_syncs", 2, {"sinks": 2}, 2
    ):
        assert result["step_syncs"] == {}
        assert result["interval_syncs"] == {"_local_scalar_dense": 1}
        assert result["routers"] == 2 and all(result["offsets_moved"])
        assert 1 / 8 <= result["share"] <= 1


@pytest.mark.parametrize("key_groups", ["own", RULE])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
def test_compiled_block_mask_builder_equals_eager(packed, key_groups):
    """CUDA builds the same-group block mask compiled (its small operators fused): the compiled
    builder gives exactly the eager block tables, with and without documents, with the keys'
    own layout (``key_groups``) or the queries'."""
    member = 1 << torch.randint(0, GROUPS, (B, N), generator=torch.Generator().manual_seed(4))
    _, documents = _inputs(seed=2)
    starts = document_starts(documents) if packed else None
    layout = GroupSortedLayout.build(member, starts, slots=None if packed else GROUPS)
    keys = None
    if key_groups == RULE:
        keys = SortedSide.of(GroupSortedLayout.build(key_memberships(member, starts), starts))
    args = (SortedSide.of(layout), keys, 32)
    eager = same_group_blocks(*args)
    compiled = torch.compile(same_group_blocks.eager, fullgraph=True, dynamic=False)(*args)
    for want, got in zip(eager.as_tuple(), compiled.as_tuple(), strict=True):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want)
    assert int(eager.kv_num_blocks.sum()) < (N * B // 32) ** 2  # sparse: not every block pair


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "documents"])
def test_compiled_layout_equals_eager(packed):
    """CUDA builds the group-sorted layout compiled (fused): the same tensors as eagerly."""
    member = 1 << torch.randint(0, GROUPS, (B, N), generator=torch.Generator().manual_seed(8))
    _, documents = _inputs(seed=3)
    starts = document_starts(documents) if packed else None
    args = (member, starts, N if packed else GROUPS)
    eager = layout_tensors.eager(*args)
    compiled = torch.compile(layout_tensors.eager, fullgraph=True, dynamic=False)(*args)
    for want, got in zip(eager, compiled, strict=True):
        assert (want is None and got is None) or torch.equal(got, want)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_compiled_membership_equals_eager(top_k):
    """CUDA computes the hard membership (top-k + bit packing) compiled: the same bitmasks as
    eagerly, and as a brute-force packing of each token's top-k groups."""
    probs = torch.softmax(torch.randn(B, N, GROUPS, generator=torch.Generator().manual_seed(5)), -1)
    eager = hard_membership.eager(probs, top_k)
    compiled = torch.compile(hard_membership.eager, fullgraph=True, dynamic=False)(probs, top_k)
    assert torch.equal(compiled, eager) and eager.dtype == torch.int64
    ranks = probs.argsort(dim=-1, descending=True)[..., :top_k]  # [b, s, top_k]
    brute = torch.zeros(B, N, dtype=torch.int64)
    for j in range(top_k):
        brute |= 1 << ranks[..., j]
    assert torch.equal(eager, brute)
    assert torch.equal(Routing(probs).membership(top_k), eager)


def test_finite_check_compiles_as_a_device_assertion():
    """``check_finite=True`` inside a compiled graph: no graph break; NaN input still fails."""
    (q, k, v, probs), _ = _inputs(seed=9)

    def attend(q, k, v, probs):
        return focus_attention(q, k, v, probs, window=WINDOW, backend="reference")

    compiled = torch.compile(attend, fullgraph=True, dynamic=False, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, probs), attend(q, k, v, probs))
    q[0, 3, 1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="q contains NaN or inf"):
        compiled(q, k, v, probs)


@pytest.mark.parametrize("mode", ["hard", "soft", "local"])
def test_automatic_backend_choice_compiles_whole(mode):
    """``backend="auto"`` (the model's default): choosing the backend is traced too."""
    (q, k, v, probs), documents = _inputs(seed=13)
    attend = _attend("auto", mode, 1, packed=True)
    compiled = torch.compile(attend, fullgraph=True, dynamic=False, backend="aot_eager")
    want = _attend("reference", mode, 1, packed=True)(q, k, v, probs, documents)
    torch.testing.assert_close(compiled(q, k, v, probs, documents), want, rtol=2e-5, atol=2e-5)


def test_availability_checks_look_nothing_up_when_called(monkeypatch):
    """On a CUDA machine choosing a backend asks which packages are installed, inside the
    captured call, where dynamo refuses ``importlib.util.find_spec`` (the ``graphs`` stage
    stopped on it on an H200): the answers are constants looked up at import. CUDA is pretended
    (eagerly: dynamo itself would use it) so that the checks take their CUDA branches."""
    import importlib.util

    def refuse(name, *args):
        raise AssertionError(f"find_spec({name!r}) at call time")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", refuse)
    assert flex_available_on("cuda")  # triton is a dependency
    flash_attn_available(), torch_varlen_installed()  # answered without a lookup
