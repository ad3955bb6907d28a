"""Compile the ``triton`` backend's kernels for a CUDA architecture without a GPU.

Triton's interpreter (how the CPU tests run the kernels) executes them as Python and checks their
arithmetic, not whether Triton can compile them: this tool runs Triton's real compiler (down to
PTX and the cubin, with the ``ptxas`` its wheel ships) for each kernel, dtype, head dim and
compile-time variant, with the tile sizes the backend launches on CUDA, and reports the shared
memory each needs against the architecture's limit, and the registers per thread and the bytes
spilled to local memory (normally known only once a driver loads the cubin: read here from
``ptxas -v``, run on the kernel's PTX with the flags Triton's compile used, and checked against
the register count in Triton's cubin). A table on stdout, optionally JSON.

    python tools/compile_triton_kernels.py                       # the default set, sm_90
    python tools/compile_triton_kernels.py --dtype bf16 fp32 --head-dim 64 128 256 --json c.json
    FOCUS_TRITON_BLOCKS=fwd=64x64 python tools/compile_triton_kernels.py --kernels fwd  # try tiles

Must run without ``TRITON_INTERPRET`` (the interpreter replaces the compiler). Exits 1 when a
kernel fails to compile or exceeds the shared memory (and, with ``--fail-on-spills``, when one
spills).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from focus_pretrain.cli import tool_parser

SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes per block (opt-in max)
MAX_REGISTERS = 255  # per thread, every architecture since sm_35
VARIANTS = {  # name: compile-time switches
    "plain": dict(),
    "docs-pos-softcap": dict(HAS_DOCS=True, HAS_POS=True, SOFTCAP=True),
    "local-docs": dict(LOCAL=True, HAS_DOCS=True),
    "packed-docs-pos": dict(HAS_DOCS=True, HAS_POS=True, PACKED=True),  # sorted top-1
}
KERNELS = {"fwd": "soft_forward_kernel", "kv": "soft_backward_kv_kernel",
           "q": "soft_backward_q_kernel"}  # fmt: skip
POINTERS = {"A_Q": "fp16", "A_K": "fp16", "DQ_ACC": "fp32", "DG_Q_ACC": "fp32",
            "LSE": "fp32", "DELTA": "fp32", "DG_Q": "fp32",
            "DG_K": "fp32", "DOC_Q": "i64", "DOC_K": "i64", "DOC_END": "i64", "POS_Q": "i64",
            "POS_K": "i64"}  # fmt: skip
FLOAT_ARGS = ("scale", "lam", "cap")
USAGE = {  # ptxas -v line -> field
    "registers": r"Used (\d+) registers",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "stack_bytes": r"(\d+) bytes stack frame",
}


def ptxas_flags(metadata: Any, arch: int) -> list[str]:
    """The flags Triton's ``make_cubin`` passes ``ptxas`` (Triton 3.x), less input and output."""
    from triton import knobs
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    if knobs.compilation.disable_line_info:
        debug = ["-lineinfo", "-suppress-debug-info"]
    else:
        debug = ["-g"] if knobs.nvidia.disable_ptxas_opt else ["-lineinfo"]
    fmad = [] if metadata.enable_fp_fusion else ["--fmad=false"]
    no_opt = ["--opt-level", "0"] if knobs.nvidia.disable_ptxas_opt else []
    extra = metadata.ptx_options.split(" ") if metadata.ptx_options else []
    return [*debug, *fmad, "-v", *no_opt, "--regAllocOptLevel=2", *extra,
            f"--gpu-name={sm_arch_from_capability(arch)}"]  # fmt: skip


def ptxas_usage(ptx: str, metadata: Any, arch: int) -> dict[str, int]:
    """Registers, spill stores/loads and stack frame (bytes) of one kernel: ``ptxas -v`` on its
    PTX, with the ``ptxas`` and the flags Triton compiles it with for ``arch``."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory(prefix="focus-ptxas-") as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, *ptxas_flags(metadata, arch), src, "-o", os.path.join(tmp, "kernel.o")]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed ({done.returncode}): {log.strip()[-300:]}")
    usage = {}
    for field, pattern in USAGE.items():
        match = re.search(pattern, log)
        if match is None:
            raise RuntimeError(f"no {pattern!r} in the ptxas log: {log.strip()[-300:]}")
        usage[field] = int(match.group(1))
    return usage


def cubin_registers(cubin: bytes) -> int | None:
    """Registers per thread recorded in Triton's own cubin (``cuobjdump --dump-resource-usage``);
    ``None`` when the wheel's ``cuobjdump`` is missing or says nothing."""
    from triton import knobs

    try:
        tool = knobs.nvidia.cuobjdump.path
    except Exception:  # no cuobjdump shipped or found: the cross-check is skipped
        return None
    with tempfile.TemporaryDirectory(prefix="focus-cubin-") as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        done = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True,
                              text=True, check=False)  # fmt: skip
    match = re.search(r"REG:(\d+)", done.stdout)
    return int(match.group(1)) if match else None


def signature_of(kernel: Any, constants: dict, dtype: str) -> dict[str, str]:
    """Triton's signature of ``kernel``: constexprs, pointer and scalar types by argument name."""
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = f"*{POINTERS[name]}"
        elif name in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV", "G_Q", "G_K"):
            signature[name] = "*fp32" if dtype == "tf32" else f"*{dtype}"  # tf32: fp32 data
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return signature


def check(row: dict, compiled: Any, arch: int) -> None:
    """Fill ``row`` from a compile: shared memory against the limit, registers and spills."""
    shared = int(compiled.metadata.shared)
    limit = SHARED_LIMIT.get(arch, 101376)
    row.update(ok=shared <= limit, shared_bytes=shared, shared_limit=limit)
    if shared > limit:
        row["error"] = f"needs {shared} bytes of shared memory, the limit is {limit}"
    row.update(ptxas_usage(compiled.asm["ptx"], compiled.metadata, arch))
    in_cubin = cubin_registers(compiled.asm["cubin"])
    row["cubin_registers"] = in_cubin
    if in_cubin is not None and in_cubin != row["registers"]:
        row.update(ok=False, error=f"ptxas -v says {row['registers']} registers, the cubin "
                                   f"{in_cubin}: the flags differ from Triton's")  # fmt: skip
    row["spills"] = row["spill_stores"] + row["spill_loads"] > 0


@contextlib.contextmanager
def fp32_products(dtype: str) -> Iterator[None]:
    """Within: PyTorch's fp32 matmul precision as a ``dtype`` row launches on CUDA (``tf32``:
    TF32 allowed; ``fp32``: the default, 3xTF32)."""
    import torch

    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if dtype == "tf32" else "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = before


def compile_one(kernel, key: str, dtype: str, head_dim: int, variant: dict, arch: int) -> dict:
    """Compile one kernel (``key``: ``fwd``, ``kv`` or ``q``) and describe the result."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from focus_pretrain.focus import soft_triton, soft_triton_launch

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    with fp32_products(dtype):  # "tf32": fp32 inputs with TF32 products allowed
        packed = bool(variant.get("PACKED"))  # the sorted top-1 path: its own tiles, refusals
        refused = soft_triton.cuda_refusal(torch_dtype, head_dim, packed=packed)
        blocks = soft_triton_launch._blocks("cuda", head_dim, torch_dtype, packed=packed)
        qk_prec = soft_triton_launch.fp32_products() if torch_dtype == torch.float32 else "tf32"
    if refused:  # the backend does not launch these: nothing to report
        return dict(kernel=kernel.__name__, dtype=dtype, head_dim=head_dim, block=None,
                    options={}, variant=variant, ok=True, refused=refused, seconds=0.0)  # fmt: skip
    tile = blocks[key]
    options = dict(num_warps=tile.warps, num_stages=tile.stages)
    backward = dict(KP=16, GRAD_PREC="tf32x3") if key != "fwd" else {}  # as on CUDA, K = 8
    if key == "kv":
        backward["ATOMIC_DQ"] = False
    constants = {**dict(D=head_dim, KA=32, BM=tile.bm, BN=tile.bn, HAS_DOCS=False,
                        HAS_POS=False, SOFTCAP=False, LOCAL=False, QK_PREC=qk_prec,
                        FAST=torch_dtype != torch.float32, PACKED=False),
                 **backward, **variant}  # fmt: skip
    start = time.perf_counter()
    row = dict(kernel=kernel.__name__, dtype=dtype, head_dim=head_dim, block=[tile.bm, tile.bn],
               options=options, variant=variant)  # fmt: skip
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature_of(kernel, constants, dtype),
                      constexprs=constants),
            target=GPUTarget("cuda", arch, 32),
            options=options,
        )  # fmt: skip
        row.update(num_warps=compiled.metadata.num_warps,
                   num_stages=compiled.metadata.num_stages)  # fmt: skip
        check(row, compiled, arch)
    except Exception as error:  # a report: every failure is listed, the next one still runs
        lines = str(error).strip().splitlines() or [""]  # Triton quotes the source first
        row.update(ok=False, error=f"{type(error).__name__}: {' '.join(lines[-2:])[:300]}")
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


HEADER = (
    "| kernel | dtype | D | variant | tile | warps | stages | shared (KB) | registers "
    "| spill stores (B) | spill loads (B) | s | status |\n"
    "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|"
)


def table_line(row: dict) -> str:
    """One markdown table line of a row (``-`` where a failed compile left a field empty)."""

    def cell(field: str) -> str:
        return "-" if row.get(field) is None else str(row[field])

    shared = row.get("shared_bytes")
    tile = "x".join(map(str, row["block"] or ["-"]))
    if row.get("refused"):
        status = "not launched (the backend refuses it)"
    elif not row["ok"]:
        status = row["error"]
    elif row.get("spills"):
        status = "ok, spills"
    else:
        status = "ok"
    return (
        f"| {row['kernel']} | {row['dtype']} | {row['head_dim']} | {row['variant']} | "
        f"{tile} | {cell('num_warps')} | {cell('num_stages')} | "
        f"{'-' if shared is None else f'{shared / 1024:.0f}'} | {cell('registers')} | "
        f"{cell('spill_stores')} | {cell('spill_loads')} | {row['seconds']} | {status} |"
    )


DTYPES = ["bf16", "fp16", "fp32", "tf32"]


def main(argv: list[str] | None = None) -> int:
    """Compile the selected kernels, print the table, write the JSON; the exit status."""
    parser = tool_parser(__doc__)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=DTYPES,
                        help="fp32: fp32 inputs at PyTorch's default precision (3xTF32 "
                        "products); tf32: fp32 inputs with TF32 allowed")  # fmt: skip
    parser.add_argument("--head-dim", nargs="+", type=int, default=[128])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS),
                        help="fwd (forward), kv (dK/dV), q (dQ); all by default")  # fmt: skip
    parser.add_argument("--fail-on-spills", action="store_true",
                        help="exit 1 when a kernel spills registers to local memory")  # fmt: skip
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    from focus_pretrain.focus import soft_triton_kernels as kernels

    todo = [(key, getattr(kernels, KERNELS[key])) for key in args.kernels]
    rows = []
    print(HEADER)
    for dtype in args.dtype:
        for head_dim in args.head_dim:
            for name in args.variants:
                for key, kernel in todo:
                    row = compile_one(kernel, key, dtype, head_dim, VARIANTS[name], args.arch)
                    row["variant"] = name
                    rows.append(row)
                    print(table_line(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=args.arch, rows=rows), f, indent=1)
    failed = not all(row["ok"] for row in rows)
    return 1 if failed or (args.fail_on_spills and any(r.get("spills") for r in rows)) else 0


if __name__ == "__main__":
    sys.exit(main())
