"""Compile the ``triton`` backend's kernels for a CUDA architecture without a GPU.

Triton's interpreter (how the CPU tests run the kernels) executes them as Python and checks their
arithmetic, not whether Triton can compile them: this tool runs Triton's real compiler (down to
PTX and the cubin, with the ``ptxas`` its wheel ships) for each kernel, dtype, head dim and
compile-time variant, with the tile sizes the backend launches on CUDA, and reports the shared
memory each needs against the architecture's limit. A table on stdout, optionally JSON.

    python tools/compile_triton_kernels.py                       # the default set, sm_90
    python tools/compile_triton_kernels.py --dtype bf16 fp32 --head-dim 64 128 256 --json c.json

Must run without ``TRITON_INTERPRET`` (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}  # bytes per block (opt-in max)
VARIANTS = {  # name: compile-time switches
    "plain": dict(),
    "docs-pos-softcap": dict(HAS_DOCS=True, HAS_POS=True, SOFTCAP=True),
    "local-docs": dict(LOCAL=True, HAS_DOCS=True),
}
POINTERS = {"G_Q": "fp32", "G_K": "fp32", "LSE": "fp32", "DELTA": "fp32", "DG_Q": "fp32",
            "DG_K": "fp32", "DOC_Q": "i64", "DOC_K": "i64", "DOC_END": "i64", "POS_Q": "i64",
            "POS_K": "i64"}  # fmt: skip
FLOAT_ARGS = ("scale", "lam", "cap")


def compile_one(kernel, key: str, dtype: str, head_dim: int, variant: dict, arch: int) -> dict:
    """Compile one kernel (``key``: ``fwd``, ``kv`` or ``q``) and describe the result."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from focus_pretrain.focus import soft_triton

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    blocks = soft_triton._blocks("cuda", head_dim, torch_dtype)
    bm, bn = blocks[key]
    qk_prec, gate_prec = ("tf32x3" if dtype == "fp32" else "tf32"), "tf32x3"  # as on CUDA
    constants = {**dict(D=head_dim, KP=16, BM=bm, BN=bn, HAS_DOCS=False, HAS_POS=False,
                        SOFTCAP=False, LOCAL=False, QK_PREC=qk_prec, GATE_PREC=gate_prec),
                 **variant}  # fmt: skip
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = f"*{POINTERS[name]}"
        elif name in ("Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"):
            signature[name] = f"*{dtype}"
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    start = time.perf_counter()
    row = dict(kernel=kernel.__name__, dtype=dtype, head_dim=head_dim, block=[bm, bn],
               options=blocks["opts"], variant=variant)  # fmt: skip
    try:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constants),
            target=GPUTarget("cuda", arch, 32),
            options=blocks["opts"],
        )
    except Exception as error:  # a report: every failure is listed, the next one still runs
        lines = str(error).strip().splitlines() or [""]  # Triton quotes the source first
        row.update(ok=False, error=f"{type(error).__name__}: {' '.join(lines[-2:])[:300]}")
    else:
        shared = int(compiled.metadata.shared)
        limit = SHARED_LIMIT.get(arch, 101376)
        row.update(ok=shared <= limit, shared_bytes=shared, shared_limit=limit)
        if shared > limit:
            row["error"] = f"needs {shared} bytes of shared memory, the limit is {limit}"
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90")
    parser.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--head-dim", nargs="+", type=int, default=[128])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    from focus_pretrain.focus import soft_triton_kernels as kernels

    todo = [("fwd", kernels.soft_forward_kernel), ("kv", kernels.soft_backward_kv_kernel),
            ("q", kernels.soft_backward_q_kernel)]  # fmt: skip
    rows = []
    print("| kernel | dtype | D | variant | tile | shared (KB) | s | status |")
    print("|---|---|---:|---|---|---:|---:|---|")
    for dtype in args.dtype:
        for head_dim in args.head_dim:
            for name in args.variants:
                for key, kernel in todo:
                    row = compile_one(kernel, key, dtype, head_dim, VARIANTS[name], args.arch)
                    row["variant"] = name
                    rows.append(row)
                    shared = row.get("shared_bytes")
                    print(f"| {row['kernel']} | {dtype} | {head_dim} | {name} | "
                          f"{row['block'][0]}x{row['block'][1]} | "
                          f"{'-' if shared is None else f'{shared / 1024:.0f}'} | "
                          f"{row['seconds']} | {'ok' if row['ok'] else row['error']} |",
                          flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=args.arch, rows=rows), f, indent=1)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
