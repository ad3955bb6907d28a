"""Which label positions need long range: the masks of the loss-by-distance metrics.

Whole-sequence loss mostly measures local modelling, so validation also reports the loss on
two subsets of label positions ``p`` (the query at ``p`` predicts ``labels[p]``; it sees keys
``p - window .. p`` through the window, see docs/focus-method.md):

* ``beyond_window``: positions with more than ``window`` tokens of their own document before
  them (context beyond the window exists);
* ``far_evidence``: positions whose target token occurred earlier in the same document, but
  only farther back than the window: its last previous occurrence ``q`` has ``p - q > window``.
  An identifier or word seen long ago and not since is the textbook case; a local model can
  only guess it from the prior, a model that reaches the earlier occurrence can copy it.
  Counted per token id (a multi-piece identifier's later pieces are usually predictable from
  its first piece, so mostly first pieces count); end-of-document ids are never counted.

Documents are delimited by the end-of-document id in ``tokens`` (samples of Megatron's
``GPTDataset`` run across document boundaries).
"""

from __future__ import annotations

import torch
from torch import Tensor


def distance_masks(tokens: Tensor, labels: Tensor, window: int, eod: int) -> dict[str, Tensor]:
    """``{"beyond_window", "far_evidence"}``: ``[n, s]`` bool masks over label positions.

    Args:
        tokens, labels: ``[n, s]`` int64 (``labels[:, p]`` follows ``tokens[:, p]``).
        window: the local window ``w`` (a query sees keys ``0 <= p - j <= w``).
        eod: the end-of-document id (starts a new document after it).
    """
    n, s = tokens.shape
    beyond = torch.zeros(n, s, dtype=torch.bool)
    far = torch.zeros(n, s, dtype=torch.bool)
    rows_t, rows_l = tokens.tolist(), labels.tolist()
    for r in range(n):
        last: dict[int, int] = {}  # token id -> its last position in the current document
        start = 0  # the current document's first position
        for p in range(s):
            token = rows_t[r][p]
            if token == eod:
                last, start = {}, p + 1
                continue
            last[token] = p
            beyond[r, p] = p - start > window
            target = rows_l[r][p]
            q = last.get(target)
            far[r, p] = target != eod and q is not None and p - q > window
    return {"beyond_window": beyond, "far_evidence": far}
