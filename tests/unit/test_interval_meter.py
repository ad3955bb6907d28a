"""Throughput intervals count training time only: evaluation and checkpointing inside an
interval are left out of tokens/s, TFLOP/s and MFU and reported on their own (a fake clock: no
timing in tests)."""

from __future__ import annotations

import pytest

from focus_pretrain.train.metrics import IntervalMeter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_evaluation_and_saving_are_left_out_of_throughput():
    clock = Clock()
    meter = IntervalMeter(6e9, 8, 128, devices=2, peak=10.0, clock=clock)
    for loss in (3.0, 2.0):
        clock.now += 1.5  # a training step
        meter.add(loss)
    with meter.excluded("eval"):
        clock.now += 7.0
    with meter.excluded("save"):
        clock.now += 2.0
    with meter.excluded("save"):
        clock.now += 1.0
    out = meter.scalars()
    assert out["loss"] == 2.5
    assert out["tokens_per_s"] == pytest.approx(2 * 8 * 128 / 3.0)  # 3 s of training
    assert out["tflops"] == pytest.approx(6e9 * 16 / 3.0 / 2 / 1e12)
    assert out["mfu"] == pytest.approx(out["tflops"] / 10.0)
    assert out["eval_s"] == 7.0 and out["save_s"] == 3.0
    clock.now += 2.0  # the next interval starts clean
    meter.add(1.0)
    nxt = meter.scalars()
    assert "eval_s" not in nxt and nxt["tokens_per_s"] == pytest.approx(8 * 128 / 2.0)


def test_a_skipped_step_counts_in_throughput_not_in_the_loss():
    clock = Clock()
    meter = IntervalMeter(6e9, 8, 128, devices=1, peak=None, clock=clock)
    for loss in (3.0, None, 1.0):
        clock.now += 1.0
        meter.add(loss)
    out = meter.scalars()
    assert out["loss"] == 2.0 and out["tokens_per_s"] == pytest.approx(3 * 8 * 128 / 3.0)
    clock.now += 1.0
    meter.add(None)
    assert meter.scalars()["loss"] is None  # an interval of bad steps only: no loss
