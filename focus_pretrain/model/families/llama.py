"""Llama (and Llama-3.x RoPE scaling): RoPE, pre-RMSNorm, SwiGLU MLP, no biases, GQA; the
defaults of every :class:`~focus_pretrain.model.families.base.Family` field. Transformers'
Llama ignores the sliding-window keys of its ``config.json``, whatever they say."""

from __future__ import annotations

from focus_pretrain.model.families.base import Family, register

LLAMA = register(Family(name="llama", released="2023-02-24"))
