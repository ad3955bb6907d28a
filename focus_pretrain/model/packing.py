"""Packed documents inside the Megatron model: what a batch tells the layers, and per-token RoPE.

A packed batch reaches the layers as :class:`DocumentParams`, a subclass of megatron-core's
``PackedSeqParams`` passed as ``packed_seq_params`` (``qkv_format="sbhd"``: the ``[s, b, ...]``
layout is unchanged, not Megatron's ``thd``). Megatron hands it to every layer untouched, outside
activation checkpointing; only the Focus layers read it:

* ``document_starts`` ``[b, s_loc]`` int64: the global position of each token's document start
  (:func:`~focus_pretrain.focus.pattern.document_starts` of the full sequence, then sharded
  like the tokens under context parallelism). Attention and Sinkhorn routing stay inside
  documents. ``None``: no document masking.
* ``rope_positions`` ``[b, s_loc]`` int64: the positions RoPE rotates by (restarting at each
  document when ``data.reset_position_ids``). ``None``: Megatron's positions ``0 .. S - 1``.
  Models with learned absolute positions (GPT-2) read the ``position_ids`` argument instead.

RoPE is relative: inside one document, restarting positions changes q.k only by the rounding
of the angles. It matters for pairs across documents (document masking off) and keeps the
angles of late documents in a million-token sequence as precise as a document's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from torch import Tensor


@dataclass
class DocumentParams(PackedSeqParams):
    """Packed documents for Focus layers (see the module docstring).

    Attributes:
        document_starts: ``[b, s_loc]`` int64 global document starts, or ``None``.
        rope_positions: ``[b, s_loc]`` int64 RoPE positions, or ``None``.
    """

    document_starts: Tensor | None = None
    rope_positions: Tensor | None = None


def document_params(
    documents: Tensor | None, rope_positions: Tensor | None, seq_length: int
) -> DocumentParams | None:
    """``DocumentParams`` for a (sharded) batch, or ``None`` when it has neither field.

    ``seq_length`` is the global sequence length (Megatron sizes its RoPE table from it).
    """
    if documents is None and rope_positions is None:
        return None
    return DocumentParams(
        qkv_format="sbhd",
        max_seqlen_q=seq_length,
        max_seqlen_kv=seq_length,
        document_starts=documents,
        rope_positions=rope_positions,
    )


def rope_for_positions(rotary: torch.nn.Module, positions: Tensor) -> Tensor:
    """Megatron ``RotaryEmbedding`` angles for per-token positions: ``[b, s]`` -> ``[s, b, 1, d]``.

    The same fp32 products as ``RotaryEmbedding.get_emb`` (``position * inv_freq``, then the
    halves concatenated, or interleaved), so a row of positions ``0 .. s - 1`` gives exactly
    Megatron's table.
    """
    inv_freq = rotary.inv_freq.to(positions.device)  # [d / 2] fp32
    seq = positions.transpose(0, 1).to(inv_freq.dtype)  # [b, s] -> [s, b]
    factor = getattr(rotary, "seq_len_interpolation_factor", None)
    if factor is not None:
        seq = seq * (1 / factor)
    freqs = seq[..., None] * inv_freq  # [s, b, d / 2]
    if getattr(rotary, "rotary_interleaved", False):
        emb = torch.stack((freqs.view(*freqs.shape, 1), freqs.view(*freqs.shape, 1)), dim=-1)
        emb = emb.view(*freqs.shape[:-1], -1)  # [s, b, d / 2, 2] -> [s, b, d]
    else:
        emb = torch.cat((freqs, freqs), dim=-1)  # [s, b, d]
    return emb[:, :, None, :]  # [s, b, 1, d]
