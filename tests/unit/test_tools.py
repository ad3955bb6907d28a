"""Command-line tools run end to end (small sizes)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]


def test_pattern_density_tool(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "pattern_density.py"),
            "--seq",
            "512",
            "4096",
            "--groups",
            "4",
            "--top-k",
            "1",
            "2",
            "--window",
            "16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "| 4096 | 4 | 1 | 16 |" in result.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    top1 = next(r for r in rows if r["seq"] == 4096 and r["top_k"] == 1)
    # uniform top-1 routing over K=4 keeps about 1/4 of the far pairs plus the window
    assert 0.24 < top1["density"] < 0.30
    top2 = next(r for r in rows if r["seq"] == 4096 and r["top_k"] == 2)
    assert top2["density"] > top1["density"]  # 2-of-4 sets intersect with probability 5/6
