"""The Focus GPTModel for every attention family, on CPU through the shim, in real processes."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.multiprocess
ROOT = pathlib.Path(__file__).parents[2]
WORKERS = "tests.multiprocess.workers_model"
SMALL = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=128
)
FAMILIES = {
    "gpt2": dict(SMALL, family="gpt2"),
    "llama": dict(SMALL, family="llama", num_query_groups=2),
    "qwen2": dict(SMALL, family="qwen2", num_query_groups=2),
    "olmo2": dict(SMALL, family="olmo2", norm_epsilon=1e-6),
    "gemma2": dict(
        SMALL,
        family="gemma2",
        num_query_groups=2,
        head_dim=24,
        sliding_window=6,
        attn_softcap=5.0,
        final_softcap=3.0,
        query_pre_attn_scalar=20.0,
    ),
    "qwen3": dict(SMALL, family="qwen3", num_query_groups=2, head_dim=24),
    "gemma3": dict(  # layers 1, 2 local (own RoPE base), 3 global (llama3-scaled RoPE)
        SMALL,
        family="gemma3",
        num_layers=3,
        num_query_groups=2,
        head_dim=24,
        sliding_window=6,
        sliding_window_pattern=3,
        local_rotary_base=10000.0,
        rotary_base=1e6,
        rope_scaling=dict(
            type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        query_pre_attn_scalar=20.0,
    ),
}
FOCUS = dict(window=4, num_groups=4)


@pytest.fixture(scope="module")
def family_runs():
    cases = [(kwargs, FOCUS) for kwargs in FAMILIES.values()]
    return dict(zip(FAMILIES, run_workers(f"{WORKERS}:forward_backward", 1, cases)[0], strict=True))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_and_routes(family_runs, family):
    run = family_runs[family]
    assert torch.isfinite(run["loss"]) and torch.isfinite(run["logits"]).all()
    assert abs(run["loss"].item() - math.log(128)) < 1.0  # near uniform at initialisation
    routers = {n: g for n, g in run["grads"].items() if ".router." in n}
    global_layers = 1 if family.startswith("gemma") else 2  # gemma: local layers, no router
    assert len(routers) == 2 * global_layers
    assert all(g.abs().sum() > 0 for g in routers.values())
    assert all(torch.isfinite(g).all() for g in run["grads"].values())


def test_family_structure(family_runs):
    shapes = {f: r["shapes"] for f, r in family_runs.items()}
    qkv_bias = "decoder.layers.0.self_attention.linear_qkv.bias"
    proj_bias = "decoder.layers.0.self_attention.linear_proj.bias"
    # gpt2: learned positions, biases everywhere, tied output
    assert "embedding.position_embeddings.weight" in shapes["gpt2"]
    assert qkv_bias in shapes["gpt2"] and proj_bias in shapes["gpt2"]
    assert "output_layer.weight" not in shapes["gpt2"]
    assert shapes["gpt2"]["decoder.layers.0.mlp.linear_fc1.weight"] == (96, 64)  # not gated
    # llama: no biases, SwiGLU, GQA, untied
    assert qkv_bias not in shapes["llama"] and "output_layer.weight" in shapes["llama"]
    assert shapes["llama"]["decoder.layers.0.mlp.linear_fc1.weight"] == (192, 64)
    assert shapes["llama"]["decoder.layers.0.self_attention.linear_qkv.weight"] == (
        (4 + 2 * 2) * 16,
        64,
    )
    # qwen2: QKV bias only
    assert qkv_bias in shapes["qwen2"] and proj_bias not in shapes["qwen2"]
    # olmo2: full-width q/k norms, norms after attention and MLP, none before
    olmo = shapes["olmo2"]
    assert olmo["decoder.layers.0.self_attention.q_layernorm.weight"] == (64,)
    assert olmo["decoder.layers.0.self_attention.post_norm.weight"] == (64,)
    assert olmo["decoder.layers.0.mlp.post_norm.weight"] == (64,)
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in olmo)
    # gemma2: head_dim 24 (not 64 / 4), sandwich norms, local layer 1 without a router
    gemma = shapes["gemma2"]
    assert gemma["decoder.layers.0.self_attention.linear_qkv.weight"] == ((4 + 4) * 24, 64)
    assert "decoder.layers.0.input_layernorm.weight" in gemma
    assert "decoder.layers.0.mlp.post_norm.weight" in gemma
    assert not any(n.startswith("decoder.layers.0.self_attention.router") for n in gemma)
    assert any(n.startswith("decoder.layers.1.self_attention.router") for n in gemma)
    # qwen3, gemma3: per-head q/k norms of head_dim 24 (one weight for all heads)
    for family in ("qwen3", "gemma3"):
        for which in "qk":
            assert shapes[family][f"decoder.layers.0.self_attention.{which}_layernorm.weight"] == (
                24,
            )
    assert qkv_bias not in shapes["qwen3"]
    gemma3 = [n for n in shapes["gemma3"] if ".router." in n]
    assert gemma3 and all(n.startswith("decoder.layers.2.") for n in gemma3)  # pattern 3


def test_gemma2_final_logits_are_soft_capped(family_runs):
    logits = family_runs["gemma2"]["logits"]
    assert logits.abs().max() <= 3.0 and logits.abs().max() > 0.5


@pytest.mark.parametrize("family", ["llama", "gpt2", "olmo2", "qwen3"])
def test_tensor_parallel_2_equals_1(family):
    """Real TP=2 under gloo: logits, loss and every gradient (router included) equal TP=1."""
    case = [(FAMILIES[family], FOCUS)]
    (one,) = run_workers(f"{WORKERS}:forward_backward", 1, case)[0]
    two = run_workers(f"{WORKERS}:forward_backward", 2, case)
    for rank_result in two:
        (result,) = rank_result
        torch.testing.assert_close(result["loss"], one["loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result["logits"], one["logits"], rtol=1e-4, atol=1e-5)
        assert set(result["grads"]) == set(one["grads"])
        for name, grad in one["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_whole_model_is_causal(family):
    """Default (causal) routing: changing tokens after i leaves logits at <= i unchanged."""
    (out,) = run_workers(f"{WORKERS}:causality", 1, FAMILIES[family], 25)
    for mode, (before, after) in out.items():
        assert before == 0.0, (mode, before)
        assert after > 1e-3, (mode, after)  # the change does reach later positions


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_disabled_focus_equals_hand_written_causal_attention(family):
    (out,) = run_workers(f"{WORKERS}:layer_against_manual_attention", 1, FAMILIES[family])
    hidden, qkv, proj = out["hidden"], out["qkv"], out["proj"]
    s, b, _ = hidden.shape
    heads, groups, d = 4, 2, 16
    mixed = hidden @ qkv.T  # [s, b, groups * (heads/groups + 2) * d]
    if out["qkv_bias"] is not None:
        mixed = mixed + out["qkv_bias"]
    mixed = mixed.view(s, b, groups, heads // groups + 2, d)  # per KV group: [q..., k, v]
    q = mixed[:, :, :, : heads // groups].reshape(s, b, heads, d)
    k, v = mixed[:, :, :, -2], mixed[:, :, :, -1]  # [s, b, groups, d]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.outer(torch.arange(s).float(), inv_freq)  # [s, d/2]
    cos = torch.cat([angles, angles], -1).cos()[:, None, None]  # [s, 1, 1, d]
    sin = torch.cat([angles, angles], -1).sin()[:, None, None]

    def rotate(x):  # HF rotate_half convention
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    q, k = rotate(q), rotate(k)
    k = k.repeat_interleave(heads // groups, dim=2)  # [s, b, heads, d]
    v = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)  # [b, heads, s, s]
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    context = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, heads * d)
    torch.testing.assert_close(out["got"], context @ proj.T, rtol=1e-5, atol=1e-5)


def test_parameter_counts_on_meta_device():
    paths = [str(ROOT / "configs" / "7b.yaml"), str(ROOT / "configs" / "gpt2-124m-retrofit.yaml")]
    mistral, gpt2 = run_workers(f"{WORKERS}:parameter_counts", 1, paths)[0]
    assert mistral["counts"]["without_router"] == 7_241_732_096
    assert mistral["counts"]["router"] == 32 * (4096 * 16 + 4 * 16)
    assert gpt2["counts"]["without_router"] == 124_439_808
    assert gpt2["counts"]["router"] == 148_224  # the paper's "148K"
    assert mistral["grown_kib"] < 2 * 1024**2  # far below 29 GB of fp32 weights: nothing real
