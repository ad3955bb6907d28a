"""Train a recipe: the product's main job.

    python launchers/pretrain.py --config configs/tiny.yaml                # one process (CPU ok)
    deepspeed launchers/pretrain.py --config configs/7b.yaml               # all local GPUs
    torchrun --nproc-per-node 8 launchers/pretrain.py --config configs/7b.yaml
    python launchers/pretrain.py --config configs/7b.yaml --dry-run        # memory plan only

Repeatable ``--set section.key=value`` overrides any recipe value, e.g.
``--set run.output_dir=runs/x --set train.steps=10``.
"""

from __future__ import annotations

import argparse

from focus_pretrain.config import load_config
from focus_pretrain.train import pretrain
from focus_pretrain.train.plan import print_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        "--dry-run",
        action="store_true",
        help="build on the meta device and print parameters and memory per GPU",
    )
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    if args.dry_run:
        print_plan(config)
        return
    pretrain(config)


if __name__ == "__main__":
    main()
