"""The ring's fused per-block kernel (FlexAttention with a block mask of the visiting block) equals
the blockwise one, and its block masks keep every allowed pair (no processes).

CPU FlexAttention runs eagerly: every pair goes through ``mask_mod`` and the block mask is
ignored, so the outputs are compared with :func:`~focus_pretrain.focus.reference.attend_block`
on CPU, the block masks are checked on their own against the brute-force pattern, and one
compiled CPU kernel (which does skip blocks) must give the eager result. Gradients (no CPU
FlexAttention backward) are compared on GPU only. The whole ring with the fused kernel runs in
``tests/multiprocess/test_context_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from focus_pretrain.focus.backends import AttentionPattern, BlockSide
from focus_pretrain.focus.lse import merge_by_lse
from focus_pretrain.focus.pattern import allowed_pairs, document_starts
from focus_pretrain.focus.reference import attend_block
from focus_pretrain.focus.router import Routing
from focus_pretrain.parallel import ring
from focus_pretrain.parallel.ring_kernels import (
    backward_block_kernel,
    flex_attend_block,
    fused_call,
    resolve_block_kernel,
    ring_request,
)
from focus_pretrain.parallel.sharding import zigzag_positions
from tests.helpers import random_probs, random_qkv
from tests.unit.test_flex_documents import check_block_mask, dense_blocks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # eager CPU FlexAttention notice


def ring_step(
    *,
    seq: int = 96,
    cp: int = 2,
    ranks: tuple[int, int] = (0, 1),
    b: int = 2,
    h: int = 4,
    hkv: int = 2,
    d: int = 8,
    groups: int = 4,
    mode: str = "hard",
    top_k: int = 1,
    local_only: bool = False,
    docs: float = 0.0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    **options,
) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one ring step: rank ``ranks[0]``'s zigzag queries against rank
    ``ranks[1]``'s block (random ``q [b, seq / cp, h, d]``, ``k, v``, assignments; documents
    starting with probability ``docs`` at each token)."""
    q_pos, k_pos = (zigzag_positions(seq, cp, r) for r in ranks)  # [s_loc] each
    s_loc = q_pos.shape[0]
    q, _, _ = random_qkv(b, s_loc, h, hkv, d, seed=seed, dtype=dtype)
    _, k, v = random_qkv(b, s_loc, h, hkv, d, seed=seed + 1, dtype=dtype)
    probs = random_probs(b, seq, groups, seed=seed + 2, sharpness=2.0).to(dtype)  # [b, seq, K]
    gen = torch.Generator().manual_seed(seed + 3)
    starts = document_starts((torch.rand(b, seq, generator=gen) < docs).cumsum(dim=1))
    routed = mode in ("hard", "hard_gated") and not local_only
    member = Routing(probs).membership(top_k) if routed else None  # [b, seq]
    soft = mode in ("soft", "hard_gated") and not local_only  # the gate reads the assignments

    def at(t: Tensor | None, pos: Tensor) -> Tensor | None:
        return None if t is None else t[:, pos]

    args = (
        q, k, v, at(probs, q_pos) if soft else None, at(probs, k_pos) if soft else None,
        at(member, q_pos), at(member, k_pos), at(starts, q_pos) if docs else None,
        at(starts, k_pos) if docs else None,
    )  # fmt: skip
    kwargs = dict(
        q_pos=q_pos, k_pos=k_pos, window=options.pop("window", 5), mode=mode, gate_lambda=4.0,
        softcap=options.pop("softcap", None), scale=d**-0.5, local_only=local_only,
        sinks=options.pop("sinks", 0),
    )  # fmt: skip
    assert not options, options
    return args, kwargs


def block_call(args: tuple, kwargs: dict) -> tuple:
    """``(q, k, v, pattern, queries, keys)``: a :func:`ring_step` as the per-block kernels take
    it (:class:`~focus_pretrain.focus.backends.BlockSide`)."""
    q, k, v, probs_q, probs_k, member_q, member_k, doc_q, doc_k = args
    keys = ("window", "mode", "gate_lambda", "softcap", "scale", "local_only", "sinks")
    pattern = AttentionPattern(**{key: kwargs[key] for key in keys})
    queries = BlockSide(kwargs["q_pos"], probs_q, member_q, doc_q)
    return q, k, v, pattern, queries, BlockSide(kwargs["k_pos"], probs_k, member_k, doc_k)


CASES = {
    "hard-top1": dict(mode="hard"),
    "hard-top2-docs-sinks": dict(mode="hard", top_k=2, docs=0.08, sinks=3),
    "hard-top3-softcap-mha": dict(mode="hard", top_k=3, softcap=2.0, hkv=4, ranks=(0, 0)),
    "hard-cp3-window0": dict(mode="hard", cp=3, ranks=(2, 1), window=0, sinks=1),
    "soft": dict(mode="soft", ranks=(0, 0)),
    "soft-docs-sinks-softcap-gqa": dict(mode="soft", hkv=1, docs=0.08, sinks=4, softcap=3.0),
    "soft-far": dict(mode="soft", ranks=(1, 0), window=40),
    "local-sinks-docs": dict(mode="hard", local_only=True, sinks=2, docs=0.05, ranks=(0, 0)),
    "local-offdiagonal": dict(mode="soft", local_only=True, window=20, cp=3, ranks=(1, 2)),
    "hard-bf16": dict(mode="hard", top_k=2, sinks=2, docs=0.05, dtype=torch.bfloat16),
    "soft-bf16": dict(mode="soft", sinks=2, softcap=2.0, dtype=torch.bfloat16, ranks=(0, 0)),
    "soft-fp64": dict(mode="soft", docs=0.05, dtype=torch.float64),
    # sparse training: the hard pattern (sorted sides) with the gate on its routed pairs
    "gated-top1-softcap": dict(mode="hard_gated", softcap=2.0, ranks=(0, 0)),
    "gated-top2-docs-sinks": dict(mode="hard_gated", top_k=2, docs=0.05, sinks=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fused_block_equals_blockwise(name):
    """``(out, lse)`` of the fused kernel equal ``attend_block``'s on arbitrary zigzag positions
    (rows with no allowed key included: ``out = 0``, ``lse = -inf`` in both)."""
    case = CASES[name]
    args, kwargs = ring_step(**case, seed=len(name))
    want, want_lse = attend_block(*block_call(args, kwargs))
    got, lse = flex_attend_block(*block_call(args, kwargs), block=16)
    assert got.dtype == want.dtype and lse.dtype == want_lse.dtype
    assert want.abs().max() > 0.1  # a real output, not zeros
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5, torch.float64: 1e-12}[want.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    q_rank, k_rank = case.get("ranks", (0, 1))
    if q_rank < k_rank:  # the query rank's first chunk precedes every key: no key there
        assert not finite.all() and finite.any()


def kernel_order_pattern(args: tuple, kwargs: dict) -> tuple[Tensor, BlockMask, bool]:
    """The fused call's block mask, the brute-force allowed pairs ``[b, Lq, Lk]`` in the
    kernel's token order, and whether that order is sorted (hard mode)."""
    _, _, _, _, _, member_q, member_k, doc_q, doc_k = args
    options = {key: kwargs[key] for key in ("window", "local_only", "sinks")}
    call = fused_call(*block_call(args, kwargs), block=8)
    routed = kwargs["mode"] in ("hard", "hard_gated") and not kwargs["local_only"]
    allowed = allowed_pairs(
        kwargs["q_pos"], kwargs["k_pos"], member_q=member_q if routed else None,
        member_k=member_k if routed else None, q_doc=doc_q, k_doc=doc_k, **options,
    )  # fmt: skip  # [b|1, Lq, Lk]
    allowed = allowed.expand(args[0].shape[0], -1, -1)
    plan = call.plan
    if plan.q.order is not None:
        orders = zip(allowed, plan.q.order, plan.k.order, strict=True)
        allowed = torch.stack([a[q_order][:, k_order] for a, q_order, k_order in orders])
    return allowed, call.block_mask, plan.q.order is not None


def test_block_masks_keep_every_allowed_pair_and_skip_others():
    """Random steps (modes, top-k, documents, sinks, windows, ranks, CP): every allowed pair
    lies in a kept block and full blocks hold only allowed pairs; across them, blocks are
    skipped and full blocks occur (the masks are sparse, not all-partial)."""
    gen = torch.Generator().manual_seed(0)

    def pick(*choices):
        return choices[int(torch.randint(len(choices), (1,), generator=gen))]

    kept = total = full = 0
    for seed in range(24):
        cp = pick(2, 3)
        case = dict(
            cp=cp, seq=48 * cp, ranks=(pick(*range(cp)), pick(*range(cp))),
            mode=pick("hard", "hard_gated", "soft"), top_k=pick(1, 2),
            local_only=pick(False, False, True),
            docs=pick(0.0, 0.03, 0.2), sinks=pick(0, 2, 5), window=pick(0, 3, 12), seed=seed,
        )  # fmt: skip
        args, kwargs = ring_step(**case)
        allowed, mask, _ = kernel_order_pattern(args, kwargs)
        blocks = check_block_mask(mask, allowed, 8)  # [b, nb, nb]
        kept, total = kept + int(blocks.sum()), total + blocks.numel()
        full += int(dense_blocks(mask)[1].sum())
    assert 0 < kept < 0.6 * total and full > 0


def test_hard_mode_sorts_blocks_by_group():
    """Hard top-1 with group-pure blocks: the sorted layout keeps the same-group blocks and the
    near ones only: far fewer blocks than the causal pairs' blocks."""
    args, kwargs = ring_step(seq=2048, cp=2, ranks=(1, 1), groups=4, window=2, seed=3)
    allowed, mask, is_sorted = kernel_order_pattern(args, kwargs)
    kept = check_block_mask(mask, allowed, 8)
    soft_args, soft_kwargs = ring_step(seq=2048, cp=2, ranks=(1, 1), mode="soft", seed=3)
    causal = dense_blocks(kernel_order_pattern(soft_args, soft_kwargs)[1])[0]
    assert is_sorted and kept.sum() < 0.5 * causal.expand_as(kept).sum()


@pytest.mark.slow  # a C++ kernel compile: about 12 s on 2 cores with a cold inductor cache
def test_compiled_cpu_kernel_honours_the_block_mask():
    """A compiled CPU kernel skips the blocks the mask leaves out and runs full blocks without
    ``mask_mod``: it gives the eager result (hard mode, documents, sinks, GQA, off-diagonal),
    and dropping the kept blocks of a query block changes it (the check has teeth). CPU
    compilation returns no ``lse``: the outputs are compared."""
    args, kwargs = ring_step(seq=256, ranks=(1, 0), docs=0.005, sinks=2, hkv=1, seed=4)
    call = fused_call(*block_call(args, kwargs), block=16)
    q, k, v = (t.transpose(1, 2) for t in (call.q, call.k, call.v))  # [b, L, H, D] -> [b, H, L, D]
    run = dict(score_mod=call.score_mod, scale=0.3, enable_gqa=True)
    compiled = torch.compile(flex_attention, dynamic=False)
    want = flex_attention(q, k, v, block_mask=call.block_mask, **run)
    torch.testing.assert_close(compiled(q, k, v, block_mask=call.block_mask, **run), want)
    assert call.plan.full.any() and not call.plan.candidate.all()
    mask = call.block_mask
    kv_num = mask.kv_num_blocks.clone()
    full_num = mask.full_kv_num_blocks.clone()
    kv_num[:, :, -1] = 0  # the last query block sees nothing
    full_num[:, :, -1] = 0
    dropped = BlockMask.from_kv_blocks(
        kv_num, mask.kv_indices, full_num, mask.full_kv_indices, BLOCK_SIZE=16,
        mask_mod=mask.mask_mod, seq_lengths=(q.shape[2], k.shape[2]),
    )  # fmt: skip
    assert not torch.allclose(compiled(q, k, v, block_mask=dropped, **run), want)


def test_block_kernel_selection():
    """``auto`` is blockwise on CPU; ``flex`` forced on CPU runs the forward only (the backward
    recomputes blockwise); an unknown kernel is refused (before any process group is used)."""
    q = torch.zeros(1, 4, 2, 8)
    assert resolve_block_kernel("auto", q) == "blockwise"
    for mode in ("soft", "hard", "hard_gated"):  # with and without gradients
        for grad in (False, True):
            request = ring_request(q, mode=mode, top_k=2, sinks=3, documents=True, needs_grad=grad)
            assert resolve_block_kernel("auto", q, request) == "blockwise"
    assert resolve_block_kernel("flex", q) == "flex"
    assert resolve_block_kernel("blockwise", q) == "blockwise"
    assert backward_block_kernel("flex", q) == "blockwise"
    with pytest.raises(ValueError, match="block_kernel must be one of"):
        resolve_block_kernel("fused", q)
    with pytest.raises(ValueError, match="block_kernel must be one of"):
        ring.ring_focus_attention(q, q, q, None, group=None, block_kernel="fused")


def test_ring_step_benchmark_smoke(tmp_path):
    """``tools/bench_ring_step.py`` on CPU at tiny sizes: every kernel runs (the fused forward
    matches blockwise), the table and JSON are written."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "tools" / "bench_ring_step.py"
    spec = importlib.util.spec_from_file_location("bench_ring_step", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = tool.main(
        ["--device", "cpu", "--seq", "128", "--cp", "2", "--groups", "4", "--heads", "2",
         "--head-dim", "16", "--window", "8", "--dtype", "fp32", "--warmup", "0", "--repeats",
         "1", "--sinks", "1", "--document", "40", "--json", str(tmp_path / "ring.json"),
         "--markdown", str(tmp_path / "ring.md")]
    )  # fmt: skip
    assert len(rows) == 4  # (hard, soft) x (diagonal, off-diagonal)
    for row in rows:
        assert {k["status"] for k in row["kernels"].values()} == {"ok"}
        assert row["check"]["out_rel_err"] < 1e-5 and row["check"]["lse_inf_agree"]
        assert row["kernels"]["flex"]["backward_kernel"] == "blockwise"  # CPU
        assert 0 < row["pair_density"] < 1
    assert json.loads((tmp_path / "ring.json").read_text())["rows"][0]["seq"] == 128
    assert "flex (bwd blockwise)" in (tmp_path / "ring.md").read_text()


# ----------------------------------------------------------------------------- gradients


def assert_step_gradients_agree(
    name: str | dict, device: str, dtype: torch.dtype, *, seq: int, d: int, fused: str = "flex"
) -> None:
    """The ring's forward and backward step (:func:`~focus_pretrain.parallel.ring._attend`,
    ``_block_grads``: gradients through the block's ``out`` and ``lse`` against a merged output
    shared with another block, and the assignments' in soft mode) with the fused kernel
    ``fused`` (``"flex"`` or ``"triton"``) equal the blockwise ones (relative L2 error)."""
    case = CASES[name] if isinstance(name, str) else name  # a case's name, or the case
    args, kwargs = ring_step(**dict(case, seq=seq, dtype=dtype, d=d), seed=7)
    q, k, v, probs_q, probs_k, member_q, member_k, doc_q, doc_k = (
        None if t is None else t.to(device) for t in args
    )
    kwargs = {
        key: val.to(device) if isinstance(val, Tensor) else val for key, val in kwargs.items()
    }
    soft = kwargs["mode"] in ("soft", "hard_gated") and not kwargs["local_only"]
    pattern = block_call(args, kwargs)[3]
    block = ring._block(k, v, kwargs["k_pos"], probs_k, member_k, doc_k)
    step = (q, probs_q, member_q, doc_q, kwargs["q_pos"], block, soft)
    results = {kernel: ring._attend(*step, ring.RingPlan(pattern, kernel), None)
               for kernel in ("blockwise", fused)}  # fmt: skip
    assert backward_block_kernel(fused, q) == fused
    out_b, lse_b = results["blockwise"]
    gen = torch.Generator(device=device).manual_seed(0)
    other = (torch.randn(out_b.shape, generator=gen, device=device).to(dtype),
             torch.where(torch.isfinite(lse_b), lse_b, 0.0) + 0.5)  # fmt: skip
    out, lse = merge_by_lse(results["blockwise"], other)
    d_out = torch.randn(out.shape, generator=gen, device=device, dtype=out.dtype)
    grads = {
        kernel: ring._block_grads(*step, ring.RingPlan(pattern, kernel), out, lse, d_out)
        for kernel in ("blockwise", fused)
    }
    tol = {torch.float64: 1e-10, torch.float32: 2e-4, torch.bfloat16: 3e-2}[dtype]
    pairs = [(results[fused][0], out_b), *zip(grads[fused], grads["blockwise"], strict=True)]
    assert len(pairs) == (6 if soft else 4)  # out, dq, dk, dv (, dprobs_k, dprobs_q)
    for i, (got, want) in enumerate(pairs):
        assert want.abs().max() > 0, i  # real gradients
        error = (got.double() - want.double()).norm() / want.double().norm()
        assert error < tol, (i, float(error))
    assert torch.equal(torch.isfinite(results[fused][1]), torch.isfinite(lse_b))


GRADIENT_CASES = ["hard-top2-docs-sinks", "soft-docs-sinks-softcap-gqa", "local-sinks-docs",
                  "hard-top3-softcap-mha", "gated-top1-softcap",
                  "gated-top2-docs-sinks"]  # fmt: skip


@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_fused_step_gradients_equal_blockwise_with_eager_backward(name, monkeypatch):
    """CPU, float64: PyTorch refuses CPU FlexAttention inputs that require grad, although its
    eager (dense) backward is exact; with the refusal lifted the fused kernel's backward (the
    same autograd graph as on GPU: sorting, ``lse`` gradient, assignments read by the
    ``score_mod``) equals the blockwise one."""
    import torch.nn.attention.flex_attention as api

    from focus_pretrain.parallel import ring_kernels

    monkeypatch.setattr(api, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(ring_kernels, "flex_backward_on", lambda device: True)
    assert_step_gradients_agree(name, "cpu", torch.float64, seq=96, d=8)


# ----------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", [*GRADIENT_CASES, "soft"])
def test_fused_ring_step_gradients_equal_blockwise_on_gpu(name, dtype):
    """The compiled fused kernel (``auto`` on CUDA) in the ring's forward and backward step:
    600 tokens per side (two zigzag chunks of 300; blocks of 128 with padding), head dim 64.
    Documents as long relative to the sequence as in the CPU cases (96 tokens): at the CPU
    cases' rate, 12-token documents leave no gated pair across the two blocks (zero
    assignment gradients, seen on an H200)."""
    assert resolve_block_kernel("auto", torch.zeros(1, 4, 2, 64, device="cuda")) == "flex"
    seq = 1200
    case = dict(CASES[name])
    if "docs" in case:
        case["docs"] *= 96 / seq  # [b, seq] document starts: the same count per sequence
    assert_step_gradients_agree(case, "cuda", dtype, seq=seq, d=64)
