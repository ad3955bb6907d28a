"""Run a declarative study (recipe variants x seeds, exports, evaluations) and print its table
of mean +- standard deviation over seeds; ``OUT/results.md`` and ``OUT/results.json`` keep it.

    python tools/experiments/run.py configs/experiments/e1-demo.yaml
    python tools/experiments/run.py configs/experiments/e2-balance.yaml --jobs 2
    python tools/experiments/run.py configs/experiments/e1-demo.yaml --set train.steps=20 \\
        --seeds 1 --out runs/experiments/smoke                (a quick smoke test)

See :mod:`focus_pretrain.experiments.runner` for the spec format and docs/experiments.md for
the studies and their results.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from focus_pretrain.experiments import load_spec, run_experiment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="an experiment spec (configs/experiments/*.yaml)")
    parser.add_argument("--out", help="output directory (default runs/experiments/NAME)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (CPU split)")
    parser.add_argument(
        "--set", dest="extra", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override every run (e.g. train.steps=20 for a smoke test)",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", help="replace the spec's seeds")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    if args.seeds:
        spec = replace(spec, seeds=args.seeds)
    out = Path(args.out or f"runs/experiments/{spec.name}")
    summary = run_experiment(spec, out, jobs=args.jobs, extra=args.extra)
    print(f"\n{spec.name}: {len(spec.seeds)} seeds, {summary['total_wall_s']:.0f} s")
    print(summary["table"])
    print(f"(results: {out / 'results.md'}, {out / 'results.json'})")


if __name__ == "__main__":
    main()
