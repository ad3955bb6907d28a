"""The Focus GPTModel (Llama family) on CPU: trains, routes, and equals dense where it must."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.multiprocess
WORKER = "tests.multiprocess.workers_model:forward_backward"
MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=128,
)


def run(model=None, **focus):
    return run_workers(WORKER, 1, {**MODEL, **(model or {})}, focus)[0]


def test_forward_backward_finite_and_router_gets_gradients():
    out = run(window=4, num_groups=4)
    assert torch.isfinite(out["loss"]) and torch.isfinite(out["logits"]).all()
    router = {n: g for n, g in out["grads"].items() if ".router." in n}
    assert len(router) == 2 * MODEL["num_layers"]  # proj.weight and centroids per layer
    assert all(g.abs().sum() > 0 for g in router.values())


def test_window_covering_sequence_equals_focus_disabled():
    """w >= s: nothing is beyond the window, so Focus is exactly the dense baseline."""
    focus = run(window=1000, num_groups=4)
    dense = run(enabled=False)
    torch.testing.assert_close(focus["loss"], dense["loss"], rtol=0, atol=0)
    torch.testing.assert_close(focus["logits"], dense["logits"], rtol=0, atol=0)
    shared = set(focus["grads"]) & set(dense["grads"])
    assert shared and all(".router." not in n for n in set(dense["grads"]))
    for name in shared:
        torch.testing.assert_close(focus["grads"][name], dense["grads"][name], rtol=0, atol=0)


def test_small_window_changes_the_model():
    assert not torch.allclose(run(window=2, num_groups=4)["logits"], run(enabled=False)["logits"])


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients(recompute):
    plain = run(window=4, num_groups=4)
    again = run(model=dict(recompute=recompute), window=4, num_groups=4)
    torch.testing.assert_close(again["loss"], plain["loss"])
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(again["grads"][name], grad, msg=name)
