"""Registers and spills of the ``triton`` backend's kernels for sm_90, without a GPU.

``tools/compile_triton_kernels.py`` compiles each kernel with Triton's real compiler at the tiles
the backend launches on CUDA and reads the registers per thread and the spilled bytes from the
``ptxas`` Triton's wheel ships (``ptxas -v`` on the kernel's PTX, with Triton's flags). Here:
bf16 (fp16's tiles are the same), fp32 inputs with TF32 products allowed (``tf32``) and fp32 at
PyTorch's default precision (3xTF32: launched at head dim 64 only, refused above) at head dims 64,
128 (production) and 256, the forward, dK/dV and dQ kernels in every compile-time variant the
backend launches (81 compiles; 108 rows with the refused ones). Spills are reported, not
refused: the tiles are chosen by their speed on the GPU (tools/tune_triton.py), and a tile that
spills a little may be the fastest.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

TOOL = pathlib.Path(__file__).parents[2] / "tools" / "compile_triton_kernels.py"
KERNELS = {"fwd": "soft_forward_kernel", "kv": "soft_backward_kv_kernel",
           "q": "soft_backward_q_kernel"}  # fmt: skip
VARIANTS = ("plain", "docs-pos-softcap", "local-docs", "packed-docs-pos")
HEAD_DIMS = (64, 128, 256)
DTYPES = ("bf16", "tf32", "fp32")
ALL = [(t, d, k, v) for t in DTYPES for d in HEAD_DIMS for k in KERNELS for v in VARIANTS]
REFUSED = [case for case in ALL if case[0] == "fp32" and case[1] > 64]  # 3xTF32 spills there
REFUSED += [(t, 256, k, "packed-docs-pos") for t in ("tf32",) for k in KERNELS]  # dQ spills
CASES = [case for case in ALL if case not in REFUSED]


def _missing_compiler() -> str | None:
    """Why the sm_90 compile cannot run here (``None`` when it can)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as error:
        return f"Triton or its NVIDIA backend is not installed ({error})"
    try:
        get_ptxas(90)
    except RuntimeError as error:
        return f"the ptxas Triton uses for sm_90 is missing ({error})"
    return None


pytestmark = pytest.mark.slow  # Triton's compiler, 81 kernels


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, dict]:
    """The tool's rows for :data:`DTYPES` at :data:`HEAD_DIMS`, sm_90, by ``(dtype, head dim,
    kernel key, variant)``."""
    reason = _missing_compiler()
    if reason is not None:  # Triton and its ptxas come with the locked install (make setup):
        if os.environ.get("CI"):  # in CI their absence is a broken install, not a skip
            pytest.fail(f"{reason}; CI installs Triton (requirements/lock.txt)")
        pytest.skip(f"{reason}: a development install without Triton (make setup adds it)")
    report = tmp_path_factory.mktemp("registers") / "compile.json"
    drop = ("TRITON_INTERPRET", "FOCUS_TRITON_BLOCKS")  # the compiler; the launched tiles
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton's default, without its warning
    done = subprocess.run(
        [sys.executable, str(TOOL), "--arch", "90", "--dtype", *DTYPES,
         "--head-dim", *map(str, HEAD_DIMS), "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert report.exists(), done.stdout[-2000:] + done.stderr[-3000:]
    by_name = {name: key for key, name in KERNELS.items()}
    rows = json.loads(report.read_text())["rows"]
    return {(r["dtype"], r["head_dim"], by_name[r["kernel"]], r["variant"]): r for r in rows}


def test_every_kernel_compiles_within_the_register_file(rows: dict) -> None:
    """Each kernel compiles for sm_90 at its launched tiles and warps, its shared memory within
    the H100's, at most 255 registers per thread, the count ptxas reports matching the cubin's."""
    assert sorted(rows) == sorted(ALL)
    assert all(rows[case].get("refused") for case in REFUSED)
    for case in CASES:
        row = rows[case]
        assert row["ok"], (case, row.get("error"))
        assert row["num_warps"] == row["options"]["num_warps"], case
        assert row["num_stages"] == row["options"].get("num_stages", row["num_stages"]), case
        assert 0 < row["registers"] <= 255, (case, row["registers"])
        assert row["cubin_registers"] in (None, row["registers"]), case
        assert row["spill_stores"] >= 0 and row["spill_loads"] >= 0, case  # reported, allowed
