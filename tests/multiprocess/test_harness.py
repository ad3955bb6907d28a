"""The multi-process harness fails a hung run in bounded time and says where each rank was (the
ZeRO-Offload layout's hang cost CI 2 x 30 min with no stack)."""

from __future__ import annotations

import pytest

from tests.distributed import run_workers


@pytest.mark.multiprocess
def test_a_hung_run_is_killed_with_every_ranks_stack():
    """The deadline leaves the spawned ranks time to import torch and start their worker on a
    busy 2-core machine (20 s did not, once, in CI: no stack file yet; the error now says so)."""
    with pytest.raises(TimeoutError, match="did not finish in 60 s") as error:
        run_workers("tests.multiprocess.workers_harness:wait_forever", 2, timeout=60)
    message = str(error.value)
    for rank in (0, 1):
        stack = message.split(f"--- rank {rank} ---")[1].split("--- rank")[0]
        assert "in wait_forever" in stack, message


def test_a_rank_that_never_started_is_said_to_have_no_stack(tmp_path):
    from tests.distributed import _stacks

    assert "had not yet started" in _stacks(tmp_path / "stacks0.txt")
    (tmp_path / "stacks1.txt").write_text("File x, line 1 in wait_forever\n")
    assert _stacks(tmp_path / "stacks1.txt") == "File x, line 1 in wait_forever\n"
