"""HuggingFace import: tiny random HF models of every family give our model the HF logits
(``test_against_hf_*``), at TP=1 and, for a GQA family, TP=2 (real gloo processes).

Variants covered besides the families' defaults: Llama-3 RoPE scaling that changes frequencies
inside the tested length, with tied embeddings (``llama3``); Qwen3's per-head QK-norm with one KV
head and ``head_dim != hidden / heads``; Gemma-3's 2 local : 1 global layers, per-head
``(1 + w)`` QK-norm, local RoPE base and linear RoPE scaling on its global layers. Every model is
handled by one worker process per test kind (``*_runs`` fixtures), not one per family."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

from tests.distributed import run_workers

pytestmark = [pytest.mark.multiprocess, pytest.mark.hf]
WORKER = "tests.multiprocess.test_hf_import:our_logits"
SEQ = 24
COMMON = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=128,
    max_position_embeddings=64,
)
HF_CONFIGS = {
    "gpt2": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)),
    "llama": ("LlamaConfig", dict(COMMON, rope_theta=500000.0)),
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=None)),
    "qwen2": ("Qwen2Config", COMMON),
    "olmo2": ("Olmo2Config", COMMON),
    "gemma2": (
        "Gemma2Config",
        dict(
            COMMON,
            head_dim=32,  # != hidden / heads, as in Gemma-2
            sliding_window=8,  # < SEQ: the local layer's window matters
            attn_logit_softcapping=2.0,  # small caps so that they bind
            final_logit_softcapping=3.0,
            query_pre_attn_scalar=24,
        ),
    ),
    "llama3": (  # Llama-3.x RoPE scaling: wavelengths > 16 / 1 divided by 4, those in [4, 16]
        "LlamaConfig",  # smoothed; i.e. every frequency of head_dim 16 changes within SEQ = 24
        dict(
            COMMON,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "qwen3": ("Qwen3Config", dict(COMMON, num_key_value_heads=1, head_dim=24)),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            COMMON,
            num_hidden_layers=4,  # local, local, global, local
            layer_types=["sliding_attention"] * 2 + ["full_attention", "sliding_attention"],
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0,  # ignored by transformers' Gemma-3: the import must too
            final_logit_softcapping=3.0,  # applied
            rope_parameters=dict(
                sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
            ),
        ),
    ),
}


def make_hf_model(model_type: str, root: pathlib.Path, shard_size: str | None = None):
    """A tiny random HF model (every weight perturbed, norms included) saved under ``root``."""
    import transformers

    class_name, kwargs = HF_CONFIGS[model_type]
    config = getattr(transformers, class_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    path = root / model_type
    extra = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **extra)
    return model, path


def tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _init_parallel(world_size: int) -> None:
    from megatron.core import parallel_state

    from focus_pretrain.parallel import apply_cpu_shim

    apply_cpu_shim()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world_size)


def _each(worker, rank: int, world_size: int, hf_dirs: list[str], focus: dict) -> list:
    """``worker`` on every checkpoint in one process; a failure is returned as its message,
    so that only that family's test fails."""
    results = []
    for hf_dir in hf_dirs:
        try:
            results.append(worker(rank, world_size, hf_dir, focus))
        except Exception as error:  # reported by the family's own test
            results.append(f"{type(error).__name__}: {error}")
    return results


def our_logits_each(rank: int, world_size: int, hf_dirs: list[str], focus: dict) -> list:
    """:func:`our_logits` for every checkpoint (one process)."""
    return _each(our_logits, rank, world_size, hf_dirs, focus)


def our_logits(rank: int, world_size: int, hf_dir: str, focus: dict) -> torch.Tensor:
    """Build our model from the HF checkpoint at TP=world_size; full-vocabulary logits."""
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        model_parallel_cuda_manual_seed,
    )

    from focus_pretrain.convert import hf_model_config, load_hf_weights
    from focus_pretrain.focus import FocusConfig
    from focus_pretrain.model import build_model

    _init_parallel(world_size)
    model_parallel_cuda_manual_seed(0)
    config = hf_model_config(hf_dir, focus=FocusConfig(**focus))
    model = build_model(config).eval()
    load_hf_weights(model, hf_dir, config)
    x = tokens()
    with torch.no_grad():
        logits = model(x, torch.arange(SEQ)[None].expand_as(x), None)  # [b, s, v / tp]
        return gather_from_tensor_model_parallel_region(logits).clone()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    made = {name: make_hf_model(name, root) for name in HF_CONFIGS}
    sharded = make_hf_model("qwen2", tmp_path_factory.mktemp("sharded"), shard_size="40KB")
    return {**made, "qwen2-sharded": sharded}


def hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens()).logits


def _runs(worker: str, hf_models: dict, focus: dict) -> dict:
    """``worker`` over every model of ``hf_models`` in one process: name -> result."""
    names = list(hf_models)
    paths = [str(hf_models[name][1]) for name in names]
    (results,) = run_workers(worker, 1, paths, focus)
    return dict(zip(names, results, strict=True))


def _ok(result):
    assert not isinstance(result, str), result  # the worker's error for this family
    return result


@pytest.fixture(scope="module")
def disabled_runs(hf_models):
    return _runs(f"{WORKER}_each", hf_models, dict(enabled=False))


@pytest.mark.parametrize("model_type", [*HF_CONFIGS, "qwen2-sharded"])
def test_against_hf_focus_disabled(hf_models, disabled_runs, model_type):
    model, path = hf_models[model_type]
    if model_type.endswith("sharded"):
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # really sharded
    ours = _ok(disabled_runs[model_type])
    torch.testing.assert_close(ours, hf_logits(model), rtol=1e-5, atol=1e-5)


COVERING = ["llama", "gemma2", "gemma3"]


@pytest.fixture(scope="module")
def covering_runs(hf_models):
    models = {name: hf_models[name] for name in COVERING}
    return _runs(f"{WORKER}_each", models, dict(window=SEQ, num_groups=4))


@pytest.mark.parametrize("model_type", COVERING)
def test_against_hf_focus_window_covering_sequence(hf_models, covering_runs, model_type):
    """Focus on (routers fresh), window >= sequence: still exactly the HF model, in both the
    training (soft) and inference (hard) patterns."""
    model, _ = hf_models[model_type]
    torch.testing.assert_close(
        _ok(covering_runs[model_type]), hf_logits(model), rtol=1e-5, atol=1e-5
    )


def test_against_hf_tensor_parallel_2(hf_models):
    """A GQA family at TP=2: each rank loads its shards; gathered logits equal HF's."""
    model, path = hf_models["qwen2"]
    results = run_workers(WORKER, 2, str(path), dict(enabled=False))
    for ours in results:
        torch.testing.assert_close(ours, hf_logits(model), rtol=1e-5, atol=1e-5)


def focus_on_each(rank: int, world_size: int, hf_dirs: list[str], focus: dict) -> list:
    """:func:`focus_on` for every checkpoint (one process)."""
    return _each(focus_on, rank, world_size, hf_dirs, focus)


def focus_on(rank: int, world_size: int, hf_dir: str, focus: dict) -> dict:
    """Our model from the HF checkpoint with Focus on (fresh routers, small window): soft and
    hard logits, and every tensor in HF names (routers included) for the HF side."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from focus_pretrain.convert import hf_model_config, load_hf_weights
    from focus_pretrain.convert.hf_export import hf_state_dict
    from focus_pretrain.focus import FocusConfig
    from focus_pretrain.model import build_model

    _init_parallel(world_size)
    model_parallel_cuda_manual_seed(0)
    config = hf_model_config(hf_dir, focus=FocusConfig(**focus))
    model = build_model(config)
    load_hf_weights(model, hf_dir, config)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("balance_offsets"):
                buffer.normal_(0.0, 0.5)  # exported offsets must be used too
    x = tokens()
    positions = torch.arange(SEQ)[None].expand_as(x)
    out = {"hf_tensors": hf_state_dict([model.state_dict()], config)}
    with torch.no_grad():
        model.train()
        out["soft"] = model(x, positions, None).clone()
        model.eval()
        out["hard"] = model(x, positions, None).clone()
    return out


SHIPPED_FOCUS = dict(window=3, num_groups=4, top_k=1)


@pytest.fixture(scope="module")
def focus_on_runs(hf_models):
    models = {name: hf_models[name] for name in HF_CONFIGS}
    return _runs("tests.multiprocess.test_hf_import:focus_on_each", models, SHIPPED_FOCUS)


@pytest.mark.parametrize("model_type", list(HF_CONFIGS))
def test_shipped_hf_modeling_matches_ours_with_focus_on(
    hf_models, focus_on_runs, model_type, tmp_path
):
    """The modeling code an export ships (family HF class + routers + "focus" attention) gives
    our logits with Focus on, in the hard and soft patterns, for every family."""
    _check_shipped_modeling(hf_models[model_type], focus_on_runs[model_type], model_type,
                            SHIPPED_FOCUS, tmp_path)  # fmt: skip


SINKS = ["llama", "gemma2", "gemma3"]  # Gemma: sliding-window layers (no sinks) + Focus layers
SINKS_FOCUS = dict(SHIPPED_FOCUS, sinks=5)  # more sinks than the window


@pytest.fixture(scope="module")
def sinks_runs(hf_models):
    models = {name: hf_models[name] for name in SINKS}
    return _runs("tests.multiprocess.test_hf_import:focus_on_each", models, SINKS_FOCUS)


@pytest.mark.parametrize("model_type", SINKS)
def test_shipped_hf_modeling_matches_ours_with_sinks(
    hf_models, focus_on_runs, sinks_runs, model_type, tmp_path
):
    """Attention sinks: the shipped modeling code (sinks in the adapter's focus settings)
    gives our logits in both patterns and through each backend, and they differ from those
    without sinks."""
    hard = _check_shipped_modeling(hf_models[model_type], sinks_runs[model_type], model_type,
                                   SINKS_FOCUS, tmp_path)  # fmt: skip
    assert (hard - _ok(focus_on_runs[model_type])["hard"]).abs().max() > 1e-3


KEYS = ["llama", "gemma3"]  # Gemma-3: sliding-window layers (no rule) + Focus layers
KEYS_FOCUS = dict(SHIPPED_FOCUS, key_groups="own_and_previous")


@pytest.fixture(scope="module")
def keys_runs(hf_models):
    models = {name: hf_models[name] for name in KEYS}
    return _runs("tests.multiprocess.test_hf_import:focus_on_each", models, KEYS_FOCUS)


@pytest.mark.parametrize("model_type", KEYS)
def test_shipped_hf_modeling_matches_ours_with_keys_in_their_predecessors_groups(
    hf_models, focus_on_runs, keys_runs, model_type, tmp_path
):
    """``key_groups: own_and_previous``: the shipped modeling code gives our logits in both
    patterns, through its dense path and the package's reference, and the rule changes them."""
    hard = _check_shipped_modeling(hf_models[model_type], keys_runs[model_type], model_type,
                                   KEYS_FOCUS, tmp_path)  # fmt: skip
    assert (hard - _ok(focus_on_runs[model_type])["hard"]).abs().max() > 1e-3


def _check_shipped_modeling(hf_model, ours, model_type: str, focus: dict, tmp_path):
    """``ours`` (our model's logits and tensors) against the HF model with the routers
    attached as an adapter; returns the HF hard logits."""
    from safetensors.torch import save_file

    from focus_pretrain.convert import attach_focus_adapter

    original, path = hf_model
    model = copy.deepcopy(original)  # the fixture's models stay plain HF models
    ours = _ok(ours)
    routers = {k: v for k, v in ours["hf_tensors"].items() if ".router." in k}
    assert routers
    save_file(routers, str(tmp_path / "focus_adapter.safetensors"))
    hf_type = json.loads((path / "config.json").read_text())["model_type"]  # gemma3_text
    meta = {"model_type": hf_type, "focus": focus}
    (tmp_path / "focus_adapter.json").write_text(json.dumps(meta))
    attach_focus_adapter(model, tmp_path)
    assert not torch.allclose(ours["soft"], ours["hard"])
    with torch.no_grad():
        hard = model(tokens()).logits
        model.config.focus["inference_mode"] = "soft"
        soft = model(tokens()).logits
    torch.testing.assert_close(hard, ours["hard"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(soft, ours["soft"], rtol=1e-5, atol=1e-5)
    # the shipped dense path and each of our backends behind it give the same hard logits
    model.config.focus["inference_mode"] = "hard"
    backends = ["dense", "flex"] + ([] if model_type == "gemma2" else ["decomposed"])
    if focus.get("key_groups", "own") != "own":  # the backends that compute the rule
        backends = ["dense", "reference"]
    for backend in backends:  # gemma2's soft-capping needs flash-attn in `decomposed`
        model.config.focus["inference_backend"] = backend
        with torch.no_grad():
            logits = model(tokens()).logits
        torch.testing.assert_close(logits, ours["hard"], rtol=1e-5, atol=1e-5, msg=backend)
    return hard
