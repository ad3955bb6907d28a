"""The demo learns what it is for: Focus recalls keys and values defined beyond the window,
its window-only twin cannot (the recipe's 800 steps, twice; the suite's longest test, in a
file of its own so that parallel test workers share it out)."""

from __future__ import annotations

import json
import sys

import pytest

from focus_pretrain.train import read_metrics
from tests.e2e import runs
from tests.e2e.runs import RECIPE, ROOT, TIMEOUT

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.timeout(2 * TIMEOUT)
def test_focus_beats_its_window_only_twin_on_long_range_recall(tmp_path):
    """The demo learns: after the recipe's 800 steps from the same seed, Focus's loss on the
    recall lines' query tokens (keys and values defined beyond the window) is clearly below its
    window-only twin's and its recall accuracy clearly above, and it is never worse on the
    recalled values (the twin stays at the prior).

    Measured on a 2-core AMD EPYC (docs/benchmarks.md): 2.41 vs 3.32 nats on the query tokens,
    value loss 0.29 vs 1.38 (the prior is ln 4 = 1.39). On a 2-core Intel Xeon (2026-11-26,
    the same code and versions) the run diverges numerically: Focus 2.71 nats and recall
    accuracy 0.33 vs 0.14, but the values not yet learned at 800 steps (1.379 vs 1.380): whether
    the values are learned by then depends on the machine's float rounding, so the test checks
    what holds on both.
    """
    args = [sys.executable, str(ROOT / "tools" / "demo_recall.py"), "--config", RECIPE]
    for item in [
        "train.tensorboard=false",
        f"run.output_dir={tmp_path}",
        f"data.cache_dir={tmp_path}/c",
    ]:
        args += ["--set", item]
    run = runs.run(args, timeout=2 * TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    scores = json.loads(run.stdout.strip().splitlines()[-1])
    focus, window = scores["focus"], scores["window_only"]
    assert focus["recall_tokens"] == window["recall_tokens"] > 50
    assert focus["recall_loss"] < window["recall_loss"] - 0.3, scores
    assert focus["value_loss"] < window["value_loss"] + 0.02, scores  # never worse
    assert focus["recall_acc"] > window["recall_acc"] + 0.1, scores
    assert window["value_loss"] > 1.2  # the twin cannot beat the prior over 4 values (1.39)
    for name in ("focus", "window_only"):  # each run's validation wrote its recall scores
        valid = [r for r in read_metrics(tmp_path / name) if r.get("split") == "valid"]
        assert valid[-1]["recall_loss"] == pytest.approx(scores[name]["recall_loss"])
