"""Test helpers: an independent brute-force Focus attention and random-input factories."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from focus_pretrain.focus.pattern import document_starts
from focus_pretrain.focus.soft_triton import interpreter_on, triton_installed

ON_GPU = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not triton_installed() or not (ON_GPU or interpreter_on()),
    reason="needs Triton (make setup installs it): compiled on CUDA, else its interpreter",
)  # the Triton kernels' tests: compiled on CUDA, else in the interpreter (tests/conftest.py)
GRADIENT_NAMES = ("out", "lse", "dq", "dk", "dv", "dprobs")  # what a kernel test compares


def log_sigmoid(x: float) -> float:
    """Numerically stable ``log(1 / (1 + exp(-x)))`` in Python floats."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def brute_force_focus(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor | None,
    *,
    window: int,
    mode: str,
    top_k: int = 1,
    gate_lambda: float = 10.0,
    softcap: float | None = None,
    scale: float | None = None,
    local_only: bool = False,
    sinks: int = 0,
    documents: list[list[int]] | None = None,
    gate_form: str = "sigmoid",
    key_groups: str = "own",
) -> Tensor:
    """Focus attention as a scalar double loop over (i, j), written from the spec alone.

    Shares no code with the package. ``q [b, s, H, D]``, ``k/v [b, s, Hkv, D]``,
    ``probs [b, s, K]``; ``sinks``: keys ``j < sinks`` are treated like keys in the window.
    ``documents``: per sample, each token's document id (a change of id starts a document):
    keys of other documents are skipped and the sinks count from each document's start.
    ``gate_form="dot"``: no sigmoid gate; ``gate_lambda * g_i . g_j`` is added to every allowed
    pair's score before soft-capping, and the soft pattern is every causal pair.
    ``key_groups="own_and_previous"``: a key ``j`` also counts as in the top-k groups of ``j - 1``
    (same document), and its soft assignment is ``p_j + p_{j-1} - p_j p_{j-1}`` per group.
    Returns ``[b, s, H, D]`` float64.
    """
    b, s, h, d = q.shape
    group = h // k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qs, ks, vs = q.double().tolist(), k.double().tolist(), v.double().tolist()
    out = torch.zeros(b, s, h, d, dtype=torch.float64)
    for bi in range(b):
        doc = [0] * s if documents is None else list(documents[bi])
        start = [0] * s
        for t in range(1, s):
            start[t] = t if doc[t] != doc[t - 1] else start[t - 1]
        if probs is not None:
            p = probs[bi].double().tolist()
            n_groups = len(p[0])
            sets = [
                set(sorted(range(n_groups), key=lambda c, t=t: -p[t][c])[:top_k]) for t in range(s)
            ]
            key_sets, key_p = list(sets), [list(row) for row in p]
            for t in range(s):
                if key_groups == "own_and_previous" and t > start[t]:
                    key_sets[t] = sets[t] | sets[t - 1]
                    key_p[t] = [a + c - a * c for a, c in zip(p[t], p[t - 1], strict=True)]
        for hi in range(h):
            kv = hi // group
            for i in range(s):
                logits, keys = [], []
                for j in range(i + 1):
                    if start[j] != start[i]:
                        continue
                    local = i - j <= window or j - start[j] < sinks
                    bias = dot = 0.0
                    if gate_form == "dot" and not local_only:
                        dot = gate_lambda * sum(p[i][c] * p[j][c] for c in range(n_groups))
                        local = local or mode == "soft"  # soft: every causal pair, ungated
                    if local_only:
                        if not local:
                            continue
                    elif mode in ("hard", "hard_gated"):
                        if not local and not (sets[i] & key_sets[j]):
                            continue
                        gated = mode == "hard_gated" and gate_form != "dot"
                        if gated and not local:  # kept, and gated
                            affinity = sum(p[i][c] * key_p[j][c] for c in range(n_groups))
                            bias = log_sigmoid(gate_lambda * (affinity - 0.5))
                    elif not local:
                        affinity = sum(p[i][c] * key_p[j][c] for c in range(n_groups))
                        bias = log_sigmoid(gate_lambda * (affinity - 0.5))
                    score = scale * sum(qs[bi][i][hi][c] * ks[bi][j][kv][c] for c in range(d))
                    score += dot
                    if softcap is not None:
                        score = softcap * math.tanh(score / softcap)
                    logits.append(score + bias)
                    keys.append(j)
                top = max(logits)
                weights = [math.exp(x - top) for x in logits]
                total = sum(weights)
                for c in range(d):
                    acc = sum(w * vs[bi][j][kv][c] for w, j in zip(weights, keys, strict=True))
                    out[bi, i, hi, c] = acc / total
    return out


def random_qkv(
    b: int,
    s: int,
    h: int,
    hkv: int,
    d: int,
    *,
    seed: int,
    dtype=torch.float64,
    requires_grad: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``q [b, s, h, d]``, ``k, v [b, s, hkv, d]`` (standard normal, never zeros)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(b, s, heads, d, generator=gen, dtype=torch.float64).to(dtype)
        for heads in (h, hkv, hkv)
    ]
    return tuple(t.requires_grad_(requires_grad) for t in tensors)


def random_probs(b: int, s: int, k: int, *, seed: int, sharpness: float = 1.0) -> Tensor:
    """Random soft assignments ``[b, s, k]`` (rows sum to 1); larger ``sharpness`` -> one-hot."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, s, k, generator=gen, dtype=torch.float64) * sharpness
    return torch.softmax(logits, dim=-1)


def make_hf_tokenizer(directory, texts, vocab_size: int = 400):
    """A GPT-2-style byte-level BPE tokenizer (``tokenizers``) saved as an HF tokenizer dir."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def packed_documents(b: int, lengths: list[int], *, seed: int) -> Tensor:
    """``[b, sum(lengths)]`` int64 document ids: sample ``r`` packs documents of ``lengths``
    rotated by ``r`` (so the samples of a batch differ), with arbitrary (non-start) ids."""
    rows = []
    gen = torch.Generator().manual_seed(seed)
    for r in range(b):
        order = lengths[r % len(lengths) :] + lengths[: r % len(lengths)]
        labels = torch.randperm(1000, generator=gen)[: len(order)]
        runs = [torch.full((n,), int(x)) for n, x in zip(order, labels, strict=True)]
        rows.append(torch.cat(runs))
    return torch.stack(rows)


def document_spans(documents: Tensor) -> list[list[tuple[int, int]]]:
    """Per sample, the ``(start, end)`` of each document of ``[b, s]`` ids (runs of one id)."""
    spans = []
    for row in documents.tolist():
        cuts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]] + [len(row)]
        spans.append(list(itertools.pairwise(cuts)))
    return spans


def reference_call(q, k, v, *, q_block: int | None = None, **pattern):
    """The reference backend called with the pattern's fields as keywords (window, mode, probs,
    member, ...: :class:`~focus_pretrain.focus.backends.AttentionPattern`)."""
    from focus_pretrain.focus.backends import AttentionPattern
    from focus_pretrain.focus.reference import DEFAULT_Q_BLOCK, reference_attention

    block = DEFAULT_Q_BLOCK if q_block is None else q_block
    return reference_attention(q, k, v, AttentionPattern(**pattern), q_block=block)


def random_documents(b: int, n: int, seed: int, rate: float = 0.08) -> Tensor:
    """``[b, n]`` int64 document starts of random packed documents."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cumsum((torch.rand(b, n, generator=gen) < rate).long(), dim=1)
    return document_starts(ids)


def assert_close(got: Sequence[Tensor], want: Sequence[Tensor], tol: float) -> None:
    """Each of ``got`` (named as :data:`GRADIENT_NAMES`) finite and within ``tol`` of ``want``,
    relative to ``want``'s largest magnitude (at least 1)."""
    for name, a, b in zip(GRADIENT_NAMES[: len(want)], got, want, strict=True):
        assert torch.isfinite(a).all(), name
        scale = b.abs().max().clamp_min(1.0)
        err = (a - b).abs().max() / scale
        assert err < tol, f"{name}: max error {err:.2e} (relative to {scale:.2e}) > {tol}"


def require_packages(*modules: str, extra: str) -> None:
    """Skip unless every module in ``modules`` is importable; under CI (``CI`` set), where
    ``make setup`` installs the ``extra``, their absence is a broken set-up and fails."""
    import importlib.util
    import os

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if not missing:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{', '.join(missing)} not installed; make setup installs the {extra} extra")
    pytest.skip(f"{', '.join(missing)} not installed: a set-up without the {extra} extra")
