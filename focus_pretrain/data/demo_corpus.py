"""The embedded demo corpus: generated on the fly, deterministic, no download.

Each document is a small "registry": it first *defines* a few key-value pairs
(``the code of kalomi is 4821.``), then runs for hundreds of tokens of filler prose, and then
*queries* the keys again (``recall: the code of kalomi is 4821.``). The digits of a recalled
value are predictable only from the definition far back: beyond a 128-token window, so a
sliding-window model cannot learn them, while a model whose attention reaches back to tokens of
the same group (Focus) can. The filler is drawn from a small grammar so that it is learnable too.

Everything is a pure function of ``(seed, index)``, so the corpus is identical on every machine.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

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
        pairs: key-value pairs defined (and later recalled) per document.
        digits: digits per value (each digit is its own token under ``split_digits``).
        filler_sentences: filler sentences between the definitions and the first recall, and
            again between recalls (about 12 tokens each: 16 sentences put a recall ~190
            tokens after its definition, beyond the default 128-token window).
    """

    pairs: int = 4
    digits: int = 4
    filler_sentences: int = 16


def _key(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(3))


def _sentence(rng: random.Random) -> str:
    parts = (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)
    return " ".join(rng.choice(options) for options in parts) + "."


def demo_document(index: int, seed: int = 0, spec: DemoSpec | None = None) -> str:
    """Document ``index`` of the demo corpus with ``seed`` (a pure function of both)."""
    spec = spec or DemoSpec()
    rng = random.Random(f"focus-demo/{seed}/{index}")
    keys: list[str] = []
    while len(keys) < spec.pairs:
        key = _key(rng)
        if key not in keys:
            keys.append(key)
    values = ["".join(str(rng.randrange(10)) for _ in range(spec.digits)) for _ in keys]
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
