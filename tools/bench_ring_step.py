"""Benchmark one ring step of context-parallel Focus attention: fused FlexAttention vs blockwise.

On one device, no process group: a rank's zigzag queries (``seq / CP`` tokens) against a
visiting K/V block with its positions and memberships (hard top-k) or soft assignments (soft
gate), the diagonal and an off-diagonal step. Checks the fused kernel against the blockwise one
(relative errors of the output and gradients), then times the forward step and the ring's
backward step (recompute + gradients) of each: CUDA events after warm-up, median of repeats.
A kernel that runs out of memory at a size is recorded and the run goes on. Writes JSON and a
markdown table. On CPU (``--device cpu``, tiny sizes) it is a smoke test only.

    python tools/bench_ring_step.py --seq 65536 262144 --cp 8 --groups 8 --top-k 1 \\
        --heads 16 --head-dim 128 --dtype bf16 --json ring.json --markdown ring.md
"""

from __future__ import annotations

from focus_pretrain.bench.report import DTYPES, environment, run_and_report
from focus_pretrain.bench.ring import STEPS, RingBenchConfig, markdown_table, run_ring_benchmark
from focus_pretrain.cli import tool_parser


def main(argv: list[str] | None = None) -> list[dict]:
    defaults = RingBenchConfig()
    parser = tool_parser(__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=defaults.seq, help="global tokens")
    parser.add_argument("--cp", type=int, default=defaults.cp, help="context-parallel size")
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--top-k", type=int, default=defaults.top_k)
    parser.add_argument("--modes", nargs="+", choices=["hard", "soft"], default=defaults.modes)
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=defaults.steps)
    parser.add_argument(
        "--kernels", nargs="+", choices=["blockwise", "flex", "triton"], default=defaults.kernels
    )
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--sinks", type=int, default=defaults.sinks)
    parser.add_argument(
        "--document", type=int, default=defaults.document, help="document length (0: one)"
    )
    parser.add_argument("--batch", type=int, default=defaults.batch)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--heads-kv", type=int, help="KV heads (GQA); default: --heads")
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype)
    parser.add_argument("--gate-lambda", type=float, default=defaults.gate_lambda)
    parser.add_argument("--no-backward", action="store_true", help="time the forward step only")
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--device", default=defaults.device, help="cuda (figures) or cpu (smoke)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", help="write environment and rows to this JSON file")
    parser.add_argument("--markdown", help="write the markdown table to this file")
    args = parser.parse_args(argv)

    cfg = RingBenchConfig(
        seq=args.seq,
        cp=args.cp,
        groups=args.groups,
        top_k=args.top_k,
        modes=args.modes,
        steps=args.steps,
        kernels=args.kernels,
        window=args.window,
        sinks=args.sinks,
        document=args.document,
        batch=args.batch,
        heads=args.heads,
        heads_kv=args.heads_kv or args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        gate_lambda=args.gate_lambda,
        backward=not args.no_backward,
        warmup=args.warmup,
        repeats=args.repeats,
        device=args.device,
        seed=args.seed,
    )
    env = environment(cfg, cfg.device)
    return run_and_report(
        env, lambda: run_ring_benchmark(cfg), markdown_table, args.json, args.markdown
    )


if __name__ == "__main__":
    main()
