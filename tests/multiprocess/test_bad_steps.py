"""Every rank takes the same bad-step decision (one all-reduce), whichever rank saw the NaN or
inf, from the loss or from a gradient alone (tests/e2e/test_bad_steps.py runs the trainer)."""

from __future__ import annotations

import pytest

from tests.distributed import run_workers

pytestmark = pytest.mark.multiprocess


def test_ranks_agree_on_bad_steps_seen_by_one_rank():
    results = run_workers("tests.multiprocess.workers_bad_steps:decide_steps", 2)
    for result in results:
        assert result["bad"] == [False, True, True, False]
        assert result["consecutive"] == [(0, False), (1, False), (2, True), (0, False)]
        assert result["skipped"] == 2
