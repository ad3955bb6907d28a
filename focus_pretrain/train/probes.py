"""Synthetic long-context retrieval probes: passkey and multi-key needle-in-a-haystack.

A probe sequence is built from token pieces, so every position is known exactly:

``<eod> filler... NEEDLE filler... question answer``

* ``passkey`` (Mohtashami & Jaggi, 2023): one needle ``The pass key is 48213. Remember it.``;
  the question ``What is the pass key? The pass key is`` and the answer ``48213``.
* ``multikey`` (the multi-key needle of RULER-style suites): ``keys`` needles
  ``The value of key kalomi is 48213.`` with distinct keys; the one at the given depth is
  asked for (``What is the value of key kalomi? The value of key kalomi is``), the others sit
  at random depths as distractors.

The filler is the passkey paper's repeated sentences. Depth ``d`` puts the needle after the
fraction ``d`` of the filler sentences. The whole text is tokenised at once (any tokenizer
sees ordinary text) and the answer and needle tokens are found from character offsets. The
scored tokens are the answer's digits: loss and argmax accuracy on them, exact match (every
digit right) per sequence, and the same split by whether the needle lies beyond the local
window of the question (``far``: no answer-predicting query sees a needle digit through the
window, so only long-range attention can answer) or not (``near``). A digit guessed from the
prior is right one time in ten. Every sequence is a pure function of ``(seed, kind, length,
depth, index)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import Tensor

from focus_pretrain.config import ProbesConfig
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.errors import InputError
from focus_pretrain.train.scoring import Packing, masked_means, token_scores

PROBE_SEED_OFFSET = 2_000_003  # probe sequences never share a seed with training data
FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "da", "fo", "gu", "hi")


@dataclass(frozen=True)
class ProbeBatch:
    """Probe sequences of one kind and length.

    Attributes:
        kind: ``passkey`` or ``multikey``.
        length: tokens per sequence.
        tokens, labels: ``[n, length]`` int64 (``labels[:, p] = tokens[:, p + 1]`` of the
            built sequence; the last label is the answer's last token).
        answer_mask: ``[n, length]`` bool: label positions whose target is an answer digit.
        depths: ``[n]`` the asked needle's depth.
        distance: ``[n]`` int64: from the asked needle's last digit to the first query that
            predicts an answer digit (beyond ``window`` means only long-range attention helps).
    """

    kind: str
    length: int
    tokens: Tensor
    labels: Tensor
    answer_mask: Tensor
    depths: Tensor
    distance: Tensor


def _number(rng: random.Random, digits: int) -> str:
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(3))


def _overlaps(piece: tuple[int, int, int], span: tuple[int, int]) -> bool:
    _, begin, end = piece
    return end > begin and begin < span[1] and span[0] < end


def _build_text(
    kind: str, fill: int, depth: float, names: list[str], values: list[str], rng: random.Random
) -> tuple[str, tuple[int, int], tuple[int, int]]:
    """The probe text with ``fill`` filler sentences, and the character spans of the asked
    needle's value and of the answer."""
    count = len(values)
    places = [round(depth * fill)] + [rng.randint(0, fill) for _ in range(count - 1)]
    order = sorted(range(count), key=lambda i: (places[i], i))
    parts, cursor, needle_span = [], 0, (0, 0)
    for i in order:
        parts += [FILLER[j % len(FILLER)] for j in range(cursor, places[i])]
        cursor = places[i]
        if kind == "passkey":
            needle, after = f"The pass key is {values[i]}.", " Remember it."
        else:
            needle, after = f"The value of key {names[i]} is {values[i]}.", ""
        start = len(" ".join(parts)) + (1 if parts else 0)
        if i == 0:  # the asked needle
            value_at = start + needle.rindex(values[i])
            needle_span = (value_at, value_at + len(values[i]))
        parts.append(needle + after)
    parts += [FILLER[j % len(FILLER)] for j in range(cursor, fill)]
    if kind == "passkey":
        parts.append("What is the pass key? The pass key is")
    else:
        parts.append(f"What is the value of key {names[0]}? The value of key {names[0]} is")
    text = " ".join(parts) + " " + values[0]
    return text, needle_span, (len(text) - len(values[0]), len(text))


def _sequence(
    tokenizer: Tokenizer, kind: str, length: int, depth: float, keys: int, digits: int, seed: str
) -> tuple[list[int], list[bool], int]:
    """One probe: ``length + 1`` token ids, which of ``ids[1:]`` are answer digits, and the
    distance from the asked needle's last digit to the first answer-predicting query.

    The text is tokenised whole (so every tokenizer sees ordinary text) with as many filler
    sentences as fit; the few tokens short of ``length + 1`` are end-of-document ids in front
    (as after empty documents)."""
    rng = random.Random(seed)
    count = 1 if kind == "passkey" else keys
    names: list[str] = []
    while len(names) < count:
        name = _key(rng)
        if name not in names:
            names.append(name)
    values = [_number(rng, digits) for _ in range(count)]
    state = rng.getstate()

    def encoded(fill: int):
        rng.setstate(state)  # the same distractor places whatever the fill
        text, needle, answer = _build_text(kind, fill, depth, names, values, rng)
        return tokenizer.encode_with_offsets(text), needle, answer

    budget = length  # ids: [eod] + text, length + 1 in all
    low, high = 0, max(1, budget)
    if len(encoded(0)[0]) > budget:
        raise InputError(
            f"probes.lengths has {length}: too short for a {kind} probe "
            f"({len(encoded(0)[0]) + 1} tokens without filler); raise it"
            + (" or lower probes.keys" if kind == "multikey" else "")
        )
    while len(encoded(high)[0]) <= budget:  # filler sentences are >= 1 token each
        low, high = high, high * 2
    while high - low > 1:  # the most filler sentences that fit
        mid = (low + high) // 2
        low, high = (mid, high) if len(encoded(mid)[0]) <= budget else (low, mid)
    pieces, needle, answer = encoded(low)
    pad = budget - len(pieces)
    ids = [tokenizer.eod] * (1 + pad) + [p[0] for p in pieces]
    unk = tokenizer.processor.unk_id() if tokenizer.processor is not None else None
    if unk is not None and unk in ids:
        raise ValueError(
            f"the tokenizer {tokenizer.path} encodes the {kind} probe with <unk>: train it "
            "with byte_fallback (as a tokenizer trained by data.tokenizer=None is)"
        )
    flags = [False] * (1 + pad) + [_overlaps(p, answer) for p in pieces]
    needle_last = 1 + pad + max(i for i, p in enumerate(pieces) if _overlaps(p, needle))
    first_query = flags.index(True) - 1  # this position predicts the first answer token
    return ids, flags[1:], first_query - needle_last


def probe_batches(tokenizer: Tokenizer, config: ProbesConfig, seed: int = 0) -> list[ProbeBatch]:
    """One :class:`ProbeBatch` per (kind, length) of ``config`` (``count`` sequences per
    depth)."""
    batches = []
    for kind in config.kinds:
        for length in config.lengths:
            rows, flags, depths, distances = [], [], [], []
            for d, depth in enumerate(config.depths):
                for index in range(config.count):
                    sample_seed = f"{seed + PROBE_SEED_OFFSET}-{kind}-{length}-{d}-{index}"
                    ids, answer, distance = _sequence(
                        tokenizer, kind, length, depth, config.keys, config.digits, sample_seed
                    )
                    rows.append(ids)
                    flags.append(answer)
                    depths.append(depth)
                    distances.append(distance)
            ids = torch.tensor(rows, dtype=torch.long)  # [n, length + 1]
            batches.append(
                ProbeBatch(
                    kind=kind,
                    length=length,
                    tokens=ids[:, :-1].contiguous(),
                    labels=ids[:, 1:].contiguous(),
                    answer_mask=torch.tensor(flags, dtype=torch.bool),
                    depths=torch.tensor(depths, dtype=torch.float64),
                    distance=torch.tensor(distances, dtype=torch.long),
                )
            )
    return batches


def depth_label(depth: float) -> str:
    """``0.5 -> "d50"`` (a metric-name part)."""
    return f"d{round(depth * 100):02d}"


@torch.no_grad()
def probe_metrics(
    model,
    batches: list[ProbeBatch],
    window: int,
    micro_batch_size: int,
    device: torch.device,
    cp_group=None,
    packing: Packing | None = None,
) -> dict[str, float]:
    """Scores of ``model`` (see :func:`~focus_pretrain.train.scoring.token_scores`) on the
    probes, the same on every rank.

    Returns, per kind (``passkey_...``, ``multikey_...``): ``acc``/``loss`` (answer digits),
    ``exact`` (sequences with every digit right), ``far_acc``/``near_acc`` (needle beyond
    ``window`` of the question or not; ``nan`` when there is none), and per length and depth
    ``{kind}_L{length}_{depth_label}_acc`` and ``_loss``. ``packing``: score the probes
    as the run packs documents (the leading EOD padding is then a document of its own).
    """
    per_kind: dict[str, list] = {}
    out: dict[str, float] = {}
    for batch in batches:
        extra = {} if packing is None else packing.fields(batch.tokens)
        loss, hits = token_scores(
            model, batch.tokens, batch.labels, micro_batch_size, device, cp_group, **extra
        )  # [n, s] each
        per_kind.setdefault(batch.kind, []).append((batch, loss, hits))
        for depth in sorted(set(batch.depths.tolist())):
            rows = (batch.depths == depth)[:, None]  # [n, 1]
            means = masked_means(loss, hits, {"d": batch.answer_mask & rows})["d"]
            name = f"{batch.kind}_L{batch.length}_{depth_label(depth)}"
            out[f"{name}_acc"], out[f"{name}_loss"] = means["acc"], means["loss"]
    for kind, parts in per_kind.items():
        mask = torch.cat([b.answer_mask.flatten() for b, _, _ in parts])
        far = torch.cat([(b.distance > window)[:, None].expand_as(b.answer_mask).flatten()
                         for b, _, _ in parts])  # fmt: skip
        loss = torch.cat([x.flatten() for _, x, _ in parts])
        hits = torch.cat([h.flatten() for _, _, h in parts])
        means = masked_means(loss, hits, {"all": mask, "far": mask & far, "near": mask & ~far})
        exact = torch.cat([(h | ~b.answer_mask).all(dim=1) for b, _, h in parts])  # [n]
        out[f"{kind}_acc"], out[f"{kind}_loss"] = means["all"]["acc"], means["all"]["loss"]
        out[f"{kind}_exact"] = float(exact.double().mean())
        out[f"{kind}_far_acc"], out[f"{kind}_near_acc"] = means["far"]["acc"], means["near"]["acc"]
    return out
