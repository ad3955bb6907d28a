"""``metrics.jsonl`` stays strict JSON: what tests, plots and other languages' parsers read."""

from __future__ import annotations

import json
import math

from focus_pretrain.train.metrics import MetricsLogger, read_metrics


def test_a_non_finite_value_is_written_as_null_and_none_is_left_out(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, enabled=True, tensorboard=False)
    logger.log(3, {"loss": math.nan, "grad_norm": math.inf, "lr": 1e-3, "skipped": None})
    logger.event("end", loss=-math.inf, step=3)
    logger.close()

    def strict(token: str):
        raise ValueError(f"not strict JSON: {token}")

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert records == read_metrics(tmp_path)
    train, end = records
    assert (train["loss"], train["grad_norm"], train["lr"]) == (None, None, 1e-3)
    assert "skipped" not in train and train["step"] == 3 and train["split"] == "train"
    assert end["event"] == "end" and end["loss"] is None
    assert "train step 3" in capsys.readouterr().out
