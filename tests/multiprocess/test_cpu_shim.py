"""megatron-core on CPU through the shim: tensor parallel is exact and the RNG tracker works."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.multiprocess
WORKER = "tests.multiprocess.workers_shim:tensor_parallel_linears_and_rng"


@pytest.fixture(scope="module")
def runs():
    return {1: run_workers(WORKER, 1), 2: run_workers(WORKER, 2)}


def test_tp2_linears_equal_tp1(runs):
    (one,), two = runs[1], runs[2]
    assert one["device"] == "cpu"
    torch.testing.assert_close(two[0]["col_weight"], one["col_weight"])  # same master weight
    for r in (0, 1):
        for key in ("y", "x_grad", "col_weight_grad", "row_weight_grad"):
            torch.testing.assert_close(two[r][key], one[key], rtol=1e-5, atol=1e-6, msg=key)


def test_rng_tracker_forks_per_tensor_parallel_rank(runs):
    (one,), (r0, r1) = runs[1], runs[2]
    # default stream: identical on the ranks of a TP group (hidden dropout must agree)
    assert torch.equal(r0["default_mask"], r1["default_mask"])
    assert torch.equal(r0["default_mask"], one["default_mask"])
    # model-parallel stream: seeded per TP rank, so it differs across ranks ...
    assert not torch.equal(r0["tp_mask"], r1["tp_mask"])
    assert torch.equal(r0["tp_mask"], one["tp_mask"])  # ... and rank 0 matches TP=1
    assert not torch.equal(r0["tp_mask"], r0["default_mask"])  # the fork really switched
    # forking does not consume the default stream
    assert torch.equal(r0["after_mask"], r1["after_mask"])
    assert torch.equal(r0["after_mask"], one["after_mask"])
    assert not torch.equal(r0["after_mask"], r0["default_mask"])
