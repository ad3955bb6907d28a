"""Bad input fails early with a ValueError that names the argument and what was expected."""

from __future__ import annotations

import pytest
import torch

from focus_pretrain.focus import FocusConfig, FocusRouter, focus_attention
from tests.helpers import random_probs, random_qkv


@pytest.fixture
def inputs():
    q, k, v = random_qkv(2, 10, 4, 2, 8, seed=0, dtype=torch.float32)
    return q, k, v, random_probs(2, 10, 4, seed=1).float()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, p: (q[:, :, :, :4], k, v, p), r"k/v head_dim must equal q's head_dim"),
        (lambda q, k, v, p: (q, k[:, :9], v[:, :9], p), r"k/v seq must equal q's seq \(10\)"),
        (lambda q, k, v, p: (q, k[:1], v[:1], p), r"k/v batch must equal q's batch \(2\)"),
        (lambda q, k, v, p: (q, k, v[:, :, :1], p), r"k and v must have the same shape"),
        (lambda q, k, v, p: (q[0], k, v, p), r"q must be a 4-D tensor \[batch, seq, heads"),
        (lambda q, k, v, p: (q[:, :, :3], k, v, p), r"heads \(3\) must be divisible by heads_kv"),
        (lambda q, k, v, p: (q, k, v, p[:, :7]), r"routing.probs must be \[batch=2, seq=10, K\]"),
        (lambda q, k, v, p: (q, k.double(), v.double(), p), r"q, k, v must share a dtype"),
        (lambda q, k, v, p: (q, k, v, None), r"routing is required unless local_only=True"),
    ],
)
def test_shape_errors(inputs, change, message):
    q, k, v, p = change(*inputs)
    with pytest.raises(ValueError, match=message):
        focus_attention(q, k, v, p, window=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(window=-1), r"window must be >= 0, got -1"),
        (dict(window=2.5), r"window must be an integer"),
        (dict(mode="fuzzy"), r"mode must be one of 'soft', 'hard', 'hard_gated'; got 'fuzzy'"),
        (dict(mode="hard", top_k=5), r"top_k must be <= K \(number of groups\) \(4\), got 5"),
        (dict(mode="hard", top_k=0), r"top_k must be >= 1, got 0"),
        (dict(gate_lambda=0.0), r"gate_lambda must be > 0"),
        (dict(softcap=-1.0), r"softcap must be > 0"),
        (dict(sinks=-1), r"sinks must be >= 0, got -1"),
        (dict(sinks=1.5), r"sinks must be an integer, got 1.5"),
        (
            dict(backend="triton-magic"),
            r"backend must be 'auto' or one of \['decomposed', 'flex', 'reference', 'sdpa', "
            r"'segments', 'triton'\]",
        ),
    ],
)
def test_argument_errors(inputs, kwargs, message):
    q, k, v, p = inputs
    kwargs = {"window": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        focus_attention(q, k, v, p, **kwargs)


@pytest.mark.parametrize("where", ["q", "k", "v", "probs"])
def test_nan_inputs_are_rejected(inputs, where):
    q, k, v, p = (t.clone() for t in inputs)
    target = dict(q=q, k=k, v=v, probs=p)[where]
    target.view(-1)[7] = float("nan")
    name = "routing.probs" if where == "probs" else where
    with pytest.raises(ValueError, match=rf"{name} contains NaN or inf values"):
        focus_attention(q, k, v, p, window=2)
    out = focus_attention(q, k, v, p, window=2, check_finite=False)  # opt-out: no check
    assert out.shape == q.shape


# every (backend, mode) the CPU runs: soft for the reference and flex, hard top-1 for all three
BACKEND_MODES = [
    ("reference", "soft"),
    ("flex", "soft"),
    ("reference", "hard"),
    ("decomposed", "hard"),
    ("flex", "hard"),
]


@pytest.mark.parametrize("backend, mode", BACKEND_MODES)
def test_mixed_dtypes_are_a_value_error_for_every_backend(inputs, backend, mode):
    """q, k, v of different dtypes, routing more precise than the attention maths (fp64 with
    fp32: a bare RuntimeError deep in the soft reference, silently accepted elsewhere) and
    integer routing are refused up front, naming the tensors, their dtypes and the cast."""
    q, k, v, p = inputs
    kwargs = dict(window=2, mode=mode, backend=backend)
    with pytest.raises(
        ValueError,
        match=r"q, k, v must share a dtype, got q torch.float32, k torch.bfloat16, "
        r"v torch.float32; cast them to one \(e.g. k.to\(q.dtype\)",
    ):
        focus_attention(q, k.bfloat16(), v, p, **kwargs)
    with pytest.raises(
        ValueError,
        match=r"routing.probs is torch.float64 but q, k, v are torch.float32, whose Focus maths "
        r"runs in torch.float32: .* cast routing.probs to torch.float32 or q, k and v to "
        r"torch.float64",
    ):
        focus_attention(q, k, v, p.double(), **kwargs)
    with pytest.raises(ValueError, match=r"routing.probs must be floating point .* torch.int64"):
        focus_attention(q, k, v, p.argmax(-1, keepdim=True).expand_as(p), **kwargs)


@pytest.mark.parametrize("backend, mode", BACKEND_MODES)
def test_routing_up_to_the_attention_precision_is_accepted(inputs, backend, mode):
    """What the model passes under bf16 (fp32 routing, bf16 q/k/v), lower-precision routing,
    and fp32 routing with fp64 q/k/v all run; the output has q's dtype."""
    q, k, v, p = inputs
    for qkv, probs in (
        ((q.bfloat16(), k.bfloat16(), v.bfloat16()), p),
        ((q, k, v), p.bfloat16()),
        ((q.double(), k.double(), v.double()), p),
    ):
        out = focus_attention(*qkv, probs, window=2, mode=mode, backend=backend)
        assert out.dtype == qkv[0].dtype and torch.isfinite(out).all()


def test_ring_refuses_mixed_dtypes_before_communicating(inputs):
    from focus_pretrain.parallel.ring import ring_focus_attention

    q, k, v, p = inputs
    with pytest.raises(ValueError, match=r"routing.probs is torch.float64 but q, k, v are"):
        ring_focus_attention(q, k, v, p.double(), group=None, window=2)  # no group needed
    with pytest.raises(ValueError, match=r"q, k, v must share a dtype"):
        ring_focus_attention(q, k, v.double(), p, group=None, window=2)
    with pytest.raises(ValueError, match=r"sinks must be >= 0, got -3"):
        ring_focus_attention(q, k, v, p, group=None, window=2, sinks=-3)


def test_router_errors():
    with pytest.raises(ValueError, match=r"num_groups \(K\) must be >= 1, got 0"):
        FocusRouter(16, num_groups=0)
    with pytest.raises(ValueError, match=r"num_groups \(K\) must be <= 64, got 65"):
        FocusRouter(16, num_groups=65)
    with pytest.raises(ValueError, match=r"tau must be > 0, got -0.1"):
        FocusRouter(16, tau=-0.1)
    with pytest.raises(ValueError, match=r"balance must be one of 'causal', 'sinkhorn'"):
        FocusRouter(16, balance="softmax")
    router = FocusRouter(16, num_groups=4)
    with pytest.raises(ValueError, match=r"hidden must be \[batch, seq, hidden_size=16\]"):
        router(torch.randn(2, 5, 12))
    bad = torch.randn(2, 5, 16)
    bad[1, 3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"hidden \(router input\) contains NaN or inf"):
        router(bad)
    with pytest.raises(ValueError, match=r"top_k must be <= num_groups \(K\) \(4\), got 5"):
        router(torch.randn(1, 5, 16)).membership(5)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_groups", 0, r"focus.num_groups must be >= 1, got 0"),
        ("top_k", 9, r"focus.top_k must be <= num_groups \(8\), got 9"),
        ("window", -3, r"focus.window must be >= 0, got -3"),
        ("tau", 0.0, r"focus.tau must be > 0, got 0.0"),
        (
            "balance",
            "greedy",
            r"focus.balance must be one of 'causal', 'sinkhorn', 'none'; got 'greedy'",
        ),
        ("balance_rate", 2.0, r"focus.balance_rate must be in \(0, 1\], got 2.0"),
        ("group_dim", "16", r"focus.group_dim must be an integer, got '16'"),
        ("sinks", -2, r"focus.sinks must be >= 0, got -2"),
        ("sinks", True, r"focus.sinks must be an integer, got True"),
    ],
)
def test_config_errors_name_the_key(field, value, message):
    with pytest.raises(ValueError, match=message):
        FocusConfig(**{field: value})


def test_config_defaults_follow_the_paper():
    c = FocusConfig()
    assert (c.num_groups, c.group_dim, c.window, c.tau, c.sinkhorn_iters) == (8, 16, 128, 0.1, 10)
    assert c.balance == "causal" and c.top_k == 1


def test_defaults_yaml_loads_into_the_config():
    import pathlib

    import yaml

    from focus_pretrain.config import from_mapping

    path = pathlib.Path(__file__).parents[2] / "configs" / "focus-defaults.yaml"
    section = yaml.safe_load(path.read_text())["focus"]
    assert from_mapping(FocusConfig, section, "focus") == FocusConfig()
    with pytest.raises(ValueError, match=r"unknown key\(s\) focus.groups; allowed keys: enabled"):
        from_mapping(FocusConfig, {**section, "groups": 4}, "focus")


def test_a_vocabulary_too_large_for_the_corpus_names_the_key(tmp_path):
    """SentencePiece's refusal becomes an error naming ``data.vocab_size`` and the fix."""
    from focus_pretrain.data.tokenizer import train_tokenizer

    texts = ["a tiny corpus of a few words, repeated"] * 20
    with pytest.raises(ValueError, match=r"data\.vocab_size=3000 .* lower data\.vocab_size"):
        train_tokenizer(texts, tmp_path / "tok", 3000)


def test_the_ring_runs_the_backend_the_recipe_names():
    """``reference`` runs the reference's blockwise attention in the ring (on CUDA too: it ran
    FlexAttention there, a backend nobody asked for); names without a per-block form are
    refused."""
    from focus_pretrain.parallel.context_parallel import ring_block_kernel

    assert ring_block_kernel("reference") == "blockwise"
    assert ring_block_kernel("triton") == "triton"
    assert ring_block_kernel("flex") == "flex"
    assert ring_block_kernel("auto") == "auto"
    for other in ("decomposed", "segments", "sdpa", "fast"):
        with pytest.raises(ValueError, match=rf"backend '{other}' cannot run inside the ring"):
            ring_block_kernel(other)


def test_weights_and_biases_without_the_package_names_the_install(monkeypatch, tmp_path):
    """``train.wandb`` is refused before training when ``wandb`` cannot be imported (its
    import made to fail here), with the command that installs it; unset, nothing is needed."""
    import sys

    from focus_pretrain.config import load_config
    from focus_pretrain.errors import InputError
    from focus_pretrain.train.metrics import wandb_run

    config = load_config(None, ["train.wandb=offline"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(InputError, match=r"train.wandb=offline needs the wandb package: pip"):
        wandb_run(config, tmp_path)
    assert wandb_run(load_config(None), tmp_path) is None
    with pytest.raises(ValueError, match=r"train\.wandb"):
        load_config(None, ["train.wandb=sometimes"])
