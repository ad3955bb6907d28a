"""``parallel.deepspeed`` reaches DeepSpeed: its CSV monitor writes the learning rate of every
step, the same values the trainer logs (tests/unit/test_deepspeed_overrides.py: merging and
refusals)."""

from __future__ import annotations

import csv

import pytest

from tests.e2e.runs import launch, overrides, read_metrics

pytestmark = pytest.mark.e2e


def test_a_csv_monitor_through_parallel_deepspeed_writes_its_files(tmp_path, cache):
    out, monitor = tmp_path / "run", tmp_path / "csv"
    sets = [
        "train.steps=3",
        "parallel.deepspeed.csv_monitor.enabled=true",
        f"parallel.deepspeed.csv_monitor.output_path={monitor}",
        "parallel.deepspeed.csv_monitor.job_name=tiny",
    ]
    run = launch(overrides(out, cache, *sets))
    assert run.returncode == 0, run.stderr[-3000:]
    with open(monitor / "tiny" / "Train_Samples_lr.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "lr"]
    lrs = [r["lr"] for r in read_metrics(out) if r.get("split") == "train"]
    assert len(rows) == 1 + 3 and len(lrs) == 3
    # DeepSpeed's sample counter per step (global batch 4), and our schedule's rates
    assert [int(r[0]) for r in rows[1:]] == [4, 8, 12]
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(lrs)
