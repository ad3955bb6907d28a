"""E7's needle table: every ``focus-pretrain ruler --json`` result in a directory
(tools/experiments/e7/run_ruler.sh's OUT), a row each: the run, the Focus settings it inferred
with, and the score (share of needles found) per task and length with the sample count.

    python tools/experiments/e7/ruler_table.py OUT [--json TABLE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def settings(focus: dict | None) -> str:
    """How the export inferred: dense, the window alone or hard/soft top-k (with sinks, and
    the keys' rule when it is not the method's)."""
    if focus is None or not focus.get("enabled", True):
        return "dense (the original)"
    sinks = f", sinks {focus['sinks']}" if focus.get("sinks") else ""
    if focus.get("window_only"):
        return f"window {focus['window']} only{sinks}"
    keys = focus.get("key_groups", "own")
    rule = "" if keys == "own" else f", keys {keys.replace('_', ' ')}"
    return f"{focus['inference_mode']} top-{focus['top_k']} of {focus['num_groups']}{sinks}{rule}"


def rows(directory: Path) -> list[dict]:
    """One row per result file (``records`` left out), sorted by file name."""
    found = []
    for path in sorted(directory.glob("*.json")):
        result = json.loads(path.read_text())
        if "scores" not in result:
            continue
        inferred = settings(result["focus"]) if "focus" in result else "(not recorded)"
        found.append({"run": path.stem, "settings": inferred,
                      "scores": result["scores"], "samples": result["samples"]})  # fmt: skip
    return found


def markdown(table: list[dict]) -> str:
    columns = sorted({(task, length) for row in table for task, by in row["scores"].items()
                      for length in by}, key=lambda c: (c[0], int(c[1])))  # fmt: skip
    lines = ["| run | inferred with | " + " | ".join(f"{t} @ {n}" for t, n in columns) + " |"]
    lines.append("|---|---|" + "---:|" * len(columns))
    for row in table:
        cells = [
            f"{row['scores'][t][n]:.2f} (n={row['samples'][t][n]})" if n in row["scores"].get(t, {})
            else "-"
            for t, n in columns
        ]  # fmt: skip
        lines.append(f"| {row['run']} | {row['settings']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the directory of ruler --json results")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args()
    table = rows(args.out)
    if not table:
        raise SystemExit(f"ruler_table: no ruler --json result in {args.out}")
    print(markdown(table))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
