"""E7's table from a run_matrix.sh output directory: per run, the original's loss and each
variant's gap to it (validation, beyond the window, far evidence) and kept pairs.

    python tools/experiments/e7/summarize.py /work/e7-runs/austen [--json]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

METRICS = ("loss", "loss_beyond_window", "loss_far_evidence")


def rows(out: Path) -> list[dict]:
    """One row per (run, variant) with the gaps to the run's original (dense) model."""
    table = []
    for report_path in sorted(out.glob("*/report.json")):
        report = json.loads(report_path.read_text())
        evaluations = dict(report["evaluations"])
        variants = report_path.parent / "variants.json"
        if variants.is_file():
            evaluations.update(json.loads(variants.read_text()))
        original = evaluations.pop("original (dense)")
        for variant, metrics in evaluations.items():
            row = {"run": report_path.parent.name, "variant": variant}
            row["original"] = round(original["loss"], 4)
            row.update({f"gap {m}": round(metrics[m] - original[m], 4) for m in METRICS})
            row["kept_pairs"] = metrics.get("kept_pairs")
            table.append(row)
    return table


def main() -> None:
    table = rows(Path(sys.argv[1]))
    if "--json" in sys.argv:
        print(json.dumps(table, indent=1))
        return
    print(
        "| run | variant | original | gap: validation | beyond window | far evidence | kept pairs |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in table:
        kept = "-" if r["kept_pairs"] is None else f"{r['kept_pairs']:.3f}"
        gaps = " | ".join(f"{r[f'gap {m}']:+.3f}" for m in METRICS)
        print(f"| {r['run']} | {r['variant']} | {r['original']:.3f} | {gaps} | {kept} |")


if __name__ == "__main__":
    main()
