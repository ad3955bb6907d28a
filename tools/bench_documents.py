"""Benchmark the masking overhead of packed documents in a Focus backend (hard top-1).

Times one call on documents of ``--doc-len`` tokens packed into a ``--seq`` sequence
(``documents=``) against the same tokens as a batch of separate sequences and against the
packed sequence without documents (median of repeats after warm-up, ``perf_counter`` on CPU,
CUDA events on GPU). The packed output is first checked against the unpacked one. Writes JSON
and a markdown table.

    python tools/bench_documents.py --seq 16384 --doc-len 512 --groups 8 --window 128 \\
        --heads 8 --head-dim 64 --dtype fp32 --device cpu --json docs.json --markdown docs.md
"""

from __future__ import annotations

from focus_pretrain.bench.documents import DocumentsBenchConfig, markdown_table, run_benchmark
from focus_pretrain.bench.report import DTYPES, environment, run_and_report
from focus_pretrain.cli import tool_parser


def main(argv: list[str] | None = None) -> None:
    defaults = DocumentsBenchConfig()
    parser = tool_parser(__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=defaults.seq)
    parser.add_argument("--doc-len", type=int, nargs="+", default=defaults.doc_len)
    parser.add_argument("--sinks", type=int, nargs="+", default=defaults.sinks)
    parser.add_argument("--groups", type=int, default=defaults.groups)
    parser.add_argument("--window", type=int, default=defaults.window)
    parser.add_argument("--heads", type=int, default=defaults.heads)
    parser.add_argument("--heads-kv", type=int, help="KV heads (GQA); default: --heads")
    parser.add_argument("--head-dim", type=int, default=defaults.head_dim)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=defaults.dtype)
    parser.add_argument("--backend", default=defaults.backend)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--repeats", type=int, default=defaults.repeats)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--json", help="write environment and rows to this JSON file")
    parser.add_argument("--markdown", help="write the markdown table to this file")
    args = parser.parse_args(argv)

    cfg = DocumentsBenchConfig(
        seq=args.seq,
        doc_len=args.doc_len,
        sinks=args.sinks,
        groups=args.groups,
        window=args.window,
        heads=args.heads,
        heads_kv=args.heads_kv or args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        backend=args.backend,
        warmup=args.warmup,
        repeats=args.repeats,
        device=args.device,
        seed=args.seed,
    )
    env = environment(cfg, cfg.device)
    run_and_report(env, lambda: run_benchmark(cfg), markdown_table, args.json, args.markdown)


if __name__ == "__main__":
    main()
