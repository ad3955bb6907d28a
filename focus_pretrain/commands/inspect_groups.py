"""Inspect the groups a trained Focus model's routers form, per layer: shares, the trained
pattern's kept pairs against random routing, the distance profile of same-group pairs, typical
tokens per group and stability across layers. Writes report.md, report.json and PNG plots.

    python tools/inspect_groups.py --checkpoint runs/tiny --corpus demo:20 --out runs/tiny/groups
    python tools/inspect_groups.py --checkpoint exports/gpt2-focus --text a.txt b.txt --out g
    python tools/inspect_groups.py --checkpoint runs/tiny --corpus data.jsonl --samples 32 \\
        --length 128 --out runs/tiny/groups

--checkpoint: a run directory, a checkpoint directory or an exported HuggingFace directory.
--text: each file is one sample (refused if longer than the model's maximum length, unless
--length cuts it). --corpus: anything focus-pretrain preprocess reads (demo:N, .jsonl, .txt,
a directory, a hub dataset), as --samples pieces of --length tokens. See docs/interpretability.md.
"""

from __future__ import annotations

import sys

from focus_pretrain.cli import at_least, device, tool_parser
from focus_pretrain.errors import exit_on_input_error


def main(argv: list[str] | None = None) -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="run, checkpoint or HF export dir")
    parser.add_argument("--text", nargs="+", default=[], metavar="FILE", help="text files")
    parser.add_argument("--corpus", help="a corpus source (demo:50, file.jsonl, dir, hub name)")
    parser.add_argument(
        "--samples", type=at_least(1), default=16, help="corpus pieces (default 16)"
    )
    parser.add_argument(
        "--length", type=at_least(1), help="tokens per sample (default: model maximum)"
    )
    parser.add_argument("--batch-size", type=at_least(1), default=4)
    parser.add_argument("--tokenizer", help="replace the model's tokenizer (.model or HF dir)")
    parser.add_argument(
        "--device", type=device, help="cpu, cuda, ... (default: where the loader puts it)"
    )
    parser.add_argument(
        "--min-count", type=at_least(1), default=5, help="occurrences to rank a token"
    )
    parser.add_argument("--top-n", type=at_least(1), default=8, help="tokens listed per group")
    parser.add_argument(
        "--plot-tokens", type=at_least(1), default=256, help="tokens in the token plots"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-routing reference")
    parser.add_argument("--out", required=True, help="directory for report.md/.json and PNGs")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    # heavy imports after the arguments: --help answers without loading PyTorch
    from focus_pretrain.analysis.pipeline import inspect_groups
    from focus_pretrain.parallel.launch import shutdown_distributed

    try:
        with exit_on_input_error(parser.prog):  # bad input: one line, status 2, before any work
            report = inspect_groups(
                args.checkpoint,
                args.out,
                texts=args.text,
                corpus=args.corpus,
                samples=args.samples,
                length=args.length,
                batch_size=args.batch_size,
                tokenizer=args.tokenizer,
                device=args.device,
                min_count=args.min_count,
                top_n=args.top_n,
                plot_tokens=args.plot_tokens,
                seed=args.seed,
                progress=not args.quiet,
            )
    finally:
        shutdown_distributed()
    print(f"report: {report}")


if __name__ == "__main__":
    sys.exit(main())
