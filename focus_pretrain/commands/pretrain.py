"""Train a recipe: the product's main job.

    python launchers/pretrain.py --config configs/tiny.yaml                # one process (CPU ok)
    deepspeed launchers/pretrain.py --config configs/7b.yaml               # all local GPUs
    torchrun --nproc-per-node 8 launchers/pretrain.py --config configs/7b.yaml
    python launchers/pretrain.py --config configs/7b.yaml --dry-run        # memory plan only

Repeatable ``--set section.key=value`` overrides any recipe value, e.g.
``--set run.output_dir=runs/x --set train.steps=10``.
``--universal-checkpoint`` resumes at another parallel layout (docs/training.md, Resharding).
A bad recipe, override, layout or checkpoint ends with one line naming it and the fix (status 2).
"""

from __future__ import annotations

import argparse
import sys

from focus_pretrain.cli import tool_parser
from focus_pretrain.errors import exit_on_input_error


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--config", required=True, help="a YAML recipe (configs/*.yaml)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a recipe value (repeatable)",
    )
    parser.add_argument(
        "--universal-checkpoint",
        action="store_true",
        help="resume a checkpoint saved at another parallel layout (data/tensor-parallel size, "
        "ZeRO stage) through DeepSpeed's universal checkpoint: --set train.load_universal=true",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="build on the meta device and print parameters and memory per GPU",
    )
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher
    args = parser.parse_args()
    # heavy imports after the arguments: --help answers without loading PyTorch
    from focus_pretrain.config import load_config
    from focus_pretrain.train import pretrain
    from focus_pretrain.train.bad_steps import TooManyBadSteps
    from focus_pretrain.train.plan import print_plan

    if args.universal_checkpoint:
        args.overrides.append("train.load_universal=true")
    # a bad recipe, override, layout or checkpoint: one line naming it and the fix, status 2;
    # a real crash keeps its traceback
    with exit_on_input_error(parser.prog):
        config = load_config(args.config, args.overrides)
        if args.dry_run:
            print_plan(config)
            return
        try:
            pretrain(config)
        except TooManyBadSteps as err:  # a checkpoint was saved; the reason, not a traceback
            sys.exit(f"{parser.prog}: error: {err}")


if __name__ == "__main__":
    main()
