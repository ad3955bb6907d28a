"""Context-parallel Focus attention equals the single-process result (real gloo processes)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from tests.multiprocess.workers_model import LLAMA

pytestmark = pytest.mark.multiprocess
WORKERS = "tests.multiprocess.workers_cp"
BASE = dict(b=2, s=32, h=4, hkv=2, d=8, k=4, window=3, seed=0)
# packed documents (lengths per sample, 32 tokens): a one-token document, one shorter than the
# window (3), documents across zigzag chunks (of 8 tokens at CP=2, 4 at CP=4)
DOCS = [[5, 1, 2, 11, 13], [1, 14, 3, 9, 5]]
# soft ring, the same documents in both samples: the ring skips (query shard, key shard)
# blocks with no same-document causal pair; with shorter documents, more of them
LAYOUTS = {"none": None, "long": [6, 12, 14], "pairs": [8] * 4, "chunks": [4] * 8}


def cases() -> list[dict]:
    out = []
    for cp_mode in ("a2a", "ring"):
        for mode in ("soft", "hard"):
            out.append(dict(BASE, cp_mode=cp_mode, mode=mode, seed=len(out)))
        out.append(dict(BASE, cp_mode=cp_mode, mode="hard", top_k=2, softcap=2.0, seed=len(out)))
        out.append(dict(BASE, cp_mode=cp_mode, mode="soft", hkv=1, window=0, seed=len(out)))
        out.append(dict(BASE, cp_mode=cp_mode, mode="soft", local_only=True, seed=len(out)))
    # the ring's query-row chunks (3 rows of 4 heads x 2 samples against the block)
    out.append(dict(BASE, cp_mode="ring", mode="soft", score_budget=3 * 4 * 2 * 16, seed=99))
    out.append(dict(BASE, cp_mode="ring", mode="hard", score_budget=3 * 4 * 2 * 16, seed=98))
    # attention sinks (global positions < S: rank 0's first chunk; at CP=4 (chunks of 4) 6 sinks
    # also take rank 1's first chunk); more sinks than the window (3)
    out.append(dict(BASE, cp_mode="a2a", mode="soft", sinks=3, seed=97))
    out.append(dict(BASE, cp_mode="a2a", mode="hard", top_k=2, sinks=6, seed=96))
    # sparse training: all-to-all (whole-sequence attention per head) and ring (the hard
    # pattern's blocks only, the gate's gradient travelling with the blocks)
    out.append(dict(BASE, cp_mode="a2a", mode="hard_gated", seed=89))
    out.append(dict(BASE, cp_mode="a2a", mode="hard_gated", top_k=2, sinks=3, docs=DOCS, seed=88))
    out.append(dict(BASE, cp_mode="ring", mode="hard_gated", softcap=2.0, seed=87))
    out.append(dict(BASE, cp_mode="ring", mode="hard_gated", top_k=2, sinks=3, docs=DOCS,
                    score_budget=3 * 4 * 2 * 16, seed=86))  # fmt: skip
    out.append(dict(BASE, cp_mode="ring", mode="soft", sinks=6, softcap=2.0, seed=95))
    out.append(dict(BASE, cp_mode="ring", mode="hard", sinks=1, score_budget=3 * 4 * 2 * 16,
                    seed=94))  # fmt: skip
    out.append(dict(BASE, cp_mode="ring", mode="hard", top_k=2, sinks=6, seed=93))
    out.append(dict(BASE, cp_mode="ring", mode="soft", local_only=True, sinks=5, seed=92))
    # a key also in its predecessor's groups (key_groups): all-to-all attends whole sequences,
    # so a shard's first key finds its predecessor on another rank
    previous = dict(BASE, cp_mode="a2a", key_groups="own_and_previous")
    out.append(dict(previous, mode="soft", docs=DOCS, sinks=2, seed=85))
    out.append(dict(previous, mode="hard", top_k=2, seed=84))
    out.append(dict(previous, mode="hard_gated", softcap=2.0, seed=83))
    # packed documents: each sequence's documents equal the single process with documents
    for cp_mode in ("a2a", "ring"):
        doc = dict(BASE, cp_mode=cp_mode, docs=DOCS)
        out.append(dict(doc, mode="soft", seed=len(out)))
        out.append(dict(doc, mode="hard", seed=len(out)))
        out.append(dict(doc, mode="hard", top_k=2, softcap=2.0, seed=len(out)))
        out.append(dict(doc, mode="soft", hkv=1, window=0, sinks=2, seed=len(out)))
        out.append(dict(doc, mode="hard", top_k=2, sinks=3, seed=len(out)))
        out.append(dict(doc, mode="soft", local_only=True, sinks=2, seed=len(out)))
    out.append(dict(BASE, cp_mode="ring", mode="hard", docs=DOCS, sinks=1,
                    score_budget=3 * 4 * 2 * 16, seed=91))  # fmt: skip
    for name, lengths in LAYOUTS.items():
        docs = None if lengths is None else [lengths, lengths]
        out.append(dict(BASE, cp_mode="ring", mode="soft", docs=docs, layout=name, seed=90))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["cp2", "cp4"])
def cp_results(request):
    size = request.param
    return size, run_workers(f"{WORKERS}:attention_matches_single_process", size, cases())


def test_output_and_gradients_equal_single_process(cp_results):
    size, per_rank = cp_results
    for case, result in zip(cases(), per_rank[0]["cases"], strict=True):
        label = f"CP={size} {case}"
        assert result["scale"] > 0.1, label  # a real output, not zeros
        assert result["output"] < 1e-9, label
        q, k, v, *router = result["grads"]
        assert max(q, k, v) < 1e-9, label
        if not case.get("local_only"):
            assert router and max(router) < 1e-9, label  # soft: through the gate; hard: none
        if case["mode"] == "hard_gated":  # sparse training: the routers learn through the gate
            assert result["router_grad"] > 1e-6, label


def test_ring_refuses_what_it_cannot_compute(cp_results):
    """Inside the ring every block runs the exact per-block attention: another backend is
    refused by name, and ``check_finite`` rejects NaN inputs (it is honoured, not ignored)."""
    _, per_rank = cp_results
    for result in per_rank:
        refusals = result["refusals"]
        assert "backend 'decomposed' cannot run inside the ring" in refusals["backend"]
        assert "v contains NaN or inf values" in refusals["nan"]
        assert "must be the document starts of the full sequence" in refusals["ids"]
        assert "must be the document starts of the full sequence" in refusals["a2a_ids"]
        assert "documents must be an integer tensor" in refusals["float"]


def test_ring_skips_exactly_the_blocks_without_allowed_pairs(cp_results):
    """Every ring case (hard, soft, local-only, sinks, documents) skips exactly the blocks in
    which the whole-sequence pattern has no allowed pair (brute force over ``[b, s, s]``)."""
    _, per_rank = cp_results
    for i, case in enumerate(cases()):
        if case["cp_mode"] == "ring":
            for rank, result in enumerate(per_rank):
                got = result["cases"][i]
                assert got["skipped"] == got["expected_skipped"], (rank, case)
                assert got["skipped"] + got["computed"] == len(per_rank), (rank, case)


# Skipped blocks per rank, by hand (the soft ring with the LAYOUTS documents in both samples).
# The 32 tokens are 2 CP chunks; rank r holds chunks c_r and c_{2CP-1-r}. Soft mode allows
# every causal same-document pair, so rank r skips the block of rank r' iff none of its queries
# has an earlier key of its own document there.
# CP=4, chunks of 4 (c0 = 0-3, ..., c7 = 28-31): r0 {c0, c7}, r1 {c1, c6}, r2 {c2, c5},
# r3 {c3, c4}.
# * none: c_{7-r} (positions >= 16) follows every rank's first chunk: nothing skipped.
# * long, documents 0-5 | 6-17 | 18-31: r0's c7 sees 18-31 in c6, c5, c4 (r1, r2, r3); r1's
#   4-5 see c0 (r0) and its c6 sees c5, c4 (r2, r3); r2 sees r1 (c2 in 6-17, keys 6-7 of c1) and
#   r3 (c5 in 18-31, keys 18-19 of c4) but not r0 (c0 is in 0-5, c7 after c5); r3 sees r1
#   (c3 ~ 6-7), r2 (c3 ~ c2) but not r0 (c4's 16-17 and 18-19 lie in documents that r0's 0-3
#   do not reach and 28-31 are later): [0, 0, 1, 1].
# * pairs, documents c0-c1 | c2-c3 | c4-c5 | c6-c7: each rank has one causal partner
#   (r0's c7 -> r1's c6, r1's c1 -> r0's c0, r2's c5 -> r3's c4, r3's c3 -> r2's c2):
#   2 of the 3 other blocks skipped per rank.
# * chunks, one document per chunk: only the own block: 3 skipped per rank.
# CP=2, chunks of 8: r0 {0-7, 24-31}, r1 {8-15, 16-23}. none: 0. long: r0's 24-31 see r1's
# 18-23 and r1's 8-15 see r0's 6-7: 0. pairs and chunks (documents of 8 and 4 tokens) never
# cross a chunk: 1 per rank. test_ring_skips_exactly_... checks the same by brute force.
HAND_SKIPS = {
    2: {"none": [0, 0], "long": [0, 0], "pairs": [1, 1], "chunks": [1, 1]},
    4: {
        "none": [0, 0, 0, 0],
        "long": [0, 0, 1, 1],
        "pairs": [2, 2, 2, 2],
        "chunks": [3, 3, 3, 3],
    },
}


def test_ring_skips_more_blocks_with_shorter_documents(cp_results):
    """With documents, the soft ring skips the blocks with no same-document causal pair: more
    of them the shorter the documents (exact counts, derived by hand above)."""
    size, per_rank = cp_results
    for i, case in enumerate(cases()):
        if "layout" in case:
            got = [result["cases"][i]["skipped"] for result in per_rank]
            assert got == HAND_SKIPS[size][case["layout"]], case["layout"]


SKIP_CASES = {  # (window, same_group, sinks): skipped blocks per rank
    (0, False, 0): [1, 1],
    (0, True, 0): [0, 0],
    (1, False, 0): [0, 0],
    (0, False, 1): [1, 0],
}


@pytest.fixture(scope="module")
def skip_runs() -> dict:
    """Every :data:`SKIP_CASES` in one set of two processes: ``{case: [rank0, rank1]}``."""
    per_rank = run_workers(f"{WORKERS}:ring_skips", 2, list(SKIP_CASES))
    return {case: [r[i] for r in per_rank] for i, case in enumerate(SKIP_CASES)}


@pytest.mark.parametrize("case", list(SKIP_CASES), ids=lambda c: "w{}-same{}-sinks{}".format(*c))
def test_hard_ring_skips_exactly_the_blocks_without_pairs(skip_runs, case):
    """CP=2, 16 tokens: rank 0 holds 0-3 and 12-15, rank 1 holds 4-11. Disjoint groups and no
    window: the other rank's block has no allowed pair (skipped on each rank); one shared group,
    or a window of 1 (3-4 and 11-12 are neighbours), gives it pairs; one sink (token 0) gives
    rank 1's queries pairs in rank 0's block, not the other way round."""
    for r, want in zip(skip_runs[case], SKIP_CASES[case], strict=True):
        assert r == dict(skipped=want, computed=2 - want, error=r["error"])
        assert r["error"] < 1e-12


GPT2 = dict(LLAMA, family="gpt2", num_query_groups=None)
GEMMA3 = dict(  # local layers with their own RoPE (each CP rank slices it), scaled global RoPE
    LLAMA,
    family="gemma3",
    num_layers=3,
    sliding_window=6,
    sliding_window_pattern=3,
    local_rotary_base=10000.0,
    rotary_base=1e6,
    rope_scaling=dict(type="linear", factor=4.0),
)
FOCUS = dict(window=5, num_groups=4)


MODEL_CASES = {  # id: (model, focus, cp_mode, CP size)
    "llama-a2a": (LLAMA, FOCUS, "a2a", 2),
    "llama-ring": (LLAMA, FOCUS, "ring", 2),
    "gpt2-ring-top2": (GPT2, dict(FOCUS, top_k=2), "ring", 2),  # learned absolute positions
    "llama-sinkhorn-a2a": (LLAMA, dict(FOCUS, balance="sinkhorn"), "a2a", 2),  # column sums
    "llama-ring-cp4": (LLAMA, FOCUS, "ring", 4),
    "gemma3-a2a": (GEMMA3, FOCUS, "a2a", 2),
    "gemma3-ring-sinks": (GEMMA3, dict(FOCUS, sinks=3), "ring", 2),  # sinks > 0 changes logits
    # focus.backend triton: every ring step (and CP = 1) on the fused kernels (interpreter)
    "llama-ring-triton": (LLAMA, dict(FOCUS, backend="triton"), "ring", 2),
    # the dot gate form: its channels appended on each rank's tokens (soft: plain causal
    # attention over the whole sequence; sparse training: the hard pattern)
    "llama-a2a-dot": (LLAMA, dict(FOCUS, gate_form="dot"), "a2a", 2),
    "llama-ring-dot-sparse": (LLAMA, dict(FOCUS, gate_form="dot", training_mode="hard"), "ring", 2),
}


@pytest.fixture(scope="module")
def model_runs():
    """Every case at CP = 1, then each CP size once (one set of processes per size)."""
    worker = f"{WORKERS}:models_loss_and_grads"
    cases = {name: case[:3] for name, case in MODEL_CASES.items()}
    want = dict(zip(cases, run_workers(worker, 1, list(cases.values()))[0], strict=True))
    got = {}
    for size in sorted({case[3] for case in MODEL_CASES.values()}):
        names = [name for name, case in MODEL_CASES.items() if case[3] == size]
        results = run_workers(worker, size, [cases[name] for name in names])[0]
        got.update(zip(names, results, strict=True))
    return want, got


@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_whole_model_with_context_parallel_equals_cp1(model_runs, name):
    """Loss, every gradient (router included) and the hard-mode eval logits equal CP = 1."""
    want, got = model_runs[0][name], model_runs[1][name]
    if name.endswith("-sinks"):  # the sinks are on in the model: its CP=1 logits differ
        plain = model_runs[0][name.removesuffix("-sinks").replace("ring", "a2a")]
        assert (plain["logits"] - want["logits"]).abs().max() > 1e-3
    assert abs(float(got["loss"]) - float(want["loss"])) < 1e-5
    torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    assert any(".router." in name for name in want["grads"])
    for key, grad in want["grads"].items():
        assert grad.abs().sum() > 0 or "router" in key, key  # real gradients
        torch.testing.assert_close(got["grads"][key], grad, rtol=1e-4, atol=1e-5, msg=key)


KERNEL_CASES = [  # the ring with the fused per-block kernel: hard top-2 with documents and
    # sinks, soft-gated GQA with documents, sinks and soft-capping, local-only with sinks
    dict(BASE, mode="hard", top_k=2, sinks=3, softcap=2.0, docs=DOCS, seed=80),
    dict(BASE, mode="soft", hkv=1, sinks=2, softcap=2.0, docs=DOCS, seed=81),
    dict(BASE, mode="soft", local_only=True, sinks=2, seed=82),
]


def test_ring_with_the_fused_block_kernel_equals_blockwise():
    """``block_kernel="flex"`` (CPU: eager FlexAttention forward, blockwise backward) gives the
    blockwise ring's output, gradients and skipped steps (CP = 2, float64)."""
    per_rank = run_workers(f"{WORKERS}:ring_kernels_agree", 2, KERNEL_CASES)
    for rank, results in enumerate(per_rank):
        for case, result in zip(KERNEL_CASES, results, strict=True):
            assert result["scale"] > 0.1, case  # a real output, not zeros
            assert result["output"] < 1e-12, (rank, case)
            assert max(result["grads"]) < 1e-12, (rank, case)
            assert len(result["grads"]) == (4 if case["mode"] == "soft" and not case.get(
                "local_only") else 3)  # fmt: skip
            assert result["skipped"][0] == result["skipped"][1], (rank, case)
