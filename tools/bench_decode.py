"""Benchmark decoding from an exported Focus model's KV cache against the dense cache.

Builds a random Focus Llama with the shipped HF modeling code, prefills each context length once
and times one-token decode steps (median after warm-up). Dynamic cache (eager): the plain model
with SDPA on the same keys, the Focus model over its whole cache, and the Focus model's sparse
step (window + the query's groups). Static cache (``StaticCache``, each step one compiled graph,
CUDA graphs on CUDA): the plain model with SDPA against the Focus model's block-sparse step.
Checks the sparse steps against the dense Focus step; ``--generate N``: ``generate()`` end to
end too (prefill + N tokens). Writes JSON and markdown tables.

    python tools/bench_decode.py --seq 4096 16384 65536 --batch 8 --groups 8 --top-k 1 \\
        --json decode.json --markdown decode.md
"""

from __future__ import annotations

from focus_pretrain.bench.decode import (
    CACHES,
    DTYPES,
    DecodeBenchConfig,
    markdown_table,
    run_decode_benchmark,
)
from focus_pretrain.bench.report import environment, run_and_report
from focus_pretrain.cli import tool_parser


def main(argv: list[str] | None = None) -> None:
    defaults = DecodeBenchConfig()
    parser = tool_parser(__doc__)
    parser.add_argument("--seq", type=int, nargs="+", default=defaults.seq)
    for name in ("batch", "groups", "top_k", "window", "layers", "heads", "head_dim", "vocab"):
        flag = f"--{name.replace('_', '-')}"
        parser.add_argument(flag, type=int, default=getattr(defaults, name))
    parser.add_argument("--heads-kv", type=int, help="KV heads (GQA); default: --heads")
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--dtype", default=defaults.dtype, choices=sorted(DTYPES))
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument(
        "--caches", nargs="+", choices=CACHES, default=defaults.caches,
        help="dynamic: the eager sparse step on the dynamic cache; static: the compiled step on "
        "a StaticCache (block-sparse), each against dense attention on the same cache",
    )  # fmt: skip
    parser.add_argument(
        "--no-cuda-graphs", action="store_true",
        help="compile the static rows' steps without CUDA graphs (mode=reduce-overhead)",
    )  # fmt: skip
    parser.add_argument(
        "--generate", type=int, default=0, metavar="N",
        help="also time generate() end to end (prefill + N new tokens, greedy) per cache, "
        "plain and Focus (static: compiled by transformers on CUDA)",
    )  # fmt: skip
    parser.add_argument("--json", help="write environment and rows to this JSON file")
    parser.add_argument("--markdown", help="write the markdown table to this file")
    args = parser.parse_args(argv)
    cfg = DecodeBenchConfig(
        seq=args.seq,
        batch=args.batch,
        groups=args.groups,
        top_k=args.top_k,
        window=args.window,
        layers=args.layers,
        heads=args.heads,
        heads_kv=args.heads_kv or args.heads,
        head_dim=args.head_dim,
        vocab=args.vocab,
        warmup=args.warmup,
        steps=args.steps,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        caches=args.caches,
        cuda_graphs=not args.no_cuda_graphs,
        generate=args.generate,
    )
    env = environment(cfg, cfg.device)
    run_and_report(env, lambda: run_decode_benchmark(cfg), markdown_table, args.json, args.markdown)


if __name__ == "__main__":
    main()
