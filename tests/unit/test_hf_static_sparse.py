"""The static KV cache's block-sparse decode step (``focus_static_sparse.py``, shipped).

After an eager prefill every Focus layer's prompt slots are sorted by group; a compiled decode
step then runs FlexAttention on the blocks holding a kept key only. Checked here: the block mask
against a loop over the blocks, the block-sparse attention against the masked step (compiled,
with NaN in every block it must skip), the sort against the unsorted cache, and whole models:
compiled decoding over a prompt of several blocks gives the dynamic cache's tokens and logits
while the blocks it may skip hold NaN; a crop into the sorted prompt continues like the shorter
prompt. Tiny random models and helpers come from ``test_hf_generation``.
"""

from __future__ import annotations

import copy
import importlib
import itertools

import pytest
import torch
from transformers import StaticCache

from focus_pretrain.convert.hf_modeling import focus_static_sparse as sparse
from focus_pretrain.convert.hf_modeling.focus_cache import cache_kwargs
from focus_pretrain.convert.hf_modeling.focus_router import membership
from focus_pretrain.convert.hf_modeling.focus_rules import dot_gate
from focus_pretrain.convert.hf_modeling.focus_static import static_attention
from tests.unit.test_hf_generation import (  # noqa: F401 (local_modeling: an autouse fixture)
    focus_model,
    greedy,
    local_modeling,
    padded,
    sequences,
)
from tests.unit.test_hf_static_decode import fresh_dynamo, step_kwargs

pytestmark = [pytest.mark.hf, pytest.mark.capture, pytest.mark.torch]
BLOCK = sparse.KEY_BLOCK


def random_keep(b: int, q: int, length: int, seed: int) -> torch.Tensor:
    """``[b, q, L]`` kept pairs with blocks of every kind: empty, full, partial; the last row
    keeps nothing (a query with no key)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-length // BLOCK)
    kind = torch.randint(0, 3, (b, blocks), generator=gen)  # 0 empty, 1 full, 2 partial
    kind = kind.repeat_interleave(BLOCK, dim=1)[:, None, :length].expand(b, q, length)
    keep = (kind == 1) | ((kind == 2) & (torch.rand(b, q, length, generator=gen) < 0.3))
    keep[-1] = False
    return keep


def test_the_block_mask_lists_the_blocks_of_the_kept_pairs():
    keep = random_keep(3, 2, 1000, seed=0)  # 8 blocks, the last one partial in length
    mask = sparse.key_blocks(keep)
    blocks = -(-keep.shape[2] // BLOCK)
    for row in range(keep.shape[0]):
        partial, full = [], []
        for j in range(blocks):
            pairs = keep[row, :, j * BLOCK : (j + 1) * BLOCK]
            if pairs.all() and pairs.shape[1] == BLOCK:
                full.append(j)
            elif pairs.any():
                partial.append(j)
        for count, indices, want in (
            (mask.kv_num_blocks, mask.kv_indices, partial),
            (mask.full_kv_num_blocks, mask.full_kv_indices, full),
        ):
            n = int(count[row, 0, 0])
            assert sorted(indices[row, 0, 0, :n].tolist()) == want


def masked_reference(q, k, v, keep, softcap, dot):
    """The masked step (``focus_static.static_attention``) on the same pairs."""
    term = None if dot is None else dot_gate(dot[0], dot[1], dot[2])
    bias = torch.where(keep, 0.0, float("-inf"))
    return static_attention(q, k, v, bias, scale=0.3, softcap=softcap, term=term)


@pytest.mark.parametrize("q_len,softcap,dot", [(1, None, False), (3, 5.0, True)], ids=str)
def test_block_sparse_attention_equals_the_masked_step_and_skips_blocks(q_len, softcap, dot):
    gen = torch.Generator().manual_seed(q_len)
    b, heads, kv_heads, length, d, groups = 3, 4, 2, 1000, 16, 4
    q = torch.randn(b, heads, q_len, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, length, d, generator=gen) for _ in range(2))
    keep = random_keep(b, q_len, length, seed=q_len + 10)
    probs_q = torch.randn(b, q_len, groups, generator=gen).softmax(-1)
    probs_k = torch.randn(b, length, groups, generator=gen).softmax(-1)
    lam = 2.0 if dot else None
    want = masked_reference(q, k, v, keep, softcap, (probs_q, probs_k, lam) if dot else None)
    # every key of a block no pair of which is kept: NaN (read by mistake, it spreads)
    skipped = ~keep.any(dim=1)  # [b, L]
    padded = torch.nn.functional.pad(skipped, (0, -length % BLOCK), value=True)
    skipped = padded.view(b, -1, BLOCK).all(-1).repeat_interleave(BLOCK, 1)[:, :length]
    assert skipped[:-1].any() and (~skipped[:-1]).any()  # some blocks skipped, some not
    k_nan, v_nan = (t.masked_fill(skipped[:, None, :, None], float("nan")) for t in (k, v))

    def step(q, k, v, keep, probs_q, probs_k):
        return sparse.sparse_static_attention(
            q, k, v, keep, scale=0.3, softcap=softcap,
            probs_q=probs_q, probs_k=probs_k, dot_lambda=lam,
        )  # fmt: skip

    fresh_dynamo()
    got = torch.compile(step, fullgraph=True, dynamic=False)(
        q, k_nan, v_nan, keep, probs_q, probs_k
    )
    assert got.shape == (b, q_len, heads, d)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[-1].abs().max() == 0  # the row with no key: zeros


def long_prompts(lengths=(700, 610), seed=4) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts of several key blocks."""
    return padded(sequences(*lengths, seed=seed), "left")


def test_a_pattern_computed_inside_the_compiled_step_compiles():
    """A small elementwise ``keep`` built in the graph (a window-only twin's): inductor's CPU
    FlexAttention found no kernel for it before ``sparse_static_attention`` realized it."""
    gen = torch.Generator().manual_seed(7)
    b, heads, length, d = 2, 4, 700, 8
    q = torch.randn(b, heads, 1, d, generator=gen)
    k, v = (torch.randn(b, 2, length, d, generator=gen) for _ in range(2))
    valid = torch.rand(b, length, generator=gen) < 0.7

    def step(q, k, v, valid, slot):
        distance = slot - torch.arange(length)  # [L]
        keep = valid[:, None, :] & (distance >= 0) & (distance <= 20)  # [b, 1, L]
        return sparse.sparse_static_attention(q, k, v, keep, scale=0.3, softcap=None)

    fresh_dynamo()
    slot = torch.tensor([600])
    got = torch.compile(step, fullgraph=True, dynamic=False)(q, k, v, valid, slot)
    keep = valid[:, None, :] & ((slot - torch.arange(length)) >= 0)
    keep &= (slot - torch.arange(length)) <= 20
    torch.testing.assert_close(got, masked_reference(q, k, v, keep, None, None))


def prefilled(model, ids, mask, new: int):
    """``(cache, first token [b], full mask [b, L])`` after an eager prefill into a static
    cache of ``T + new`` slots."""
    b, length = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=length + new)
    full = torch.cat([mask, torch.ones(b, new, dtype=mask.dtype)], dim=1)  # [b, L]
    kwargs = step_kwargs(model, cache, mask, torch.arange(length))
    return cache, model(ids, **kwargs).logits[:, -1].argmax(-1), full


def test_the_prefill_sorts_each_layers_slots_by_group(monkeypatch):
    model = focus_model(num_groups=4, top_k=2, window=8, sinks=2)
    ids, mask = long_prompts()
    static = importlib.import_module("focus_hf_modeling.focus_static")  # the model's copy
    with torch.no_grad():
        cache, _, _ = prefilled(model, ids, mask, new=2)
        monkeypatch.setattr(static, "sort_by_groups", lambda *args: None)
        plain, _, _ = prefilled(model, ids, mask, new=2)  # the same prefill, not sorted
    n = ids.shape[1]
    for layer, unsorted in zip(cache.layers, plain.layers, strict=True):
        assert layer.focus_sorted == n and unsorted.focus_sorted == 0
        origin = layer.focus_origin[:, :n]
        assert (unsorted.focus_origin[:, :n] == torch.arange(n)).all()
        for row in range(ids.shape[0]):
            assert sorted(origin[row].tolist()) == list(range(n))  # a permutation
            real = layer.focus_valid[row, :n]
            members = layer.focus_members[row, :n][real]
            assert (members[1:] >= members[:-1]).all()  # grouped, padding last
            assert not real[real.sum() :].any()
            same = members[1:] == members[:-1]
            assert (origin[row, :n][real][1:][same] > origin[row, :n][real][:-1][same]).all()
        index = origin[:, None, :, None].expand_as(layer.keys[:, :, :n])  # [b, G, n, d]
        for mine, theirs in ((layer.keys, unsorted.keys), (layer.values, unsorted.values)):
            assert torch.equal(mine[:, :, :n], theirs[:, :, :n].gather(2, index))
        for mine, theirs in (
            (layer.focus_members, unsorted.focus_members),
            (layer.focus_sink, unsorted.focus_sink),
            (layer.focus_valid, unsorted.focus_valid),
        ):
            assert torch.equal(mine[:, :n], theirs[:, :n].gather(1, origin))


def test_unpadded_static_steps_of_several_tokens_get_no_quadratic_mask():
    """Before the attention, transformers builds a ``[b, 1, q, L]`` mask for a static cache's
    steps of several tokens (5.0: the prefill too; 5.24: the chunks after it); the ``"focus"``
    mask function leaves it out where it only says "causal, no padding" and keeps it for
    padded rows. The logits are the full forward's either way."""
    model = focus_model(num_groups=4, top_k=1, window=8, sinks=2)
    seen = []
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, a, kw: seen.append(kw.get("attention_mask")), with_kwargs=True
        )
        for layer in model.model.layers
    ]
    ids, mask = long_prompts()  # row 0: no padding; row 1: left-padded
    n = ids.shape[1]
    try:
        for rows, unpadded in ((slice(0, 1), True), (slice(0, 2), False)):
            cache = StaticCache(config=model.config, max_cache_len=n + 2)
            with torch.no_grad():
                want = model(ids[rows], attention_mask=mask[rows], use_cache=False).logits
                for start, end in ((0, 400), (400, n)):  # a prefill, then a chunk
                    kwargs = step_kwargs(model, cache, mask[rows, :end], torch.arange(start, end))
                    seen.clear()
                    got = model(ids[rows, start:end], **kwargs).logits
                    assert [m is None for m in seen] == [unpadded] * len(model.model.layers)
                    real = mask[rows, start:end].bool()
                    torch.testing.assert_close(
                        got[real], want[:, start:end][real], rtol=1e-4, atol=1e-4
                    )
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize(
    "rows,key_groups", [(None, "own"), (37, "own"), (None, "own_and_previous")]
)
def test_a_chunked_prefill_sorts_every_written_slot_and_stays_exact(monkeypatch, rows, key_groups):
    """Chunks after the first run over the cache (masked; ``rows``: in blocks of that many
    query rows, as a long chunk over a long cache) and re-sort every written slot (by the
    groups the keys count in: with ``own_and_previous`` a chunk's first key takes its
    predecessor's groups from the sorted slots)."""
    model = focus_model(num_groups=4, top_k=1, window=8, sinks=2, key_groups=key_groups)
    ids, mask = long_prompts()
    cuts = (0, 300, 560, ids.shape[1])
    length = ids.shape[1] + 2
    cache = StaticCache(config=model.config, max_cache_len=length)
    if rows is not None:
        static = importlib.import_module("focus_hf_modeling.focus_static")  # the model's copy
        heads = model.config.num_attention_heads
        monkeypatch.setattr(static, "MASKED_STEP_ELEMENTS", rows * ids.shape[0] * heads * length)
        blocks = []
        original = static._cached_step
        monkeypatch.setattr(
            static,
            "_cached_step",
            lambda *a, **k: blocks.append(a[1].shape[2]) or original(*a, **k),
        )
    with torch.no_grad():
        want = model(ids, attention_mask=mask, use_cache=False).logits  # [b, T, V]
        for start, end in itertools.pairwise(cuts):
            slots = torch.arange(start, end)
            kwargs = step_kwargs(model, cache, mask[:, :end], slots)  # the mask so far
            out = model(ids[:, start:end], **kwargs).logits
            real = mask[:, start:end].bool()
            torch.testing.assert_close(out[real], want[:, start:end][real], rtol=1e-4, atol=1e-4)
            for layer in cache.layers:
                assert layer.focus_sorted == end
                valid = layer.focus_valid[:, :end]
                keys = layer.keys_routing(key_groups)[1]  # [b, L]
                for row in range(ids.shape[0]):
                    members = keys[row, :end][valid[row]]
                    assert (members[1:] >= members[:-1]).all()
                    assert sorted(layer.focus_origin[row, :end].tolist()) == list(range(end))
    if rows is not None:  # two chunks after the prompt, each layer in blocks of 37 rows
        assert max(blocks) == rows and len(blocks) > 2 * len(model.model.layers)


def capture_routing(model) -> tuple[list, list]:
    """Forward hooks that record each router's output (the step's group probabilities)."""
    seen, hooks = [], []
    for layer in model.model.layers:
        if not hasattr(layer.self_attn, "router"):  # a window-only twin
            continue
        hooks.append(
            layer.self_attn.router.register_forward_hook(lambda m, a, out: seen.append(out))
        )
    return seen, hooks


def twin_keep(focus: dict, full: torch.Tensor, slot: int) -> torch.Tensor:
    """``[b, L]`` the keys a window-only twin's step at ``slot`` attends (cache order, the
    full mask ``[b, L]``): real, causal, in the window or among the row's first sinks."""
    valid = full.bool()
    distance = slot - torch.arange(full.shape[1])  # [L]
    sink = valid & (valid.long().cumsum(dim=1) <= focus["sinks"])
    return valid & (distance >= 0) & ((distance <= focus["window"]) | sink)


def poison_skippable_blocks(model, cache, probs_per_layer, slot: int, full) -> int:
    """NaN into the keys and values of every block the step at ``slot`` keeps no key of (per
    layer, from its routing ``probs [b, 1, K]``, or for a window-only twin, ``probs_per_layer``
    empty, from the full mask ``[b, L]``); returns how many blocks were poisoned."""
    focus, poisoned = model.config.focus, 0
    probs_per_layer = probs_per_layer or [None] * len(cache.layers)
    for layer, probs in zip(cache.layers, probs_per_layer, strict=True):
        if probs is None:
            keep = twin_keep(focus, full, slot)
        else:
            member = membership(probs, focus["top_k"])[:, 0]  # [b]
            origin, valid = layer.focus_origin, layer.focus_valid
            keys = layer.keys_routing(focus["key_groups"])[1]  # [b, L]: each key's groups
            distance = slot - origin
            keep = (
                valid
                & (distance >= 0)
                & (
                    (distance <= focus["window"])
                    | layer.focus_sink
                    | ((keys & member[:, None]) != 0)
                )
            )  # [b, L]
            keep |= origin == slot  # the step's own token (written by the step itself)
        length = keep.shape[1]
        blocks = torch.nn.functional.pad(keep, (0, -length % BLOCK)).view(keep.shape[0], -1, BLOCK)
        skip = (~blocks.any(-1)).repeat_interleave(BLOCK, 1)[:, :length]  # [b, L]
        poisoned += int((~blocks.any(-1)).sum())
        for buffer in (layer.keys, layer.values):
            buffer.masked_fill_(skip[:, None, :, None], float("nan"))
    return poisoned


def decode_poisoned(model, ids, mask, new: int, mode: str | None = None, tol: float = 1e-4):
    """Greedy decoding through one compiled step (``mode``: torch.compile's) on a static
    cache whose skippable blocks hold NaN at every step, each step checked against the eager
    masked step on a clean copy; returns ``(tokens [b, new], logits per step, blocks
    poisoned)``."""

    def step(token, mask, slot, cache):
        return model(token, **step_kwargs(model, cache, mask, slot)).logits[:, -1]

    fresh_dynamo()
    compiled = torch.compile(step, fullgraph=True, dynamic=False, mode=mode)
    with torch.no_grad():
        cache, token, full = prefilled(model, ids, mask, new)
        tokens, logits, poisoned = [token], [], 0
        for i in range(new - 1):
            slot = torch.tensor([ids.shape[1] + i], device=ids.device)
            eager_cache = copy.deepcopy(cache)
            seen, hooks = capture_routing(model)
            want = step(tokens[-1][:, None], full, slot, eager_cache)
            for hook in hooks:
                hook.remove()
            poisoned += poison_skippable_blocks(model, cache, seen, int(slot), full)
            got = compiled(tokens[-1][:, None], full, slot, cache).clone()
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
            tokens.append(got.argmax(-1))
            logits.append(got)
            for layer, clean in zip(cache.layers, eager_cache.layers, strict=True):
                layer.keys.copy_(clean.keys)  # the poison out again: the next step's
                layer.values.copy_(clean.values)  # blocks differ
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    return torch.stack(tokens, 1), logits, poisoned


def decoded_like_the_dynamic_cache(model, ids, mask, new: int) -> int:
    """:func:`decode_poisoned` checked against greedy decoding on the dynamic cache (logits
    and tokens); returns how many blocks held NaN."""
    kwargs = dict(attention_mask=mask, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = greedy(model, ids, new, **kwargs)
    tokens, logits, poisoned = decode_poisoned(model, ids, mask, new)
    for i, got in enumerate(logits):
        torch.testing.assert_close(got, dynamic.logits[i + 1], rtol=1e-4, atol=1e-4)
    assert tokens.tolist() == dynamic.sequences[:, ids.shape[1] :].tolist()
    return poisoned


@pytest.mark.slow
@pytest.mark.parametrize("key_groups", ["own", "own_and_previous"])
def test_compiled_sparse_decoding_equals_the_dynamic_cache_and_skips_blocks(key_groups):
    """Top-1 with sinks (top-2 decodes compiled in ``test_hf_static_decode`` too); with
    ``key_groups="own_and_previous"`` the slots are sorted by the keys' groups (their own and
    their predecessor's) and blocks are still skipped."""
    model = focus_model(num_groups=4, top_k=1, window=8, sinks=3, key_groups=key_groups)
    assert decoded_like_the_dynamic_cache(model, *long_prompts(), new=4) > 0  # NaN skipped


def test_a_window_only_twin_decodes_block_sparse_too():
    """The twin's compiled step visits the window's and the sinks' blocks only."""
    new = 4
    model = focus_model(window_only=True, window=8, sinks=3)
    ids, mask = long_prompts()
    poisoned = decoded_like_the_dynamic_cache(model, ids, mask, new)
    blocks = -(-(ids.shape[1] + new) // BLOCK)
    kept = 3  # at most: the sinks' block and the window's two
    assert poisoned >= (new - 1) * len(model.model.layers) * ids.shape[0] * (blocks - kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", [None, "reduce-overhead"], ids=["compiled", "cuda-graphs"])
def test_compiled_sparse_decoding_on_cuda(dtype, mode):
    """The block-sparse step compiled for CUDA (FlexAttention's decoding kernel), also
    replayed as a CUDA graph: the eager masked step's logits with NaN in the skipped blocks."""
    model = focus_model(num_groups=4, top_k=1, window=8, sinks=3).to("cuda", dtype)
    ids, mask = (t.cuda() for t in long_prompts())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    _, _, poisoned = decode_poisoned(model, ids, mask, 5, mode=mode, tol=tol)
    assert poisoned > 0


@pytest.mark.skipif(
    not hasattr(__import__("transformers").cache_utils.StaticLayer, "crop"),
    reason="this transformers release cannot crop a static cache",
)
def test_a_crop_into_the_sorted_prompt_continues_like_the_shorter_prompt():
    model = focus_model(num_groups=4, top_k=1, window=8, sinks=2)
    (prompt,) = sequences(400, seed=5)
    cut = 9
    with torch.no_grad():
        cache = StaticCache(config=model.config, max_cache_len=prompt.numel() + 4)
        model(prompt[None], use_cache=True, **cache_kwargs(model, cache))
        cache.crop(-cut)  # the last `cut` tokens (transformers 5.x: a negative count)
        assert all(layer.focus_sorted == 0 for layer in cache.layers)  # back in cache order
        next_ids = prompt[None, -cut : -cut + 3]
        out = model(next_ids, use_cache=True, **cache_kwargs(model, cache))
        want = model(prompt[None, : -cut + 3], use_cache=False).logits[:, -3:]
    torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-4)
