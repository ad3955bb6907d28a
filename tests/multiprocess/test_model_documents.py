"""The whole model on packed documents: a packed sequence equals each document run alone."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from tests.multiprocess.workers_model import LLAMA

pytestmark = pytest.mark.multiprocess
WORKER = "tests.multiprocess.workers_documents:packed_and_alone"
LENGTHS = [9, 1, 3, 19]  # shorter than the window, a single token, longer than the window
FOCUS = dict(window=4, num_groups=4, sinks=1)
GPT2 = dict(LLAMA, family="gpt2", num_query_groups=None)


@pytest.fixture(scope="module")
def runs():
    cases = {
        "focus": (LLAMA, FOCUS, LENGTHS, True),
        "focus_top2_sinkhorn": (
            LLAMA, dict(FOCUS, top_k=2, balance="sinkhorn"), LENGTHS, True
        ),
        "dense": (LLAMA, dict(enabled=False), LENGTHS, True),
        "focus_no_reset": (LLAMA, FOCUS, LENGTHS, False),
        "gpt2": (GPT2, FOCUS, LENGTHS, True),
        "gpt2_no_reset": (GPT2, FOCUS, LENGTHS, False),
    }  # fmt: skip
    results = run_workers(WORKER, 1, list(cases.values()))[0]
    return dict(zip(cases, results, strict=True))


@pytest.mark.parametrize("case", ["focus", "focus_top2_sinkhorn", "dense", "gpt2"])
def test_packed_documents_equal_each_document_alone(runs, case):
    """Per-token losses (training: soft gate; eval: hard top-k) and every gradient, the
    routers' included, of a packed sequence equal those of its documents run one by one."""
    run = runs[case]
    for mode in ("train", "eval"):
        torch.testing.assert_close(run[mode]["packed"], run[mode]["alone"], rtol=1e-5, atol=1e-5)
    packed, alone = run["grads"]
    assert set(packed) == set(alone)
    if case != "dense":
        assert any(".router." in name for name in packed)
    for name, grad in alone.items():
        torch.testing.assert_close(packed[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_position_reset_off_continues_the_positions(runs):
    """Without the position reset the positions run on across documents. RoPE is relative, so
    inside a document that only changes the rounding of its angles (the Llama model still
    equals the documents alone to fp32 tolerance); learned absolute positions (GPT-2) make
    every later document a different input."""
    llama = runs["focus_no_reset"]["train"]
    torch.testing.assert_close(llama["packed"], llama["alone"], rtol=1e-4, atol=1e-4)
    gpt2 = runs["gpt2_no_reset"]["train"]
    first = LENGTHS[0]
    torch.testing.assert_close(gpt2["packed"][:, :first], gpt2["alone"][:, :first])
    assert (gpt2["packed"][:, first:] - gpt2["alone"][:, first:]).abs().max() > 1e-2
