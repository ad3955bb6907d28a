"""The ``triton`` backend (fused soft-gate kernels) against the reference: forward, log-sum-exp
and every gradient (``q``, ``k``, ``v``, the soft assignments, and through the log-sum-exp) on
random shapes, with GQA, sinks, soft-capping, packed documents and several tile sizes.

Without CUDA the kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``): the same kernel code, on CPU tensors, in fp32 and fp16. The GPU tests
at the end run the compiled kernels in bf16 at longer lengths."""

from __future__ import annotations

import random

import pytest
import torch

from focus_pretrain.focus import FocusConfig, Routing, focus_attention
from focus_pretrain.focus.attention import AttentionRequest, select_backend
from focus_pretrain.focus.soft_triton import runs_on, soft_gated_attention
from focus_pretrain.focus.soft_triton_launch import _document_ends, _strided
from tests.helpers import (
    ON_GPU,
    assert_close,
    needs_triton,
    random_documents,
    random_probs,
    random_qkv,
)

pytestmark = needs_triton


def run_both(p: dict, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Outputs and gradients of the triton kernels and of the reference on the same inputs:
    ``(got, want)``, each ``[out, lse, dq, dk, dv, dprobs]`` in fp32 on the CPU."""
    b, n, h, hkv, d = p["b"], p["n"], p["h"], p["hkv"], p["d"]
    q, k, v = random_qkv(b, n, h, hkv, d, seed=p["seed"], dtype=torch.float32)
    probs = random_probs(b, n, p["groups"], seed=p["seed"] + 1, sharpness=3.0).float()
    documents = random_documents(b, n, p["seed"] + 2) if p.get("documents") else None
    gen = torch.Generator().manual_seed(p["seed"] + 3)
    d_out = torch.randn(b, n, h, d, generator=gen)  # [b, n, H, D]
    d_lse = torch.randn(b, n, h, generator=gen)  # [b, n, H]
    kwargs = dict(
        window=p["window"],
        gate_lambda=p.get("gate_lambda", 10.0),
        scale=d**-0.5,
        softcap=p.get("softcap"),
        sinks=p.get("sinks", 0),
    )
    local = p.get("local", False)  # a sliding-window layer: no routing, no gate
    results = []
    for name in ("triton", "reference"):
        low = dtype if name == "triton" else torch.float32
        leaves = [t.to(device, low).requires_grad_(True) for t in (q, k, v)]
        if not local:
            leaves.append(probs.to(device).requires_grad_(True))
        docs = None if documents is None else documents.to(device)
        if name == "triton":
            routing = None if local else leaves[3]
            out, lse = soft_gated_attention(*leaves[:3], routing, documents=docs, **kwargs)
        else:
            ref_in = [t.to(dtype).float() for t in leaves[:3]]  # the same rounded inputs
            api_kwargs = {key: value for key, value in kwargs.items() if key != "scale"}
            out, lse = focus_attention(
                *ref_in, None if local else Routing(leaves[3]), mode="soft",
                backend="reference", return_lse=True, documents=docs, local_only=local,
                **api_kwargs,
            )  # fmt: skip
        loss = (out.float() * d_out.to(device)).sum() + (lse * d_lse.to(device)).sum()
        grads = torch.autograd.grad(loss, leaves)
        results.append([t.detach().float().cpu() for t in (out, lse, *grads)])
    return results


CASES = [
    dict(b=2, n=45, h=4, hkv=2, d=16, groups=8, window=5),  # GQA, several blocks
    dict(b=1, n=70, h=2, hkv=2, d=32, groups=3, window=0, sinks=3, softcap=4.0),
    dict(b=2, n=61, h=4, hkv=1, d=16, groups=5, window=7, sinks=2, documents=True),
    dict(b=1, n=33, h=2, hkv=1, d=16, groups=16, window=40),  # window past the sequence
    dict(b=1, n=1, h=2, hkv=2, d=16, groups=4, window=3),  # one token
    dict(b=2, n=77, h=4, hkv=2, d=16, groups=4, window=20, local=True),  # sliding window
    dict(b=1, n=66, h=2, hkv=1, d=16, groups=4, window=9, local=True, sinks=3, documents=True),
    dict(b=1, n=40, h=2, hkv=2, d=16, groups=4, window=2**62, local=True, softcap=2.0),  # dense
]


def _case_id(p: dict) -> str:
    return ("local-" if p.get("local") else "") + f"n{p['n']}-K{p['groups']}-w{p['window']}"


@pytest.mark.parametrize("p", CASES, ids=_case_id)
def test_triton_soft_equals_reference_fp32(p):
    got, want = run_both({**p, "seed": 11})
    assert_close(got, want, 2e-5)


def test_triton_soft_random_shapes_and_tiles(monkeypatch):
    """Random shapes, windows, sinks, documents and soft-caps at two tile sizes."""
    rng = random.Random(5)
    for tile in ("16", "32"):
        monkeypatch.setenv("FOCUS_TRITON_TEST_BLOCK", tile)
        for case in range(3):
            hkv = rng.choice([1, 2])
            p = dict(
                b=rng.randint(1, 2),
                n=rng.randint(2, 90),
                hkv=hkv,
                h=hkv * rng.choice([1, 2]),
                d=rng.choice([16, 32]),
                groups=rng.randint(1, 9),
                window=rng.choice([0, 1, 9, 30]),
                sinks=rng.choice([0, 0, 4]),
                softcap=rng.choice([None, 3.0]),
                documents=rng.random() < 0.5,
                gate_lambda=rng.choice([4.0, 10.0]),
                local=rng.random() < 0.25,
                seed=100 + case,
            )
            got, want = run_both(p)
            assert_close(got, want, 2e-5)


@pytest.mark.skipif(ON_GPU, reason="the interpreter's fp16; the GPU tests cover bf16")
def test_triton_soft_fp16_inputs():
    """fp16 operands (fp32 accumulation, fp16 probabilities in the tile products): the reference
    runs in fp32 on the same rounded inputs."""
    got, want = run_both({**CASES[2], "seed": 3}, dtype=torch.float16)
    assert_close(got, want, 2e-2)


def test_document_ends_match_a_loop():
    starts = random_documents(3, 50, seed=1, rate=0.15)
    ends = _document_ends(starts)
    for bi in range(3):
        s = starts[bi].tolist()
        for i in range(50):
            j = i + 1
            while j < 50 and s[j] == s[i]:
                j += 1
            assert ends[bi, i] == j


def _request(**overrides) -> AttentionRequest:
    base = dict(device="cuda" if ON_GPU else "cpu", dtype=torch.float32, batch=1, seq=64,
                heads=4, heads_kv=4, head_dim=32, mode="soft", top_k=1, local_only=False,
                window=8, softcap=False, needs_grad=True)  # fmt: skip
    return AttentionRequest(**{**base, **overrides})


def test_triton_backend_selection_and_refusals():
    assert runs_on(_request().device, torch.float32)
    assert select_backend("triton", _request()).name == "triton"
    assert select_backend("auto", _request()).name != "triton"  # CPU: by name only
    for mode in ("hard", "hard_gated"):  # top-1 on the group-sorted layout (sorted_triton)
        assert select_backend("triton", _request(mode=mode)).name == "triton"
        assert select_backend("auto", _request(mode=mode)).name != "triton"
    with pytest.raises(ValueError, match=r"'triton' cannot run .*top_k=2 \(at most 1\)"):
        select_backend("triton", _request(mode="hard_gated", top_k=2))
    with pytest.raises(ValueError, match=r"'triton' cannot run .*head_dim=24"):
        select_backend("triton", _request(head_dim=24))
    assert select_backend("triton", _request(local_only=True, mode="hard")).name == "triton"
    assert FocusConfig(backend="triton").backend == "triton"
    assert FocusConfig(inference_backend="triton").inference_backend == "triton"  # hard top-1
    with pytest.raises(ValueError, match=r"'triton' computes the soft pattern, hard top-1 .* only"):
        FocusConfig(inference_backend="triton", top_k=2, num_groups=4)
    assert FocusConfig(inference_backend="triton", inference_mode="soft").inference_mode == "soft"


def test_triton_through_the_api_equals_reference():
    """``focus_attention(..., backend="triton")`` (the public API, with a Routing)."""
    q, k, v = random_qkv(2, 40, 4, 2, 16, seed=2, dtype=torch.float32)
    routing = Routing(random_probs(2, 40, 4, seed=3).float())
    kwargs = dict(window=6, mode="soft", sinks=1)
    want = focus_attention(q, k, v, routing, backend="reference", **kwargs)
    got = focus_attention(q, k, v, routing, backend="triton", **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "p",
    [
        dict(b=2, n=700, h=8, hkv=2, d=64, groups=8, window=64, sinks=4),
        dict(b=1, n=1500, h=4, hkv=4, d=128, groups=8, window=128, documents=True),
        dict(b=1, n=513, h=4, hkv=1, d=128, groups=4, window=32, softcap=30.0),
    ],
    ids=["gqa-sinks", "d128-documents", "softcap"],
)
def test_triton_soft_on_gpu(dtype, p):
    """Compiled kernels: bf16 (tensor-core products, bf16-rounded reference inputs) and fp32."""
    got, want = run_both({**p, "seed": 21}, device="cuda", dtype=dtype)
    assert_close(got, want, 2e-2 if dtype == torch.bfloat16 else 1e-4)
    got, want = run_both({**p, "seed": 22, "local": True}, device="cuda", dtype=dtype)
    assert_close(got, want, 2e-2 if dtype == torch.bfloat16 else 1e-4)


def test_too_large_for_32_bit_offsets_is_refused_before_any_work():
    q = torch.zeros(()).expand(1, 2**20, 16, 128)  # 2^31 elements as a stride-0 view
    probs = torch.full((), 0.25).expand(1, 2**20, 4)
    with pytest.raises(ValueError, match=r"32-bit offsets.*context parallelism"):
        soft_gated_attention(q, q, q, probs, window=8, gate_lambda=10.0, scale=0.1)


# ----------------------------------------------------------------------------- ring steps

RING_CASES = {
    "soft-diagonal": dict(mode="soft", ranks=(0, 0)),
    "soft-docs-sinks-softcap-gqa": dict(mode="soft", hkv=1, docs=0.08, sinks=4, softcap=3.0),
    "soft-far": dict(mode="soft", ranks=(1, 0), window=40),
    "soft-before": dict(mode="soft", ranks=(0, 1)),  # rows with no allowed key
    "local-sinks-docs": dict(mode="hard", local_only=True, sinks=2, docs=0.05, ranks=(0, 0)),
    "local-offdiagonal": dict(mode="soft", local_only=True, window=20, cp=3, ranks=(1, 2)),
}


@pytest.mark.parametrize("name", list(RING_CASES))
def test_triton_ring_step_equals_blockwise(name):
    """One ring step on zigzag positions (``triton_attend_block``): ``(out, lse)`` equal
    ``attend_block``'s, queries with no allowed key included (``out = 0``, ``lse = -inf``)."""
    from focus_pretrain.focus.reference import attend_block
    from focus_pretrain.parallel.ring_kernels import triton_attend_block
    from tests.unit.test_ring_fused import block_call, ring_step

    step = block_call(*ring_step(**RING_CASES[name], d=16, seed=len(name)))
    want, want_lse = attend_block(*step)
    got, lse = triton_attend_block(*step)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], want_lse[finite], rtol=1e-5, atol=1e-5)
    if name == "soft-before":
        assert not finite.all() and finite.any()


@pytest.mark.parametrize("name", ["soft-docs-sinks-softcap-gqa", "soft-before", "local-sinks-docs"])
def test_triton_ring_step_gradients_equal_blockwise(name):
    """The ring's forward and backward step (gradients through the block's ``out`` and ``lse``
    against a merged output, and both sides' assignments) with ``block_kernel="triton"``."""
    from tests.unit.test_ring_fused import assert_step_gradients_agree

    case = RING_CASES[name]
    assert_step_gradients_agree(case, "cpu", torch.float32, seq=96, d=16, fused="triton")


def test_triton_block_kernel_selection():
    from focus_pretrain.parallel import ring
    from focus_pretrain.parallel.ring_kernels import backward_block_kernel, resolve_block_kernel

    q = torch.zeros(1, 4, 2, 16)
    assert resolve_block_kernel("triton", q) == "triton"
    assert backward_block_kernel("triton", q) == "triton"
    with pytest.raises(ValueError, match=r"block_kernel 'triton' cannot run .*head dim 8"):
        resolve_block_kernel("triton", torch.zeros(1, 4, 2, 8))
    with pytest.raises(ValueError, match="soft and sliding-window steps, not 'hard'"):
        ring.ring_focus_attention(q, q, q, None, group=None, mode="hard", block_kernel="triton")


def test_ring_step_benchmark_times_the_triton_kernel(tmp_path):
    """``tools/bench_ring_step.py --kernels blockwise triton`` (CPU smoke): the triton step is
    checked against blockwise (output and gradients) and timed; hard steps leave it out."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "tools" / "bench_ring_step.py"
    spec = importlib.util.spec_from_file_location("bench_ring_step", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    rows = tool.main(
        ["--device", "cpu", "--seq", "64", "--cp", "2", "--groups", "4", "--heads", "2",
         "--head-dim", "16", "--window", "4", "--dtype", "fp32", "--warmup", "0", "--repeats",
         "1", "--kernels", "blockwise", "triton", "--json", str(tmp_path / "ring.json")]
    )  # fmt: skip
    soft = [row for row in rows if row["mode"] == "soft"]
    assert soft and all("triton" not in row["kernels"] for row in rows if row["mode"] == "hard")
    for row in soft:
        entry = row["kernels"]["triton"]
        assert entry["status"] == "ok" and entry["fwd_bwd_ms"] > 0
        assert entry["check"]["out_rel_err"] < 1e-5 and entry["check"]["lse_inf_agree"]
        assert max(v for k, v in entry["check"].items() if k.startswith("d")) < 1e-4


def test_tile_override_for_tuning(monkeypatch):
    from focus_pretrain.focus.triton_tiles import Tile, default_tiles, launch_tiles

    monkeypatch.setenv("FOCUS_TRITON_BLOCKS", "fwd=128x64, warps=4, q=64x32x8x5")
    tiles = launch_tiles("half", 128)
    default = default_tiles("half", 128)
    assert tiles["fwd"] == Tile(128, 64, 4, default["fwd"].stages)
    assert tiles["q"] == Tile(64, 32, 8, 5)
    assert tiles["kv"] == Tile(default["kv"].bm, default["kv"].bn, 4, default["kv"].stages)
    for bad in ("fwd=64", "fwd=48x64", "kv=64x64x0", "tile=64x64"):
        monkeypatch.setenv("FOCUS_TRITON_BLOCKS", bad)
        with pytest.raises(ValueError, match=f"FOCUS_TRITON_BLOCKS: bad item '{bad}'"):
            launch_tiles("half", 128)


def test_measured_tiles_are_read_per_gpu_and_an_unknown_gpu_gets_the_defaults(caplog):
    """The table's entry for the GPU by name, precision, head dim and layout; another GPU: the
    defaults, reported once."""
    from focus_pretrain.focus import triton_tiles
    from focus_pretrain.focus.triton_tiles import Tile, default_tiles, launch_tiles

    table = triton_tiles.measured_table()
    for gpu, entry in table.items():  # every entry parses and names its date
        assert entry["date"] and all(Tile.parse(text) for text in entry["tiles"].values()), gpu
        for key, text in entry["tiles"].items():
            precision, size, *rest = key.split("/")
            tiles = launch_tiles(precision, int(size), rest[0] == "packed", gpu)
            assert tiles[rest[-1]] == Tile.parse(text)
    with caplog.at_level("WARNING"):
        assert launch_tiles("half", 128, False, "No Such GPU") == default_tiles("half", 128, False)
        launch_tiles("half", 64, False, "No Such GPU")
    assert sum("No Such GPU" in r.getMessage() for r in caplog.records) == 1


@pytest.fixture
def fp32_precision():
    """Restores PyTorch's fp32 matmul precision after a test that sets it."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    yield matmul
    matmul.fp32_precision = before


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp32_tiles_and_products_follow_the_fp32_matmul_precision(fp32_precision, head_dim):
    """fp32 inputs: 3xTF32 products by default, launched only at head dim 64 (above, the
    backward spills: refused with the fixes); with TF32 allowed, TF32 products and their own
    spill-free tiles at every head dim."""
    from focus_pretrain.focus.soft_triton import cuda_refusal
    from focus_pretrain.focus.soft_triton_launch import _blocks, fp32_products
    from focus_pretrain.focus.triton_tiles import DEFAULTS

    fp32_precision.fp32_precision = "ieee"
    assert fp32_products() == "tf32x3"
    refusal = cuda_refusal(torch.float32, head_dim)
    if head_dim == 64:
        assert refusal is None and _blocks("cuda", 64, torch.float32) == DEFAULTS[("fp32", 64)]
    else:
        assert "spill" in refusal and "fp32_precision = 'tf32'" in refusal and "flex" in refusal
    assert cuda_refusal(torch.bfloat16, head_dim) is None
    fp32_precision.fp32_precision = "tf32"
    assert fp32_products() == "tf32" and cuda_refusal(torch.float32, head_dim) is None
    blocks = _blocks("cuda", head_dim, torch.float32)
    assert blocks == DEFAULTS[("tf32", head_dim)]
    assert all(tile.stages == 1 for tile in blocks.values())


def test_the_backend_names_the_fp32_refusal(fp32_precision):
    """A request the kernels would spill on is refused with that reason, not "unavailable"."""
    import focus_pretrain.focus.attention  # noqa: F401  (registers the backends)
    from focus_pretrain.focus.backends import AttentionRequest, get_backend

    fp32_precision.fp32_precision = "ieee"
    request = AttentionRequest("cuda", torch.float32, 1, 64, 2, 2, 128, "soft", 1, False, 8,
                               False, True)  # fmt: skip
    assert "spill" in get_backend("triton").refusal(request)
    fp32_precision.fp32_precision = "tf32"
    assert "spill" not in (get_backend("triton").refusal(request) or "")


def test_strided_views_are_read_in_place_and_give_the_same_gradients():
    """Megatron's ``[s, b, h, d]`` tensors viewed as ``[b, s, h, d]`` (read in place) and a
    non-dense slice (copied) give the output and gradients of contiguous inputs."""
    b, n, h, d = 2, 40, 4, 16
    base = [torch.randn(n, b, h, d * (1 + (i == 2))).requires_grad_(True) for i in range(3)]
    probs = random_probs(b, n, 4, seed=1).float().requires_grad_(True)
    kwargs = dict(window=5, gate_lambda=6.0, scale=0.25)
    views = [t.transpose(0, 1)[..., :d] for t in base]  # [b, s, h, d]; v: half of each row
    assert _strided(views[0]) is views[0] and _strided(views[2]) is not views[2]
    out, _ = soft_gated_attention(*views, probs, **kwargs)
    d_out = torch.randn(out.shape)
    got = torch.autograd.grad((out * d_out).sum(), [*base, probs])  # dO dense, q strided
    dense = [t.detach().contiguous().requires_grad_(True) for t in views]
    out2, _ = soft_gated_attention(*dense, probs, **kwargs)
    want = torch.autograd.grad((out2 * d_out).sum(), [*dense, probs])
    torch.testing.assert_close(out, out2)
    for g, w in zip(got[:3], want[:3], strict=True):
        torch.testing.assert_close(g.transpose(0, 1)[..., :d], w, rtol=1e-6, atol=1e-6)
    assert got[2][..., d:].abs().max() == 0
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=1e-6)


def _measured_tile_runs() -> list[tuple[list[str], str]]:
    """``(compile tool arguments, FOCUS_TRITON_BLOCKS)`` for each entry of the measured tile
    table that differs from the defaults (those are compiled anyway): its plain variant."""
    from focus_pretrain.focus.triton_tiles import KERNELS, default_tiles, measured_table

    runs = []
    for entry in measured_table().values():
        groups: dict[tuple, dict] = {}
        for key, text in entry["tiles"].items():
            precision, size, *rest = key.split("/")
            groups.setdefault((precision, int(size), rest[0] == "packed"), {})[rest[-1]] = text
        for (precision, size, packed), tiles in groups.items():
            defaults = default_tiles(precision, size, packed)
            if all(tiles.get(k, defaults[k].text()) == defaults[k].text() for k in KERNELS):
                continue
            dtype = {"half": "bf16"}.get(precision, precision)
            blocks = ",".join(f"{k}={v}" for k, v in tiles.items() if k in KERNELS)
            runs.append((["--dtype", dtype, "--head-dim", str(size), "--variants", "plain"],
                         blocks))  # fmt: skip
    return runs


@pytest.mark.slow  # about 40 s: Triton's compiler and ptxas, 15 kernels (+3 per table entry)
def test_kernels_compile_for_hopper_within_its_shared_memory(tmp_path):
    """The interpreter runs the kernels as Python; Triton's real compiler (``tools/
    compile_triton_kernels.py``, no GPU needed) must also accept them for sm_90, for the
    compile-time variants and dtypes the backend launches, with the tiles it launches them
    with (the defaults, and every entry of the measured tile table) fitting the H100's shared
    memory."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    tool = pathlib.Path(__file__).parents[2] / "tools" / "compile_triton_kernels.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    report = tmp_path / "compile.json"
    runs = [(["--dtype", "bf16", "--head-dim", "128"], ""), (["--dtype", "fp32", "--head-dim",
            "64", "--variants", "plain"], "")]  # fmt: skip
    runs += _measured_tile_runs()
    rows = []
    for args, blocks in runs:
        done = subprocess.run(
            [sys.executable, str(tool), *args, "--json", str(report)],
            env={**env, "FOCUS_TRITON_BLOCKS": blocks}, capture_output=True, text=True,
            timeout=900,
        )  # fmt: skip
        assert report.exists(), done.stderr[-3000:]
        rows += json.loads(report.read_text())["rows"]
    assert len(rows) == 15 + 3 * (len(runs) - 2)  # bf16: 4 variants x 3 kernels; fp32 plain: 3
    failed = [(r["kernel"], r["dtype"], r["variant"], r["error"]) for r in rows if not r["ok"]]
    assert not failed, failed
    assert all(0 < r["shared_bytes"] <= r["shared_limit"] for r in rows)


@pytest.mark.parametrize("p", [CASES[0], CASES[2], CASES[6]], ids=_case_id)
def test_one_pass_backward_with_atomic_dq_equals_reference(monkeypatch, p):
    """The backward as one dK/dV pass adding dQ and the query-side assignment gradient
    atomically (``kva`` in the tile table), GQA, sinks, documents and a sliding-window layer."""
    from focus_pretrain.focus.soft_triton_launch import _blocks

    monkeypatch.setenv("FOCUS_TRITON_BLOCKS", "kva=16x16")
    assert "kva" in _blocks("cpu", p["d"])  # the one-pass form is launched
    got, want = run_both({**p, "seed": 31})
    assert_close(got, want, 2e-5)
