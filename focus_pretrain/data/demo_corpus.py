"""The embedded demo corpus: generated on the fly, deterministic, no download.

Each document is a small "registry": it first *defines* a few key-value pairs
(``the code of kalomi is amber.``), then runs for hundreds of tokens of filler prose, and then
*queries* the keys again (``recall: the code of kalomi is amber.``). Keys are random
three-syllable names; values are drawn from 64 words that occur nowhere else. A recalled value
(and key) is predictable only from the definition far back: beyond the local window, so a
sliding-window model can do no better than the 1-in-64 prior, while a model whose attention
reaches back to tokens of the same group (Focus) can copy it. The filler is drawn from a small
grammar so that it is learnable too.

Everything is a pure function of ``(seed, index)``, so the corpus is identical on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from focus_pretrain.errors import InputError

_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "be", "da", "fo", "gu", "hi", "ju")
_SUBJECTS = (
    "the farmer",
    "a child",
    "the old sailor",
    "my neighbour",
    "the teacher",
    "a small dog",
    "the baker",
    "our captain",
    "the river",
    "a quiet man",
)
_VERBS = (
    "carries",
    "watches",
    "paints",
    "finds",
    "remembers",
    "follows",
    "builds",
    "sells",
    "counts",
    "hides",
)
_OBJECTS = (
    "a red boat",
    "the long road",
    "three apples",
    "the broken clock",
    "a letter",
    "the green door",
    "some bread",
    "the tall tree",
    "a wooden box",
    "the morning sky",
)
VALUES = (
    "amber", "azure", "coral", "crimson", "golden", "indigo", "ivory", "jade",
    "lilac", "maroon", "olive", "scarlet", "silver", "teal", "violet", "copper",
    "badger", "beaver", "camel", "cobra", "falcon", "ferret", "gecko", "heron",
    "jackal", "lemur", "magpie", "otter", "panda", "parrot", "raven", "walrus",
    "almond", "apricot", "cherry", "fennel", "ginger", "lemon", "mango", "melon",
    "nutmeg", "papaya", "peach", "pepper", "plum", "quince", "saffron", "walnut",
    "anchor", "banner", "candle", "compass", "feather", "hammer", "lantern", "marble",
    "mirror", "needle", "pillow", "ribbon", "saddle", "thimble", "trumpet", "whistle",
)  # fmt: skip
_ENDINGS = (
    "every day",
    "at night",
    "near the market",
    "without a word",
    "in the rain",
    "before noon",
    "with great care",
    "once more",
    "by the sea",
    "in silence",
)


@dataclass(frozen=True)
class DemoSpec:
    """Shape of the demo documents.

    Attributes:
        pairs: key-value pairs defined (and later recalled) per document (distinct values).
        values: how many of the 64 value words documents draw from (``pairs <= values <= 64``);
            fewer words are learned faster (each word's copy is its own association).
        filler_sentences: filler sentences between the definitions and the first recall, and
            again between recalls (about 12 tokens each: 16 sentences put a recall ~190
            tokens after its definition, beyond the default 128-token window).
    """

    pairs: int = 4
    values: int = len(VALUES)
    filler_sentences: int = 16


def is_demo_source(source: str) -> bool:
    """Does a ``data.sources`` entry name the embedded demo corpus (``demo`` or ``demo:N``)?"""
    return source == "demo" or source.startswith("demo:")


DEFAULT_DOCUMENTS = 2000  # ``demo`` without ``:N``


def demo_count(source: str) -> int:
    """The number of documents a ``demo`` / ``demo:N`` source names.

    Raises:
        InputError: ``N`` is not a positive integer.
    """
    count = source.partition(":")[2]
    if not count:
        return DEFAULT_DOCUMENTS
    if not count.isdigit() or int(count) < 1:
        raise InputError(f"{source}: N in demo:N must be a positive integer (documents)")
    return int(count)


def _check(spec: DemoSpec) -> None:
    if not 1 <= spec.pairs <= spec.values <= len(VALUES):
        raise ValueError(
            f"demo corpus needs 1 <= pairs ({spec.pairs}) <= values ({spec.values}) <= "
            f"{len(VALUES)}"
        )


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(3))


def _sentence(rng: random.Random) -> str:
    parts = (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)
    return " ".join(rng.choice(options) for options in parts) + "."


def demo_document(index: int, seed: int = 0, spec: DemoSpec | None = None) -> str:
    """Document ``index`` of the demo corpus with ``seed`` (a pure function of both)."""
    spec = spec or DemoSpec()
    _check(spec)
    rng = random.Random(f"focus-demo/{seed}/{index}")
    keys: list[str] = []
    while len(keys) < spec.pairs:
        key = _key(rng)
        if key not in keys:
            keys.append(key)
    values = rng.sample(VALUES[: spec.values], spec.pairs)
    lines = [f"registry {index}."]
    lines += [f"the code of {k} is {v}." for k, v in zip(keys, values, strict=True)]
    order = list(range(spec.pairs))
    rng.shuffle(order)
    for i in order:
        lines += [_sentence(rng) for _ in range(spec.filler_sentences)]
        lines.append(f"recall: the code of {keys[i]} is {values[i]}.")
    return "\n".join(lines)


def demo_documents(count: int, seed: int = 0, spec: DemoSpec | None = None) -> Iterator[str]:
    """The first ``count`` documents of the demo corpus."""
    for index in range(count):
        yield demo_document(index, seed, spec)
