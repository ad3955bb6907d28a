"""Megatron sequence parallelism (``parallel.sequence_parallel``) in real gloo processes: TP=2
with sequence parallelism equals TP=1, through plain autograd for every family and through
DeepSpeed ZeRO-1/2/3 with gradient accumulation; TP=2 x CP=2 (ring and all-to-all) equals TP=1;
without the gradient hooks the replicated parameters' gradients are wrong."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_workers
from tests.multiprocess.test_model_families import FAMILIES
from tests.multiprocess.workers_model import LLAMA

pytestmark = pytest.mark.multiprocess
WORKERS = "tests.multiprocess.workers_sequence_parallel"
FOCUS = dict(window=4, num_groups=4)
CASES = {  # name: (model, focus, run); see the workers' module docstring for the runs
    **{family: (kwargs, FOCUS, "plain") for family, kwargs in FAMILIES.items()},
    "llama-full-recompute": (dict(LLAMA, recompute="full"), FOCUS, "plain"),
    "llama-documents-sinkhorn": (LLAMA, dict(FOCUS, balance="sinkhorn"), "documents"),
    "llama-zero1": (LLAMA, FOCUS, "zero1"),
    "llama-zero2": (LLAMA, FOCUS, "zero2"),
    "llama-zero3": (LLAMA, FOCUS, "zero3"),
    "qwen3-zero2": (FAMILIES["qwen3"], FOCUS, "zero2"),
    "llama-zero2-unreduced": (LLAMA, FOCUS, "zero2-unreduced"),
}
CP_CASES = {  # name: (model, focus, cp_mode, sequence_parallel) at TP=2 x CP=2
    "ring": (LLAMA, FOCUS, "ring", True),
    "a2a-sinkhorn": (LLAMA, dict(FOCUS, balance="sinkhorn"), "a2a", True),
    "ring-without-sp": (LLAMA, FOCUS, "ring", False),
}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    """Both ranks' ``{"one": [TP=1 result per case], "sp": [TP=2 result per case]}``."""
    return run_workers(f"{WORKERS}:sp_against_tp1", 2, list(CASES.values()))


@pytest.fixture(scope="module")
def cp_runs() -> list[dict]:
    return run_workers(f"{WORKERS}:sp_cp_against_tp1", 4, list(CP_CASES.values()))


def _case(runs: list[dict], name: str) -> list[tuple[dict, dict]]:
    index = list(CASES).index(name)
    return [(rank["one"][index], rank["sp"][index]) for rank in runs]


def _assert_equal_grads(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", [n for n in CASES if not n.endswith("-unreduced")])
def test_sequence_parallel_tp2_equals_tp1(runs, name):
    """Loss, every gradient (routers, norms, biases included; under ZeRO read back from
    DeepSpeed's partitions after two accumulated micro-batches), the routers' balance
    statistics and load counts, and for plain runs the hard-mode eval logits."""
    for one, sp in _case(runs, name):
        torch.testing.assert_close(sp["losses"], one["losses"], rtol=1e-5, atol=1e-6)
        _assert_equal_grads(sp["grads"], one["grads"])
        assert any(".router." in n for n in one["grads"])
        for want, got in zip(one["routers"], sp["routers"], strict=True):
            assert torch.equal(got["load"], want["load"]) and want["load"].sum() > 0
            if want["target"] is not None:  # causal balance: Sinkhorn over the whole batch
                torch.testing.assert_close(got["target"], want["target"], rtol=1e-5, atol=1e-5)
        if "logits" in sp:  # plain runs
            torch.testing.assert_close(sp["logits"], one["logits"], rtol=1e-5, atol=1e-5)


def _sees_a_slice(name: str) -> bool:
    """Parameters used on the sequence-parallel region ``[s / tp, b, h]``."""
    module = name.rsplit(".", 2)[-2]
    slice_norms = ("input_layernorm", "pre_mlp_layernorm", "final_layernorm", "post_norm")
    return module in slice_norms or name.endswith(
        ("router.proj.weight", "linear_proj.bias", "linear_fc2.bias")
    )


def test_exactly_the_parameters_that_see_a_sequence_slice_are_tagged(runs):
    """Norms between the tensor-parallel regions (input, pre-MLP, post, final), row-parallel
    biases (GPT-2) and the routers' projections; not the Q/K norms nor the routers' centroids
    (they see the whole sequence), nor anything tensor-parallel."""
    for index, name in enumerate(CASES):
        one, sp = runs[0]["one"][index], runs[0]["sp"][index]
        assert set(sp["tagged"]) == {n for n in one["grads"] if _sees_a_slice(n)}, name
    gpt2 = set(runs[0]["sp"][list(CASES).index("gpt2")]["tagged"])
    assert {"decoder.final_layernorm.bias", "decoder.layers.0.mlp.linear_fc2.bias"} <= gpt2
    olmo2 = set(runs[0]["sp"][list(CASES).index("olmo2")]["tagged"])
    assert "decoder.layers.0.mlp.post_norm.weight" in olmo2


def test_without_the_hooks_replicated_gradients_are_wrong(runs):
    """The DeepSpeed trap: ZeRO-2 alone leaves each rank with its slice's share of the norms'
    and routers' projection gradients (the test above can fail); the rest is unaffected."""
    for one, sp in _case(runs, "llama-zero2-unreduced"):
        assert set(sp["grads"]) == set(one["grads"])
        for name, grad in one["grads"].items():
            close = torch.allclose(sp["grads"][name], grad, rtol=1e-4, atol=1e-6)
            assert close == (name not in sp["tagged"]), name


@pytest.mark.parametrize("name", list(CP_CASES))
def test_tp2_cp2_equals_tp1(cp_runs, name):
    """TP=2 x CP=2 with sequence parallelism (the layout of ``configs/7b-1m.yaml``), ring and
    all-to-all (Sinkhorn's column sums over the context-parallel group), and without it: the
    loss and every gradient of every rank equal TP=1."""
    index = list(CP_CASES).index(name)
    for rank in cp_runs:
        one, got = rank["one"][index], rank["tp_cp"][index]
        torch.testing.assert_close(got["loss"], one["loss"], rtol=1e-5, atol=1e-6)
        _assert_equal_grads(got["grads"], one["grads"])
