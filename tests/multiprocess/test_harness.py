"""The multi-process harness fails a hung run in bounded time and says where each rank was (the
ZeRO-Offload layout's hang cost CI 2 x 30 min with no stack)."""

from __future__ import annotations

import pytest

from tests.distributed import run_workers


@pytest.mark.multiprocess
def test_a_hung_run_is_killed_with_every_ranks_stack():
    with pytest.raises(TimeoutError, match="did not finish in 20 s") as error:
        run_workers("tests.multiprocess.workers_harness:wait_forever", 2, timeout=20)
    message = str(error.value)
    for rank in (0, 1):
        stack = message.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "in wait_forever" in stack, message
