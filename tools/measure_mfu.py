"""Measure training throughput and MFU of recipes on this machine (one GPU, or CPU as a smoke test).

Each recipe trains ``--steps`` steps with the real trainer in a child process (an out-of-memory
error becomes that recipe's row, the next one still runs); the first ``--warmup-intervals``
logged intervals (compilation, warm-up) are dropped. Reports tokens/s, TFLOP/s per device, MFU
(the runs' own FLOP count: causal attention pairs, forward x 3; peak: ``train.peak_tflops`` or
the GPU's dense bf16 figure, 989 for an H100), peak memory and the loss, as a markdown table and
optionally JSON. See focus_pretrain/bench/training.py.

    python tools/measure_mfu.py --json mfu.json --markdown mfu.md      # 1b-8k and its dense twin
    python tools/measure_mfu.py --config configs/1b-8k.yaml --steps 30 \\
        --set train.global_batch_size=4                                 # shorter steps
    python tools/measure_mfu.py --config configs/tiny.yaml --steps 4 --log-interval 1  # CPU smoke
"""

from __future__ import annotations

import sys

import torch

from focus_pretrain.bench.report import environment, run_and_report
from focus_pretrain.bench.training import MfuConfig, markdown_table, run_benchmark
from focus_pretrain.cli import tool_parser
from focus_pretrain.errors import exit_on_input_error


def main(argv: list[str] | None = None) -> int:
    defaults = MfuConfig()
    parser = tool_parser(__doc__)
    parser.add_argument(
        "--config", nargs="+", default=defaults.recipes, help="recipes, measured in turn"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a value of every recipe (repeatable)",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--log-interval", type=int, default=defaults.log_interval)
    parser.add_argument(
        "--warmup-intervals",
        type=int,
        default=defaults.warmup_intervals,
        help="leading logged intervals left out of the figures",
    )
    parser.add_argument(
        "--output-dir",
        default=defaults.output_dir,
        help="parent of the run directories (OUTPUT_DIR/<recipe stem>, emptied before each "
        "measurement if this tool made it; another directory of that name is refused)",
    )
    parser.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="seconds per recipe"
    )
    parser.add_argument("--json", help="write environment and rows to this JSON file")
    parser.add_argument("--markdown", help="write the markdown table to this file")
    args = parser.parse_args(argv)

    cfg = MfuConfig(
        recipes=args.config,
        overrides=args.overrides,
        steps=args.steps,
        log_interval=args.log_interval,
        warmup_intervals=args.warmup_intervals,
        output_dir=args.output_dir,
        timeout_s=args.timeout,
    )
    env = environment(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    with exit_on_input_error(parser.prog):  # a bad recipe, or an output directory not ours
        rows = run_and_report(
            env, lambda: run_benchmark(cfg), markdown_table, args.json, args.markdown
        )
    return 1 if any(row["error"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
