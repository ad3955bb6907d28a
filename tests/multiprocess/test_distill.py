"""Distillation from the frozen original (train.objective distill / mix): the vocabulary-parallel
KL and mix against a brute-force computation (one and two tensor-parallel ranks, values and
gradients), the dense bypass against the model built without Focus, and the objective of a
model's micro-batch against its logits recomputed by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_workers
from tests.multiprocess.test_model_focus import GEMMA
from tests.multiprocess.workers_distill import _random_logits
from tests.multiprocess.workers_model import LLAMA

pytestmark = pytest.mark.multiprocess

CASES = [  # vocabularies divisible by 2 (two tensor-parallel ranks)
    dict(objective="distill", vocab=96, seed=1),
    dict(objective="distill", vocab=50, seed=2, temperature=2.5),
    dict(objective="mix", vocab=64, seed=3, weight=0.3),
    dict(objective="mix", vocab=64, seed=4, weight=1.0, temperature=0.7),
    dict(objective="lm", vocab=32, seed=5),
    dict(objective="distill", vocab=64, seed=6, dtype=torch.bfloat16),
]


def brute_force_objective(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's per-token objective ``[b, s]`` and its gradient, by plain autograd over the
    whole vocabulary, token by token (float64)."""
    student, teacher, labels = _random_logits(2, 5, case["vocab"], case["seed"])
    student, teacher = student.double(), teacher.double()
    if case.get("dtype") is not None:  # the student the workers see, rounded
        student = student.to(case["dtype"]).double()
    student.requires_grad_(True)
    t, w = case.get("temperature", 1.0), case.get("weight", 0.5)
    rows = []
    for i in range(student.shape[0]):
        for j in range(student.shape[1]):
            p = F.softmax(teacher[i, j] / t, dim=-1)
            kl = (p * (p.log() - F.log_softmax(student[i, j] / t, dim=-1))).sum() * t * t
            ce = -F.log_softmax(student[i, j], dim=-1)[labels[i, j]]
            rows.append({"distill": kl, "lm": ce, "mix": (1 - w) * ce + w * kl}[case["objective"]])
    per_token = torch.stack(rows).view(student.shape[:2])
    upstream = torch.linspace(0.5, 1.5, per_token.numel(), dtype=torch.float64).view_as(per_token)
    (per_token * upstream).sum().backward()
    return per_token.detach(), student.grad


@pytest.mark.parametrize("world_size", [1, 2])
def test_vocab_parallel_objectives_match_brute_force(world_size):
    results = run_workers(
        "tests.multiprocess.workers_distill:sharded_objectives", world_size, CASES
    )
    for case, got in zip(CASES, results[0], strict=True):
        want, want_grad = brute_force_objective(case)
        tol = 2e-2 if case.get("dtype") == torch.bfloat16 else 1e-5
        assert want.abs().min() > 1e-3  # a real objective, not zeros
        got_values, got_grad = got["per_token"].double(), got["grad"].double()
        torch.testing.assert_close(got_values, want, rtol=tol, atol=tol, msg=str(case))
        torch.testing.assert_close(got_grad, want_grad, rtol=tol, atol=tol, msg=str(case))
    for rank in results[1:]:  # every rank holds the same per-token values
        for mine, theirs in zip(results[0], rank, strict=True):
            torch.testing.assert_close(mine["per_token"], theirs["per_token"], rtol=0, atol=0)


@pytest.mark.parametrize("model_kwargs", [LLAMA, GEMMA], ids=["llama", "gemma2"])
def test_dense_bypass_is_the_model_without_focus(model_kwargs):
    """Inside dense_attention() a Focus model computes exactly its dense twin (same weights:
    focus.enabled=false, same seed), no router runs; afterwards it is the Focus model again."""
    focus = dict(window=4, num_groups=4)
    cases = [(model_kwargs, focus), (model_kwargs, dict(enabled=False))]
    with_focus, dense = run_workers("tests.multiprocess.workers_distill:dense_bypass", 1, cases)[0]
    assert with_focus["routed_inside"] == 0
    torch.testing.assert_close(with_focus["dense"], dense["focus"], rtol=0, atol=0)
    torch.testing.assert_close(with_focus["after"], with_focus["focus"], rtol=0, atol=0)
    assert not torch.allclose(with_focus["focus"], dense["focus"])  # the window matters here


def test_micro_batch_objectives_of_a_model():
    """micro_batch_loss under distill and mix equals the KL / mix recomputed from the model's
    own teacher (Focus bypassed) and student logits, masked mean; a window covering the
    sequence makes the student the teacher (KL 0); the KL's gradient reaches the routers."""
    narrow, wide = dict(window=4, num_groups=4), dict(window=1000, num_groups=4)
    cases = [
        (narrow, dict(name="distill", temperature=1.5)),
        (narrow, dict(name="mix", weight=0.25)),
        (wide, dict(name="distill")),
    ]
    results = run_workers("tests.multiprocess.workers_distill:distill_losses", 1, LLAMA, cases)[0]
    for (_, objective), got in zip(cases, results, strict=True):
        t, w = objective.get("temperature", 1.0), objective.get("weight", 0.5)
        teacher, student = got["teacher"].double(), got["student"].double()
        p = F.softmax(teacher / t, dim=-1)
        kl = (p * (p.log() - F.log_softmax(student / t, dim=-1))).sum(-1) * t * t  # [b, s]
        ce = F.cross_entropy(student.transpose(1, 2), got["labels"], reduction="none")  # [b, s]
        per_token = kl if objective["name"] == "distill" else (1 - w) * ce + w * kl
        want = (per_token * got["mask"]).sum() / got["mask"].sum()
        torch.testing.assert_close(got["mean"].double(), want, rtol=1e-5, atol=1e-6)
    narrow_distill, _, wide_distill = results
    # a random tiny model's logits are close to uniform: its KLs are small, yet not zero
    assert float(narrow_distill["mean"]) > 1e-4 and narrow_distill["router_grad_norm"] > 0
    assert abs(float(wide_distill["mean"])) < 1e-7


def test_micro_batch_objectives_under_tensor_parallelism():
    """TP=2 (vocabulary-parallel logits, real gloo ranks) gives TP=1's distill and mix values
    and router gradients."""
    cases = [
        (dict(window=4, num_groups=4), dict(name="distill", temperature=2.0)),
        (dict(window=4, num_groups=4), dict(name="mix", weight=0.7)),
    ]
    worker = "tests.multiprocess.workers_distill:distill_losses"
    one = run_workers(worker, 1, LLAMA, cases)[0]
    for rank in run_workers(worker, 2, LLAMA, cases):
        for single, sharded in zip(one, rank, strict=True):
            # a KL near 6e-4 from logits equal to 1e-5: an absolute tolerance
            torch.testing.assert_close(sharded["mean"], single["mean"], rtol=0, atol=1e-6)
            assert sharded["router_grad_norm"] == pytest.approx(single["router_grad_norm"], 1e-2)
            torch.testing.assert_close(sharded["student"], single["student"], rtol=1e-4, atol=1e-5)


def test_attention_mass_objective_of_a_model():
    """micro_batch_loss under attention_mass is the mean over Focus layers, heads and unmasked
    tokens of the removed attention mass of each layer's own queries, keys and routing (soft
    gate, sparse training's pattern, sinks, packed documents, Gemma-2's soft-capping and
    router-less sliding layers); only the routers get gradients (the model runs dense and is
    not differentiated); a window covering the sequence removes nothing; TP=2 gives TP=1's
    value and router gradients."""
    narrow = dict(window=4, num_groups=4)
    cases = [
        (narrow, False),
        (dict(window=4, num_groups=8, sinks=2), True),
        (dict(window=3, num_groups=4, training_mode="hard", top_k=2), False),
        (dict(window=1000, num_groups=4), False),
    ]
    worker = "tests.multiprocess.workers_distill:attention_mass_by_hand"
    one = run_workers(worker, 1, LLAMA, cases)[0]
    gemma = run_workers(worker, 1, GEMMA, [(narrow, True)])[0]
    *measured, wide = one
    for got in [*measured, *gemma]:
        assert got["routed_layers"] >= 1 and float(got["mean"]) > 1e-3
        torch.testing.assert_close(got["mean"], got["by_hand"], rtol=1e-5, atol=1e-7)
        assert got["grad_names"] and all(".router." in name for name in got["grad_names"])
        assert sum(float(g.norm()) for g in got["router_grads"].values()) > 0
    assert gemma[0]["routed_layers"] < gemma[0]["layers"]  # its sliding layers: no router
    assert abs(float(wide["mean"])) < 1e-6
    for rank in run_workers(worker, 2, LLAMA, cases):
        for single, sharded in zip(one, rank, strict=True):
            torch.testing.assert_close(sharded["mean"], single["mean"], rtol=1e-5, atol=1e-7)
            assert sharded["router_grads"].keys() == single["router_grads"].keys()
            for name, grad in single["router_grads"].items():
                torch.testing.assert_close(sharded["router_grads"][name], grad, rtol=1e-4,
                                           atol=1e-7, msg=name)  # fmt: skip
