"""Focus inside the model: the dense twin, the window, activation recompute."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed import run_workers
from tests.multiprocess.test_model_families import FAMILIES
from tests.multiprocess.workers_model import LLAMA

pytestmark = pytest.mark.multiprocess
WORKER = "tests.multiprocess.workers_model:forward_backward"
GEMMA = dict(
    LLAMA, family="gemma2", head_dim=16, sliding_window=6, attn_softcap=5.0, final_softcap=3.0
)


@pytest.fixture(scope="module")
def runs():
    cases = {
        "wide": (LLAMA, dict(window=1000, num_groups=4)),
        "dense": (LLAMA, dict(enabled=False)),
        "narrow": (LLAMA, dict(window=2, num_groups=4)),
        "gemma_wide": (GEMMA, dict(window=1000, num_groups=4)),
        "gemma_dense": (GEMMA, dict(enabled=False)),
        "plain": (LLAMA, dict(window=4, num_groups=4)),
        "plain_decomposed": (LLAMA, dict(window=4, num_groups=4, inference_backend="decomposed")),
        "plain_flex": (LLAMA, dict(window=4, num_groups=4, inference_backend="flex")),
        "selective": (dict(LLAMA, recompute="selective"), dict(window=4, num_groups=4)),
        "full": (dict(LLAMA, recompute="full"), dict(window=4, num_groups=4)),
        "window_only_wide": (LLAMA, dict(window=1000, num_groups=4, window_only=True)),
        "plain_triton": (LLAMA, dict(window=4, num_groups=4, backend="triton")),
        "gemma_plain": (GEMMA, dict(window=4, num_groups=4)),
        "gemma_triton": (GEMMA, dict(window=4, num_groups=4, backend="triton")),
        "dense_triton": (LLAMA, dict(enabled=False, backend="triton")),
    }
    results = run_workers(WORKER, 1, list(cases.values()))[0]
    return dict(zip(cases, results, strict=True))


@pytest.mark.parametrize(
    "wide, dense",
    [("wide", "dense"), ("gemma_wide", "gemma_dense"), ("window_only_wide", "dense")],
)
def test_window_covering_sequence_equals_focus_disabled(runs, wide, dense):
    """w >= s: nothing is beyond the window, so Focus is exactly the dense twin (same weights:
    router initialisation does not disturb the model's random stream)."""
    focus, plain = runs[wide], runs[dense]
    torch.testing.assert_close(focus["loss"], plain["loss"], rtol=0, atol=0)
    torch.testing.assert_close(focus["logits"], plain["logits"], rtol=0, atol=0)
    assert not any(".router." in n for n in plain["grads"])
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(focus["grads"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("window_only", [True, False])
def test_receptive_field_of_the_window_only_twin(window_only):
    """The window-only twin (no router) sees nothing beyond ``layers x window`` positions back,
    in training and inference; Focus with the same window does (its groups reach further)."""
    (field,) = run_workers(
        "tests.multiprocess.workers_model:receptive_field",
        1,
        LLAMA,
        dict(window=4, num_groups=4, window_only=window_only),
    )
    for mode in ("train", "eval"):
        reach = [i for i, change in enumerate(field[mode]) if change > 0]
        assert reach[0] == 0 and 8 in reach  # token 0 reaches 2 layers x 4 positions
        if window_only:
            assert max(reach) == 8, (mode, reach)
        else:
            assert max(reach) > 8, (mode, reach)


def test_small_window_changes_the_model(runs):
    assert not torch.allclose(runs["narrow"]["logits"], runs["dense"]["logits"])


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_gives_the_same_gradients(runs, recompute):
    plain, again = runs["plain"], runs[recompute]
    torch.testing.assert_close(again["loss"], plain["loss"])
    assert set(again["grads"]) == set(plain["grads"])
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(again["grads"][name], grad, msg=name)


BF16_FAMILIES = {
    **FAMILIES,
    "mistral": dict(FAMILIES["llama"], family="mistral"),
    "llama-dropout": dict(LLAMA, hidden_dropout=0.1),
}


def test_bf16_models_train_and_infer_for_every_family():
    """``build_model(config, torch.bfloat16)`` for every family (GPT-2's learned position
    table included): finite training loss and gradients, bf16 eval logits (one process)."""
    (outs,) = run_workers(
        "tests.multiprocess.workers_model:bf16_train_step", 1, list(BF16_FAMILIES.values())
    )
    for name, out in zip(BF16_FAMILIES, outs, strict=True):
        assert torch.isfinite(out["loss"]), name
        assert out["logits"].dtype == torch.bfloat16 and torch.isfinite(out["logits"]).all()
        # Megatron's local norms keep fp32 weights; everything else (embeddings, GPT-2's
        # position table, every linear, the routers) is bf16
        fp32 = {n for n, d in out["dtypes"].items() if d != "torch.bfloat16"}
        assert all("norm" in n for n in fp32), (name, fp32)
        assert all(torch.isfinite(g).all() for g in out["grads"].values()), name
        router = {n: g for n, g in out["grads"].items() if ".router." in n}
        assert router and all(g.abs().sum() > 0 for g in router.values()), name


@pytest.mark.parametrize("backend", ["decomposed", "flex"])
def test_eval_through_each_inference_backend(runs, backend):
    """``focus.inference_backend`` reaches the model's eval path; logits equal the reference's."""
    plain, fast = runs["plain"], runs[f"plain_{backend}"]
    torch.testing.assert_close(fast["logits"], plain["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast["loss"], plain["loss"], rtol=0, atol=0)  # training: soft


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs Triton (make setup installs it)"
)
@pytest.mark.parametrize(
    "reference, fused", [("plain", "plain_triton"), ("gemma_plain", "gemma_triton"),
                         ("dense", "dense_triton")],
)  # fmt: skip
def test_training_through_the_triton_backend(runs, reference, fused):
    """``focus.backend: triton`` trains every layer on the fused kernels (Triton's interpreter
    on CPU): Focus layers, Gemma-2's soft-capped sliding-window layers and the dense twin give
    the reference's loss and gradients, routers included."""
    want, got = runs[reference], runs[fused]
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-5, msg=name)
    if reference != "dense":
        assert any(".router." in n and g.abs().sum() > 0 for n, g in got["grads"].items())


def test_backend_choice_reaches_the_model():
    """Training calls ``focus.backend``; eval calls ``focus.inference_backend`` (auto on CPU at
    this length: the reference); one call per layer each."""
    cases = [
        dict(window=4, num_groups=4),
        dict(window=4, num_groups=4, inference_backend="decomposed"),
        dict(window=4, num_groups=4, inference_backend="flex"),
    ]
    auto, decomposed, flex = run_workers(
        "tests.multiprocess.workers_model:backend_calls", 1, LLAMA, cases
    )[0]
    assert auto == {"soft:reference": 2, "hard:reference": 2}
    assert decomposed == {"soft:reference": 2, "hard:decomposed": 2}
    assert flex == {"soft:reference": 2, "hard:flex": 2}
