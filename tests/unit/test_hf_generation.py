"""The shipped HF modeling code as a user drives it: padded batches, batched and beam-search
generation, reused prompt caches, prompt-lookup decoding and the sparse decode step.

Tiny random Focus models are built in-process from the shipped classes (every weight perturbed,
a window small enough that the groups decide most pairs). "Alone" means each sequence run by
itself, unpadded; "full recomputation" means ``use_cache=False``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from focus_pretrain.convert.hf_export import load_modeling, shipped_classes
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs

pytestmark = pytest.mark.hf  # also run against other transformers (tools/hf_compat.py)

modeling = load_modeling()
VOCAB = 50


def register_local_modeling() -> None:
    """Make this checkout's shipped modeling code the one behind the ``"focus"`` attention.

    transformers keeps one global ``"focus"`` entry; loading an export with
    ``trust_remote_code`` (other tests do) registers that copy's functions, and models built
    from :data:`modeling` would then run the copy's code (so a test patching :data:`modeling`
    would patch nothing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("focus", modeling.focus_attention_forward)
    AttentionMaskInterface.register("focus", modeling.focus_mask)


@pytest.fixture(autouse=True)
def local_modeling():
    register_local_modeling()
    yield
    register_local_modeling()  # after a test that loaded an export's copy


# a sliding-window layer (no router) next to a Focus layer, soft-caps, per-head QK-norm, GQA 4:1
FAMILY_EXTRAS = {
    "Gemma2": {"head_dim": 8, "sliding_window": 4, "attn_logit_softcapping": 5.0},
    "Gemma3": {
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "Qwen3": {"head_dim": 12, "num_key_value_heads": 1},
}


def focus_model(family: str = "Llama", **focus) -> torch.nn.Module:
    settings = {"num_groups": 4, "window": 3, "top_k": 1, "inference_backend": "auto", **focus}
    config_cls, model_cls = shipped_classes(family.lower())
    if family == "GPT2":
        config = config_cls(
            focus=settings, n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=256
        )
    else:
        arch = dict(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=512,
        )
        config = config_cls(focus=settings, **{**arch, **FAMILY_EXTRAS.get(family, {})})
    config.pad_token_id = config.bos_token_id = config.eos_token_id = 0
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.generation_config.pad_token_id = 0
    return model


def padded(seqs: list[torch.Tensor], side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [b, T], attention_mask [b, T])`` with pad id 0 on ``side``."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


def sequences(*lengths: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


def greedy(model, ids, n, **kwargs) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)


@pytest.mark.parametrize("family", ["Llama", "GPT2", "Gemma2", "Gemma3", "Qwen3"])
@pytest.mark.parametrize("mode,top_k", [("hard", 1), ("hard", 2), ("soft", 1), ("soft", 2)])
@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_padded_batches_give_each_sequence_its_own_logits(family, mode, top_k, backend):
    model = focus_model(family, inference_mode=mode, top_k=top_k, inference_backend=backend)
    seqs = sequences(7, 20, 13, 1)
    with torch.no_grad():
        alone = [model(s[None]).logits[0] for s in seqs]
        for side in ("left", "right"):
            ids, mask = padded(seqs, side)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)  # GPT-2's learned positions need them
            logits = model(ids, attention_mask=mask, position_ids=positions).logits
            assert torch.isfinite(logits).all()
            for i in range(len(seqs)):
                real = logits[i][mask[i].bool()]
                torch.testing.assert_close(real, alone[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "focus", [dict(inference_mode="hard", top_k=1), dict(inference_mode="hard", top_k=2),
              dict(inference_mode="soft", top_k=1), dict(window_only=True)],
    ids=["hard1", "hard2", "soft", "window_only"],
)  # fmt: skip
@pytest.mark.parametrize("sinks", [1, 5])  # 5: more sinks than the window (3)
def test_sinks_are_the_first_real_tokens_of_each_row(focus, sinks):
    """Attention sinks (Gemma-2: a sliding-window layer, without sinks, and a Focus or
    window-only layer with them): a padded row (either side) gives its sequence's logits alone,
    so the sinks are each row's first real tokens; the package's backends and the dense path
    agree; the sinks change the logits."""
    logits = {}
    for backend in ("auto", "dense"):
        model = focus_model("Gemma2", sinks=sinks, inference_backend=backend, **focus)
        seqs = sequences(7, 20, 13, 1, seed=sinks)
        with torch.no_grad():
            alone = [model(s[None]).logits[0] for s in seqs]
            for side in ("left", "right"):
                ids, mask = padded(seqs, side)
                out = model(ids, attention_mask=mask).logits
                for i in range(len(seqs)):
                    torch.testing.assert_close(out[i][mask[i].bool()], alone[i], rtol=1e-5,
                                               atol=1e-5)  # fmt: skip
        logits[backend] = torch.cat(alone)
    torch.testing.assert_close(logits["auto"], logits["dense"], rtol=1e-5, atol=1e-5)
    model.config.focus["sinks"] = 0
    with torch.no_grad():
        plain = torch.cat([model(s[None]).logits[0] for s in seqs])
    assert (plain - logits["dense"]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "family,top_k,sinks",
    [("Llama", 1, 0), ("Llama", 2, 0), ("Gemma2", 1, 0), ("Qwen3", 2, 0), ("Llama", 2, 2),
     ("Gemma2", 1, 6)],
)  # fmt: skip
def test_batched_left_padded_generate_equals_one_by_one(family, top_k, sinks):
    model = focus_model(family, top_k=top_k, window=4, sinks=sinks)
    seqs = sequences(5, 17, 11, seed=1)
    ids, mask = padded(seqs, "left")
    with torch.no_grad():
        batched = greedy(model, ids, 30, attention_mask=mask)[:, ids.shape[1] :]
        for i, s in enumerate(seqs):
            one = greedy(model, s[None], 30)[0, len(s) :]
            assert batched[i].tolist() == one.tolist()
            assert one.tolist() == greedy(model, s[None], 30, use_cache=False)[0, len(s) :].tolist()


@pytest.mark.parametrize("top_k", [1, 2])
def test_beam_search_with_the_cache_equals_without(top_k):
    model = focus_model(top_k=top_k, window=4)
    (prompt,) = sequences(17, seed=2)
    kwargs = dict(num_beams=4, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached = greedy(model, prompt[None], 12, **kwargs)
        recomputed = greedy(model, prompt[None], 12, use_cache=False, **kwargs)
    assert cached.sequences.tolist() == recomputed.sequences.tolist()
    torch.testing.assert_close(cached.sequences_scores, recomputed.sequences_scores)


def test_a_copied_prompt_cache_is_reused_twice_and_prompt_lookup_decodes():
    model = focus_model(window=4)
    (prompt,) = sequences(17, seed=3)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[None], **cache_kwargs(model, cache))
        for suffix in ([3, 4], [5, 6, 7]):
            full = torch.cat([prompt, torch.tensor(suffix)])[None]
            reused = greedy(model, full, 10, **cache_kwargs(model, copy.deepcopy(cache)))
            assert reused.tolist() == greedy(model, full, 10).tolist()
        repeated = prompt.repeat(3)[None]  # prompt lookup finds candidates in a repeated prompt
        lookup = greedy(model, repeated, 20, prompt_lookup_num_tokens=3)
        assert lookup.tolist() == greedy(model, repeated, 20).tolist()


@pytest.mark.parametrize(
    "sinks,key_groups", [(0, "own"), (2, "own"), (12, "own"), (2, "own_and_previous")]
)  # 12: longer than the shorter prompt (9)
def test_sparse_decode_reads_exactly_the_kept_keys(sinks, key_groups):
    """Each one-token step reads the window plus the keys sharing a group plus the row's first
    ``sinks`` real tokens, each once, nothing else; with ``key_groups="own_and_previous"`` a
    key shares the groups of the real token before it too."""
    model = focus_model(top_k=2, window=3, num_groups=4, sinks=sinks, key_groups=key_groups)
    seqs = sequences(9, 30, seed=4)
    ids, mask = padded(seqs, "left")
    steps = 25
    with torch.no_grad():
        out = greedy(model, ids, steps, attention_mask=mask)
        full_mask = torch.cat([mask, torch.ones(2, steps, dtype=torch.long)], dim=1)
        cache = DynamicCache(config=model.config)
        model(out, attention_mask=full_mask, **cache_kwargs(model, cache))  # one recomputed prefill
    for layer_idx, attn in enumerate(model.model.layers):
        own = cache.layers[layer_idx].focus_members  # [b, n]
        valid = full_mask.bool()
        keys = own.clone()  # the groups each key counts in
        if key_groups == "own_and_previous":
            keys[:, 1:] |= torch.where(valid[:, :-1], own[:, :-1], 0)
        sink = valid & (valid.cumsum(dim=1) <= sinks)  # [b, n]: each row's first real tokens
        expected = 0
        for p in range(ids.shape[1], out.shape[1] - 1):  # query positions of the one-token steps
            distance = p - torch.arange(p + 1)
            shares = (keys[:, : p + 1] & own[:, p : p + 1]) != 0  # [b, p + 1]
            kept = valid[:, : p + 1] & ((distance <= 3) | shares | sink[:, : p + 1])
            expected += int(kept.sum())
        assert attn.self_attn.focus_keys_read == expected
        assert expected < (steps - 1) * 2 * out.shape[1] * 0.8  # a real saving on these lengths


@pytest.mark.parametrize(
    "top_k, sinks, gate_form", [(1, 0, "sigmoid"), (1, 3, "sigmoid"), (2, 5, "sigmoid"),
                                (2, 2, "dot")],
)  # fmt: skip
def test_sparse_decode_equals_the_dense_step_and_the_standalone_path(
    monkeypatch, top_k, sinks, gate_form
):
    model = focus_model(top_k=top_k, window=2, num_groups=4, sinks=sinks, gate_form=gate_form)
    (prompt,) = sequences(40, seed=5)
    with torch.no_grad():
        sparse = greedy(model, prompt[None], 40, output_logits=True, return_dict_in_generate=True)
        model.config.focus["inference_backend"] = "dense"
        dense = greedy(model, prompt[None], 40, output_logits=True, return_dict_in_generate=True)
        monkeypatch.setattr(modeling, "_package_focus_attention", None)  # no focus_pretrain
        model.config.focus["inference_backend"] = "auto"
        alone = greedy(model, prompt[None], 40, output_logits=True, return_dict_in_generate=True)
    assert sparse.sequences.tolist() == dense.sequences.tolist() == alone.sequences.tolist()
    for a, b, c in zip(sparse.logits, dense.logits, alone.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_switching_the_attention_implementation_is_refused():
    model = focus_model()
    with pytest.raises(ValueError, match="without its routers"):
        model.set_attn_implementation("sdpa")
    model.set_attn_implementation("focus")  # staying is fine
    assert model.config._attn_implementation == "focus"


def test_a_static_cache_generates_like_the_dynamic_one():
    """A static cache is supported (``focus_static.py``; tests/unit/test_hf_static_decode.py)."""
    model = focus_model()
    prompt = sequences(6)[0][None]
    with torch.no_grad():
        static = greedy(model, prompt, 3, cache_implementation="static")
        dynamic = greedy(model, prompt, 3)
    assert torch.equal(static, dynamic)


def assert_every_path_agrees(
    monkeypatch, family, seqs, sides, changed, paths=("auto", "dense", "standalone"), **focus
) -> None:
    """The package's backend (``auto``; or one named in ``paths``), the dense path and the
    standalone path (no focus_pretrain) give each row of ``seqs``, padded on each of
    ``sides``, its own logits, alike; the same model with the ``changed`` focus settings gives
    other logits."""
    logits = {}
    for path in paths:
        backend = "auto" if path == "standalone" else path
        model = focus_model(family, inference_backend=backend, **focus)
        with monkeypatch.context() as patch:
            if path == "standalone":
                patch.setattr(modeling, "_package_focus_attention", None)
            with torch.no_grad():
                alone = [model(s[None]).logits[0] for s in seqs]
                for side in sides:
                    ids, mask = padded(seqs, side)
                    out = model(ids, attention_mask=mask).logits
                    for i in range(len(seqs)):
                        real = out[i][mask[i].bool()]
                        torch.testing.assert_close(real, alone[i], rtol=1e-5, atol=1e-5)
        logits[path] = torch.cat(alone)
    for path in paths:
        torch.testing.assert_close(logits[path], logits["dense"], rtol=1e-5, atol=1e-5, msg=path)
    model.config.focus.update(changed)
    with torch.no_grad():
        other = torch.cat([model(s[None]).logits[0] for s in seqs])
    assert (other - logits["dense"]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["Llama", "Gemma2"])  # Gemma-2: the term before soft-capping
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_the_dot_gate_form_runs_alike_on_every_path(monkeypatch, family, mode):
    """``gate_form: dot`` (lambda g_i . g_j on every allowed pair): every path gives each
    left-padded row its own logits, alike; the form changes the logits."""
    seqs = sequences(7, 20, 13, seed=6)
    assert_every_path_agrees(
        monkeypatch, family, seqs, ["left"], {"gate_form": "sigmoid"},
        inference_mode=mode, gate_form="dot", sinks=1,
    )  # fmt: skip


KEYS_PREVIOUS = {"key_groups": "own_and_previous"}


@pytest.mark.parametrize("family", ["Llama", "Gemma2"])  # Gemma-2: sliding layers, soft-caps
@pytest.mark.parametrize("mode,top_k", [("hard", 1), ("hard", 2), ("soft", 1)])
def test_a_key_in_its_predecessors_groups_runs_alike_on_every_path(
    monkeypatch, family, mode, top_k
):
    """``key_groups: own_and_previous`` (a key also counts in the groups of the token before
    it): every path (the package's flex too) gives each left- and right-padded row its own
    logits, alike; the rule changes them."""
    seqs = sequences(7, 20, 13, 1, seed=7)
    assert_every_path_agrees(
        monkeypatch, family, seqs, ["left", "right"], {"key_groups": "own"},
        ("auto", "flex", "dense", "standalone"), inference_mode=mode, top_k=top_k, sinks=1,
        **KEYS_PREVIOUS,
    )  # fmt: skip


@pytest.mark.parametrize("top_k,sinks", [(1, 0), (2, 2)])
def test_a_key_in_its_predecessors_groups_generates_alike_with_every_cache(top_k, sinks):
    """``key_groups: own_and_previous``: a left-padded batch generates the tokens and logits
    of each prompt alone, with the sparse decode step, the dense step, a static cache and
    no cache at all."""
    model = focus_model(top_k=top_k, window=3, sinks=sinks, **KEYS_PREVIOUS)
    seqs = sequences(5, 17, 11, seed=8)
    ids, mask = padded(seqs, "left")
    kwargs = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    runs = {}
    with torch.no_grad():
        runs["sparse"] = greedy(model, ids, 24, **kwargs)
        runs["static"] = greedy(model, ids, 24, cache_implementation="static", **kwargs)
        runs["recomputed"] = greedy(model, ids, 24, use_cache=False, **kwargs)
        model.config.focus["inference_backend"] = "dense"
        runs["dense"] = greedy(model, ids, 24, **kwargs)
        model.config.focus["inference_backend"] = "auto"
        for i, s in enumerate(seqs):
            one = greedy(model, s[None], 24)[0, len(s) :]
            assert runs["sparse"].sequences[i, ids.shape[1] :].tolist() == one.tolist()
    for name, run in runs.items():
        assert run.sequences.tolist() == runs["sparse"].sequences.tolist(), name
        for a, b in zip(run.logits, runs["sparse"].logits, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
