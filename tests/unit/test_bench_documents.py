"""``tools/bench_documents.py`` runs end to end at tiny sizes (a smoke check, not figures)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[2]


def test_bench_documents_smoke_on_cpu(tmp_path):
    out, table = tmp_path / "docs.json", tmp_path / "docs.md"
    args = ["--seq", "256", "--doc-len", "64", "32", "--sinks", "0", "2", "--groups", "4"]
    args += ["--window", "16", "--heads", "4", "--heads-kv", "2", "--head-dim", "8"]
    args += ["--warmup", "0", "--repeats", "2", "--json", str(out), "--markdown", str(table)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_documents.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["environment"]["config"]["backend"] == "decomposed"
    rows = report["rows"]
    assert [(r["doc_len"], r["sinks"]) for r in rows] == [(64, 0), (64, 2), (32, 0), (32, 2)]
    for row in rows:
        assert row["documents"] == 256 // row["doc_len"]
        assert row["max_abs_diff_packed_vs_unpacked"] < 1e-4  # packed == each document alone
        assert min(row["ms"].values()) > 0
        times = row["repeats_ms"]
        assert [len(t) for t in times.values()] == [2, 2, 2]
        ratios = sorted(p / u for p, u in zip(times["packed"], times["unpacked"], strict=True))
        assert abs(row["packed_over_unpacked"] - sum(ratios) / 2) < 1e-9  # median of two
    assert "| 256 | 32 | 8 | 4 | 16 | 2 | decomposed |" in table.read_text()
    assert "packed / unpacked" in result.stdout
