"""E7's table from a run_matrix.sh output directory: per run, the original's loss and each
variant's gap to it (validation, beyond the window, far evidence) and kept pairs; then, for
runs repeated with other seeds (``NAME-seedN`` beside ``NAME``), each variant's mean and
standard deviation over the seeds.

    python tools/experiments/e7/summarize.py /work/e7-runs/austen [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

METRICS = ("loss", "loss_beyond_window", "loss_far_evidence")


# the report's evaluations by the file the retrofit command writes each one to (RUN/eval/)
EVAL_FILES = {"original (dense)": "original", "retrofit, soft": "soft", "retrofit, hard": "hard"}


def evaluations_of(run: Path) -> dict[str, dict] | None:
    """The report's evaluations of ``run`` (``report.json``), or, for a run whose report did
    not finish after its evaluations (the group report failed), the same metrics from
    ``eval/*.json``; ``None`` when neither is there."""
    if (run / "report.json").is_file():
        return dict(json.loads((run / "report.json").read_text())["evaluations"])
    files = {name: run / "eval" / f"{stem}.json" for name, stem in EVAL_FILES.items()}
    if not all(path.is_file() for path in files.values()):
        return None
    return {name: json.loads(path.read_text())["metrics"] for name, path in files.items()}


def rows(out: Path) -> list[dict]:
    """One row per (run, variant) with the gaps to the run's original (dense) model."""
    table = []
    for run in sorted(p for p in out.iterdir() if p.is_dir()):
        evaluations = evaluations_of(run)
        if evaluations is None:
            continue
        report_path = run / "report.json"
        variants = run / "variants.json"
        if variants.is_file():
            evaluations.update(json.loads(variants.read_text()))
        originals = {"": evaluations.pop("original (dense)")}
        for name in [n for n in evaluations if n.startswith("original (dense), ")]:
            originals[name.removeprefix("original (dense)")] = evaluations.pop(name)
        for variant, metrics in evaluations.items():
            # a variant named "..., window W" against the dense model at that window (the
            # loss-by-distance positions depend on it)
            suffix = next((s for s in originals if s and variant.endswith(s)), "")
            original = originals[suffix]
            row = {"run": report_path.parent.name, "variant": variant}
            row["original"] = round(original["loss"], 4)
            row.update({f"gap {m}": round(metrics[m] - original[m], 4) for m in METRICS})
            row["kept_pairs"] = metrics.get("kept_pairs")
            table.append(row)
    return table


def over_seeds(table: list[dict]) -> list[dict]:
    """Per (run without its ``-seedN`` suffix, variant) seen in at least two runs: the number
    of seeds and each gap's mean and sample standard deviation."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in table:
        base = re.sub(r"-seed\d+$", "", row["run"])
        groups.setdefault((base, row["variant"]), []).append(row)
    summary = []
    for (base, variant), members in groups.items():
        if len(members) < 2:
            continue
        entry = {"run": base, "variant": variant, "seeds": len(members)}
        for m in METRICS:
            values = [r[f"gap {m}"] for r in members]
            entry[f"gap {m}"] = round(statistics.mean(values), 4)
            entry[f"sd {m}"] = round(statistics.stdev(values), 4)
        summary.append(entry)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a run_matrix.sh output directory")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args()
    if not args.out.is_dir():
        print(
            f"summarize.py: {args.out} is not a directory: pass run_matrix.sh's OUT",
            file=sys.stderr,
        )
        sys.exit(2)
    table = rows(args.out)
    seeds = over_seeds(table)
    if args.json:
        print(json.dumps({"runs": table, "over_seeds": seeds}, indent=1))
        return
    print(
        "| run | variant | original | gap: validation | beyond window | far evidence | kept pairs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in table:
        kept = "-" if r["kept_pairs"] is None else f"{r['kept_pairs']:.3f}"
        gaps = " | ".join(f"{r[f'gap {m}']:+.3f}" for m in METRICS)
        print(f"| {r['run']} | {r['variant']} | {r['original']:.3f} | {gaps} | {kept} |")
    if seeds:
        print("\n| run | variant | seeds | gap: validation | beyond window | far evidence |")
        print("|---|---|---:|---:|---:|---:|")
        for r in seeds:
            gaps = " | ".join(f"{r[f'gap {m}']:+.3f} ± {r[f'sd {m}']:.3f}" for m in METRICS)
            print(f"| {r['run']} | {r['variant']} | {r['seeds']} | {gaps} |")


if __name__ == "__main__":
    main()
