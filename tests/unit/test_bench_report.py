"""The helpers every benchmark shares (:mod:`focus_pretrain.bench.report`)."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.bench.report import markdown, median_ms


def test_markdown_renders_header_rule_and_rows():
    text = markdown(["seq", "name", "ms"], "rlr", [[1, "a", "0.50"], [2, "b", "-"]])
    assert text.splitlines() == [
        "| seq | name | ms |",
        "|---:|---|---:|",
        "| 1 | a | 0.50 |",
        "| 2 | b | - |",
    ]
    assert markdown(["x"], "l", []) == "| x |\n|---|"


@pytest.mark.parametrize("align", ["rl", "rlrr", "rxr"])
def test_markdown_refuses_an_alignment_that_does_not_fit(align):
    with pytest.raises(ValueError, match="align"):
        markdown(["a", "b", "c"], align, [])


def test_median_ms_warms_up_then_times_every_repeat():
    calls = []
    ms = median_ms(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5
    assert 0 <= ms < 1e3
