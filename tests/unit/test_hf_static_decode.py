"""The shipped HF modeling code on transformers' static KV cache (``focus_static.py``).

With a ``StaticCache`` the Focus routing lives in preallocated buffers of the cache layer and a
step attends over the whole static length with the hard (or soft) pattern as a mask built on
the device: the same tokens as the dynamic cache's sparse decode, and a one-token step that
compiles whole (``torch.compile(fullgraph=True)``), gives the eager logits and reads nothing on
the host. Tiny random models and helpers come from ``test_hf_generation``.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import CompileConfig, StaticCache

from focus_pretrain.bench.dispatch import DispatchCounter
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs, returned_cache
from tests.unit.test_hf_generation import (  # noqa: F401 (local_modeling: an autouse fixture)
    focus_model,
    greedy,
    local_modeling,
    padded,
    sequences,
)

pytestmark = [pytest.mark.hf, pytest.mark.capture]

NEW = 12  # new tokens per generation
LENGTHS = (21, 34)  # two rows, left-padded by 13 and 0 (longer than the window)


def prompt_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [2, T], attention_mask [2, T])``: two left-padded prompts."""
    return padded(sequences(*LENGTHS, seed=seed), "left")


def step_kwargs(model, cache, mask: torch.Tensor, slots: torch.Tensor) -> dict:
    """Keywords of a forward writing cache ``slots [q]`` (``mask [b, L]``: the whole static
    length, future slots 1; positions as ``generate`` counts them: real tokens before)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, slots]  # [b, L] -> [b, q]
    kwargs = dict(attention_mask=mask, position_ids=positions, use_cache=True)
    if "cache_position" in inspect.signature(model.forward).parameters:  # before 5.24
        kwargs["cache_position"] = slots
    return {**kwargs, **cache_kwargs(model, cache)}


def static_prefill(model, ids, mask) -> tuple[StaticCache, torch.Tensor, torch.Tensor]:
    """``(cache, last logits [b, V], full mask [b, L])`` after an eager prefill into a new
    ``StaticCache`` of ``T + NEW`` slots."""
    b, length = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=length + NEW)
    full = torch.cat([mask, torch.ones(b, NEW, dtype=mask.dtype)], dim=1)  # [b, L]
    kwargs = step_kwargs(model, cache, mask, torch.arange(length))
    return cache, model(ids, **kwargs).logits[:, -1], full


def decode_loop(model, ids, mask, step) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy ``(tokens [b, NEW], logits per step)``: an eager prefill, then ``step(token
    [b, 1], full mask, slot [1], cache) -> logits [b, V]`` per new token."""
    cache, logits, full = static_prefill(model, ids, mask)
    tokens, steps = [logits.argmax(-1)], [logits]
    for i in range(NEW - 1):
        slot = torch.tensor([ids.shape[1] + i])
        logits = step(tokens[-1][:, None], full, slot, cache)
        tokens.append(logits.argmax(-1))
        steps.append(logits)
    return torch.stack(tokens, dim=1), steps


def make_step(model):
    """The one-token decode step on a static cache: ``(token, mask, slot, cache) -> logits``."""

    def step(token, mask, slot, cache):
        return model(token, **step_kwargs(model, cache, mask, slot)).logits[:, -1]

    return step


def fresh_dynamo() -> None:
    """Forget compiled code and dynamo's counters (graphs, breaks) of earlier tests."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


CASES = {
    "hard-top1": dict(top_k=1, sinks=0),
    "hard-top2-sinks": dict(top_k=2, sinks=3),
    "soft-top2-sinks": dict(top_k=2, sinks=2, inference_mode="soft"),
    "window-only-sinks": dict(window_only=True, sinks=2),
    "qwen3-top2": dict(family="Qwen3", top_k=2, sinks=1),
    "gpt2-top1-sinks": dict(family="GPT2", top_k=1, sinks=4),
    "dot-hard-top2-sinks": dict(top_k=2, sinks=2, gate_form="dot"),
    "dot-soft": dict(top_k=1, inference_mode="soft", gate_form="dot"),
    "keys-previous-hard-top1-sinks": dict(top_k=1, sinks=2, key_groups="own_and_previous"),
    "keys-previous-soft": dict(top_k=1, inference_mode="soft", key_groups="own_and_previous"),
}


@pytest.mark.parametrize("case", CASES)
def test_static_generate_equals_the_dynamic_cache(case):
    settings = dict(CASES[case])
    model = focus_model(settings.pop("family", "Llama"), window=4, **settings)
    ids, mask = prompt_batch()
    kwargs = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = greedy(model, ids, NEW, **kwargs)
        static = greedy(model, ids, NEW, cache_implementation="static", **kwargs)
    assert static.sequences.tolist() == dynamic.sequences.tolist()
    for a, b in zip(static.logits, dynamic.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    layers = returned_cache(static).layers
    assert all(type(layer).__name__ == "FocusStaticLayer" for layer in layers)  # adopted
    layers = [layer for layer in layers if layer.focus_valid is not None]  # routed layers
    if not settings.get("window_only"):  # their routing lives on the cache
        assert len(layers) == 2
        padding, written = ids.shape[1] - LENGTHS[0], ids.shape[1] + NEW - 1
        for row, first_real in enumerate((padding, 0)):  # the positions of the real tokens
            valid, origin = layers[0].focus_valid[row], layers[0].focus_origin[row]
            assert sorted(origin[valid].tolist()) == list(range(first_real, written))


@pytest.mark.parametrize(
    "family,key_groups", [("Llama", "own"), ("GPT2", "own"), ("Llama", "own_and_previous")]
)  # GPT-2: a query viewed from c_attn
def test_the_decode_step_compiles_whole_and_gives_the_eager_tokens(family, key_groups):
    model = focus_model(family, top_k=2, window=4, sinks=3, key_groups=key_groups)
    ids, mask = prompt_batch()
    fresh_dynamo()
    with torch.no_grad():
        expected = greedy(model, ids, NEW, attention_mask=mask)[:, ids.shape[1] :]  # dynamic
        eager, eager_logits = decode_loop(model, ids, mask, make_step(model))
        compiled_step = torch.compile(make_step(model), fullgraph=True, dynamic=False)
        compiled, compiled_logits = decode_loop(model, ids, mask, compiled_step)
    assert eager.tolist() == expected.tolist()
    assert compiled.tolist() == eager.tolist()
    for a, b in zip(compiled_logits, eager_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1  # one graph for all steps: no break, no recompilation


def test_generate_with_a_compiled_forward_gives_the_eager_tokens():
    """``generate``'s own compilation of the decode step (static cache), here on the CPU."""
    model = focus_model(top_k=2, window=4, sinks=3)
    ids, mask = prompt_batch(seed=2)
    compile_config = CompileConfig(fullgraph=True, dynamic=False)
    compile_config._compile_all_devices = True  # generate compiles on accelerators only
    fresh_dynamo()
    with torch.no_grad():
        eager = greedy(model, ids, NEW, attention_mask=mask, cache_implementation="static")
        compiled = greedy(
            model,
            ids,
            NEW,
            attention_mask=mask,
            cache_implementation="static",
            compile_config=compile_config,
        )
    assert compiled.tolist() == eager.tolist()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # it did compile
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("mode", ["hard", "soft"])
@pytest.mark.parametrize("key_groups", ["own", "own_and_previous"])
def test_the_static_decode_step_reads_nothing_on_the_host(mode, key_groups):
    model = focus_model(top_k=2, window=4, sinks=3, inference_mode=mode, key_groups=key_groups)
    ids, mask = prompt_batch()
    with torch.no_grad():
        cache, logits, full = static_prefill(model, ids, mask)
        kwargs = step_kwargs(model, cache, full, torch.tensor([ids.shape[1]]))
        with DispatchCounter() as counter:
            model(logits.argmax(-1)[:, None], **kwargs)
    assert counter.host_syncs == 0, counter.sync_ops
    assert counter.launches > 0


def test_a_reset_static_cache_generates_the_same_tokens_again():
    model = focus_model(top_k=2, window=4, sinks=2)
    ids, mask = prompt_batch(seed=3)
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + NEW)
    with torch.no_grad():
        first = greedy(model, ids, NEW, attention_mask=mask, **cache_kwargs(model, cache))
        cache.reset()
        again = greedy(model, ids, NEW, attention_mask=mask, **cache_kwargs(model, cache))
        dynamic = greedy(model, ids, NEW, attention_mask=mask)
    assert first.tolist() == again.tolist() == dynamic.tolist()


def test_static_beam_search_equals_the_dynamic_cache():
    """Beam search reorders the static cache's keys and, with them, their routing."""
    model = focus_model(top_k=2, window=4, sinks=2)
    (prompt,) = sequences(17, seed=2)
    kwargs = dict(num_beams=3, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = greedy(model, prompt[None], 10, **kwargs)
        static = greedy(model, prompt[None], 10, cache_implementation="static", **kwargs)
    assert static.sequences.tolist() == dynamic.sequences.tolist()
    torch.testing.assert_close(static.sequences_scores, dynamic.sequences_scores)


def test_a_sliding_static_cache_is_refused_with_the_fix():
    model = focus_model("Gemma2", top_k=1, window=4)
    with pytest.raises(ValueError, match="not a sliding one"), torch.no_grad():
        greedy(model, sequences(6)[0][None], 3, cache_implementation="static")
