"""Profile and tune the ``triton`` backend's training kernels on this GPU; record the tiles.

Stages (``--stages``, in this order):

* ``tune``    every candidate tile of each kernel (forward, dK/dV, dQ, and the one-pass backward
              adding dQ atomically) timed alone and checked against the first; the fastest that
              agrees is written to the tile table (``--table``, default the package's
              ``triton_tiles.json``) for this GPU (the one-pass backward only if it wins);
* ``check``   the kernels with those tiles against the reference (fast and exact gate; soft, and
              ``hard_gated`` top-1 on the group-sorted layout; both backward forms) on a short
              sequence with documents, sinks and soft-capping: the largest error of the output,
              log-sum-exp and every gradient;
* ``profile`` where the time goes, with the tuned tiles: each kernel and the whole operator per
              variant (each ingredient on in turn; the control is the same kernels computing
              plain causal attention), dense SDPA's forward and backward beside them;
* ``lengths`` the training step against dense per ``--lengths``: soft and sparse top-1, and the
              same through ``--rivals`` (e.g. ``flex``); the speedups are written to the table
              per mode and length (``training``: what ``auto`` trains by on this GPU).

On CUDA the candidates are first compiled by ``--processes`` workers in parallel. On a CPU the
kernels run in Triton's interpreter (``TRITON_INTERPRET=1``): a smoke run on tiny shapes with
``--tiny`` candidates. Prints one JSON line per measurement, then markdown tables; ``--json``
writes everything.

    python tools/tune_triton.py --stages check tune profile lengths --json tune.json
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from focus_pretrain.cli import at_least, tool_parser

STAGES = ("tune", "check", "profile", "lengths")


def _parser():
    parser = tool_parser(__doc__)
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=STAGES)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--seq", type=at_least(16), default=8192, help="tune/profile length")
    parser.add_argument("--check-seq", type=at_least(16), default=2048)
    parser.add_argument("--lengths", nargs="+", type=at_least(16), default=[8192, 16384, 32768])
    parser.add_argument("--batch", type=at_least(1), default=1)
    parser.add_argument("--heads", type=at_least(1), default=16)
    parser.add_argument("--heads-kv", type=at_least(1), default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=at_least(16), default=128)
    parser.add_argument("--groups", type=at_least(1), default=8)
    parser.add_argument("--window", type=at_least(0), default=128)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--processes", type=at_least(1), default=12,
                        help="parallel compile workers on CUDA")  # fmt: skip
    parser.add_argument(
        "--tolerance",
        type=float,
        default=3e-2,
        help="largest error against the first candidate a tile may have",
    )
    parser.add_argument(
        "--table",
        type=Path,
        default=None,
        help="tile table to update (default: the package's tile table)",
    )
    parser.add_argument(
        "--rivals",
        nargs="*",
        default=[],
        help="backends whose training steps the lengths stage also times (e.g. flex): with "
        "triton, the ranking auto trains by, written to the table per mode and length",
    )
    parser.add_argument("--tiny", action="store_true",
                        help="16x16 and 32x16 candidates only (a CPU smoke run)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every row here")
    return parser


def _markdown(result: dict) -> str:
    """The tables of a run."""
    lines = []
    if "tune" in result:
        lines += ["| kernel | tile (BMxBNxWxS) | ms | error vs first |", "|---|---|---:|---:|"]
        for r in result["tune"]["rows"]:
            ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
            err = r["error"] if isinstance(r["error"], str) else f"{r['error']:.1e}"
            lines.append(f"| {r['kernel']} | {r['tile']} | {ms} | {err[:60]} |")
        lines.append("")
    if "profile" in result:
        keys = ["fwd", "kv", "q", "kva", "bwd", "op_fwd_bwd", "non_kernel", "fwd_bwd", "pairs"]
        lines += ["| variant | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
        for r in result["profile"]:
            cells = [f"{r[k]:.3f}" if isinstance(r.get(k), float) else "-" for k in keys]
            lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
        lines.append("")
    if "lengths" in result:
        lines += ["| seq | dense ms (TFLOP/s) | soft ms (TFLOP/s, x dense) | sparse top-1 ms "
                  "(x dense; ideal) | rivals (x dense: soft, sparse) |",
                  "|---:|---:|---:|---:|---|"]  # fmt: skip
        for r in result["lengths"]:
            soft, hard = r["soft"], r["hard_gated"]
            soft_text = soft.get("error") or (
                f"{soft['ms']:.2f} ({soft['tflops']:.0f}, {soft['speedup']:.2f}x)"
            )
            hard_text = hard.get("error") or (
                f"{hard['ms']:.2f} ({hard['speedup']:.2f}x; {hard['ideal']:.1f}x)"
            )
            rivals = "; ".join(
                f"{name}: " + ", ".join(
                    f"{m[name]['speedup']:.2f}x" if "speedup" in m[name] else "failed"
                    for m in (soft["rivals"], hard["rivals"])
                )
                for name in soft.get("rivals", {})
            )  # fmt: skip
            lines.append(
                f"| {r['seq']} | {r['dense_ms']:.2f} ({r['dense_tflops']:.0f}) | {soft_text} "
                f"| {hard_text} | {rivals or '-'} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Run the stages; returns (and with ``--json`` writes) every row."""
    args = _parser().parse_args(argv)
    import torch

    from focus_pretrain.bench import triton_kernels as tk
    from focus_pretrain.bench import triton_lengths as tl
    from focus_pretrain.environment import environment
    from focus_pretrain.focus.soft_triton_launch import _blocks
    from focus_pretrain.focus.triton_tiles import Tile, override_text, table_path

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    case = tk.Case(
        seq=args.seq, batch=args.batch, heads=args.heads, heads_kv=args.heads_kv or args.heads,
        head_dim=args.head_dim, groups=args.groups, window=args.window, dtype=args.dtype,
    )  # fmt: skip
    measure = tk.timer(device)
    tiles = _blocks(device, args.head_dim, tk.DTYPES[args.dtype])
    result: dict = {"case": asdict(case), "device": device}
    if device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    if "tune" in args.stages:
        tiny = {"fwd": ["32x16x4x1"], "kv": ["16x32x4x1"], "q": ["32x16x4x1"],
                "kva": ["16x16x1x1"]}  # fmt: skip
        pool = tk.candidates(args.head_dim, tiles, tiny if args.tiny else None)
        if device == "cuda":
            jobs = [(case, {**tiles, key: t}) for key, options in pool.items() for t in options]
            errors = tk.precompile(jobs, device, args.processes)
            print(json.dumps({"precompile_errors": errors}), flush=True)
        rows = tk.tune_rows(case, device, pool, measure)
        best = tk.best_tiles(rows, args.tolerance)
        result["tune"] = {"rows": rows, "best": best}
        tiles = {**tiles, **{key: Tile.parse(found["tile"]) for key, found in best.items()}}
        if device == "cuda" or args.table:  # on a CPU only into a table named explicitly
            gpu = result.get("gpu", "Triton interpreter (CPU)")
            table = args.table or table_path()
            result["tune"]["entry"] = tk.write_table(table, gpu, case, best, False)
        print(json.dumps({"best": best}), flush=True)
    result["tiles"] = {key: tile.text() for key, tile in tiles.items()}
    if "check" in args.stages:
        checked = replace(case, seq=args.check_seq, documents=512, sinks=4, softcap=30.0)
        cases = {args.dtype: checked}
        if device == "cuda":  # fp32 inputs (3xTF32 products: launched at head dim 64)
            cases["fp32 D64"] = replace(checked, dtype="fp32", head_dim=64)
        splits = ["kva=off"] + (["tuned"] if "kva" in tiles else [])  # both backward forms
        result["check"] = {}
        for split in splits:
            blocks = override_text(tiles) + (",kva=off" if split == "kva=off" else "")
            for name, sized in cases.items():
                tuned = device == "cuda" and sized.dtype == args.dtype  # fp32: its own tiles
                if split == "tuned" and not tuned:
                    continue
                with environment({"FOCUS_TRITON_BLOCKS": blocks if tuned else None}):
                    for mode in ("soft", "hard_gated"):
                        key = f"{mode} {name}" + (" atomic dQ" if split == "tuned" else "")
                        result["check"][key] = tk.reference_errors(sized, device, mode)
        print(json.dumps({"check": result["check"]}), flush=True)
    if "profile" in args.stages:
        if device == "cuda":
            jobs = [(replace(case, **fields), tiles) for fields in tk.VARIANTS.values()]
            tk.precompile(jobs, device, args.processes)
        result["profile"] = tk.profile_rows(case, device, tiles, measure)
        for row in result["profile"]:
            row.setdefault("bwd", sum(row.get(k, 0.0) for k in ("kv", "q", "kva")))
        print(json.dumps({"profile": result["profile"]}), flush=True)
    if "lengths" in args.stages:
        with environment({"FOCUS_TRITON_BLOCKS": override_text(tiles)}):
            rivals = tuple(args.rivals)
            result["lengths"] = tl.length_rows(case, args.lengths, device, measure, rivals=rivals)
        if device == "cuda" or args.table:  # the ranking auto reads (on a CPU: a named table)
            gpu = result.get("gpu", "Triton interpreter (CPU)")
            table = args.table or table_path()
            result["training"] = tl.write_training(table, gpu, case, result["lengths"])
    print(_markdown(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
