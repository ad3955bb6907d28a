"""Benchmark Focus attention backends against dense causal attention (FlashAttention).

Times dense causal attention (SDPA's flash kernel; flash-attn when importable) and every Focus
backend in hard mode (top-k routing, window w) with CUDA events after warm-up, median of
repeats; reports time, speedup, the ideal speedup from the pattern's exact allowed-pair count,
and the non-kernel overhead (membership, sort, masks, merge). Each backend is first checked
against the reference. Writes JSON and a markdown table. On CPU it is a smoke test only.

    python tools/bench_attention.py --seq 1024 4096 16384 65536 262144 1048576 \\
        --groups 4 8 --top-k 1 2 --heads 16 --head-dim 128 --dtype bf16 --train \\
        --json bench.json --markdown bench.md
"""

from __future__ import annotations

import json
import pathlib

from focus_pretrain.bench.config import DTYPE_NAMES, BenchConfig
from focus_pretrain.cli import at_least, device, output_file, tool_parser
from focus_pretrain.errors import exit_on_input_error
from focus_pretrain.storage.files import write_atomic


def _parser(defaults: BenchConfig):
    """The command line, its defaults from :class:`BenchConfig`."""
    parser = tool_parser(__doc__)
    parser.add_argument("--seq", type=at_least(1), nargs="+", default=defaults.seq)
    parser.add_argument("--groups", type=at_least(1), nargs="+", default=defaults.groups)
    parser.add_argument("--top-k", type=at_least(1), nargs="+", default=defaults.top_k)
    parser.add_argument("--window", type=at_least(0), default=defaults.window)
    parser.add_argument("--batch", type=at_least(1), default=defaults.batch)
    parser.add_argument("--heads", type=at_least(1), default=defaults.heads)
    parser.add_argument("--heads-kv", type=at_least(1), help="KV heads (GQA); default: --heads")
    parser.add_argument("--head-dim", type=at_least(1), default=defaults.head_dim)
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=defaults.dtype)
    parser.add_argument("--backends", nargs="+", default=defaults.backends)
    parser.add_argument("--warmup", type=at_least(0), default=defaults.warmup)
    parser.add_argument("--repeats", type=at_least(1), default=defaults.repeats)
    parser.add_argument(
        "--train",
        action="store_true",
        help="also time training steps (fwd+bwd): the soft gate, and sparse training "
        "(hard_gated) per --top-k",
    )
    parser.add_argument(
        "--device", type=device, default=defaults.device, help="cuda (figures) or cpu (smoke)"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--no-hard", action="store_true", help="only the --train rows")
    parser.add_argument(
        "--train-modes",
        nargs="+",
        choices=["soft", "hard"],
        default=defaults.train_modes,
        help="the --train rows: the soft gate, sparse training (hard_gated) per --top-k",
    )
    parser.add_argument(
        "--gate-forms",
        nargs="+",
        choices=["sigmoid", "dot"],
        default=defaults.gate_forms,
        help="the --train rows' gate forms (dot: the soft pattern as plain causal attention on "
        "q, k widened by the gate's channels; name sdpa in --backends for PyTorch's SDPA)",
    )
    parser.add_argument(
        "--key-groups",
        choices=["own", "own_and_previous"],
        default=defaults.key_groups,
        help="the keys' groups in every routed row (focus.key_groups; own_and_previous: a key "
        "also in its predecessor's groups, computed by the reference and flex)",
    )
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="time calls captured whole (torch.compile reduce-overhead: CUDA graphs), dense too",
    )
    parser.add_argument(
        "--profile", type=output_file, help="append profiler tables (one call per backend) here"
    )
    parser.add_argument(
        "--json", type=output_file, help="write environment and rows to this JSON file"
    )
    parser.add_argument(
        "--markdown", type=output_file, help="write the markdown table to this file"
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser(BenchConfig())
    args = parser.parse_args(argv)
    # heavy imports after the arguments: --help answers without loading PyTorch
    from focus_pretrain.bench.attention import check_config, markdown_table, run_benchmark
    from focus_pretrain.bench.report import environment, run_and_report

    cfg = BenchConfig(
        seq=args.seq,
        groups=args.groups,
        top_k=args.top_k,
        window=args.window,
        batch=args.batch,
        heads=args.heads,
        heads_kv=args.heads_kv or args.heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        backends=args.backends,
        warmup=args.warmup,
        repeats=args.repeats,
        train=args.train,
        train_modes=args.train_modes,
        gate_forms=args.gate_forms,
        key_groups=args.key_groups,
        device=args.device,
        seed=args.seed,
        profile=args.profile,
        graphs=args.graphs,
        hard=not args.no_hard,
    )
    with exit_on_input_error(parser.prog):  # bad input: one line, status 2, before any work
        check_config(cfg)
    for path in (args.json, args.markdown, args.profile):
        if path:
            pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    env = environment(cfg, cfg.device)

    def save_partial(rows: list[dict]) -> None:  # kept if a time limit stops the run
        if args.json:
            partial = {"environment": env, "rows": rows, "partial": True}
            write_atomic(pathlib.Path(args.json), json.dumps(partial, indent=1))

    run = lambda: run_benchmark(cfg, on_row=save_partial)  # noqa: E731
    run_and_report(env, run, markdown_table, args.json, args.markdown)


if __name__ == "__main__":
    main()
