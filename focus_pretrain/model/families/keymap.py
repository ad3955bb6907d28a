"""HuggingFace <-> megatron-core key maps: the rule type, its transforms, shared rule sets.

A :class:`Rule` says which of our tensors (Megatron ``GPTModel`` state-dict key, ``{i}`` = layer)
comes from which HuggingFace tensors, through which transform, and how tensor parallelism
shards it. Transforms come in exact inverse pairs (``to_ours`` on import, ``to_hf`` on export),
so a round trip HF -> ours -> HF is bit-identical. Routers have no HF counterpart: import keeps
their initialisation, export writes them under the family's ``hf_router_prefix``.

Each family's description (:class:`~focus_pretrain.model.families.base.Family`) holds its own
rules, most of them assembled from the Llama-style pieces here. Cutting and merging tensors
over tensor-parallel ranks is :mod:`focus_pretrain.model.tp_rules`'s.

Layouts: HF linear weights are ``[out, in]`` (GPT-2's ``Conv1D`` is ``[in, out]``); Megatron's
fused QKV is grouped per KV head: ``[g0: q heads of g0, k_g0, v_g0 | g1: ...]`` rows of
``head_dim``; its fused gated-MLP ``linear_fc1`` is ``[gate; up]`` (per tensor-parallel rank).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

REPLICATED, COLUMN, ROW, GLU = "replicated", "column", "row", "glu"
SHARD_KINDS = (REPLICATED, COLUMN, ROW, GLU)


@dataclass(frozen=True)
class Geometry:
    """Attention shape the QKV transforms need."""

    heads: int
    groups: int
    head_dim: int


@dataclass(frozen=True)
class Rule:
    """One of our tensors and the HF tensors it is made of.

    Attributes:
        ours: our key (``{i}``: layer index).
        hf: HF keys (``{i}``: layer index), in the order ``to_ours`` takes them.
        to_ours: ``(geometry, *hf_tensors) -> our full (unsharded) tensor``.
        to_hf: ``(geometry, ours) -> tuple of hf tensors`` (inverse of ``to_ours``).
        shard: how tensor parallelism splits our tensor (``replicated``, ``column``: dim 0,
            ``row``: dim 1, ``glu``: gate and up halves each split along dim 0).
    """

    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., Tensor]
    to_hf: Callable[[Geometry, Tensor], tuple[Tensor, ...]]
    shard: str = REPLICATED

    def for_layer(self, i: int) -> Rule:
        """This rule with the layer placeholder ``{i}`` filled in."""
        return Rule(
            self.ours.format(i=i),
            tuple(k.format(i=i) for k in self.hf),
            self.to_ours,
            self.to_hf,
            self.shard,
        )


def _same(geo: Geometry, x: Tensor) -> Tensor:
    return x


def _same_back(geo: Geometry, x: Tensor) -> tuple[Tensor, ...]:
    return (x,)


def _transpose(geo: Geometry, x: Tensor) -> Tensor:
    return x.t().contiguous()  # GPT-2 Conv1D [in, out] -> Linear [out, in]


def _transpose_back(geo: Geometry, x: Tensor) -> tuple[Tensor, ...]:
    return (x.t().contiguous(),)


def _plus_one(geo: Geometry, x: Tensor) -> Tensor:
    return x + 1.0  # Gemma's RMSNorm scales by (1 + w); ours by w


def _plus_one_back(geo: Geometry, x: Tensor) -> tuple[Tensor, ...]:
    return (x - 1.0,)


def _fuse_qkv(geo: Geometry, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``q [H*d, ...]``, ``k, v [G*d, ...]`` (weights or biases) -> Megatron's grouped layout."""
    per_group = geo.heads // geo.groups
    rest = q.shape[1:]
    q = q.reshape(geo.groups, per_group * geo.head_dim, *rest)  # [G, H/G*d, ...]
    k = k.reshape(geo.groups, geo.head_dim, *rest)  # [G, d, ...]
    v = v.reshape(geo.groups, geo.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)  # [G*(H/G+2)*d, ...]


def _split_qkv(geo: Geometry, fused: Tensor) -> tuple[Tensor, ...]:
    per_group = geo.heads // geo.groups
    rest = fused.shape[1:]
    grouped = fused.reshape(geo.groups, (per_group + 2) * geo.head_dim, *rest)
    q, k, v = grouped.split([per_group * geo.head_dim, geo.head_dim, geo.head_dim], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _fuse_gpt2_qkv(geo: Geometry, c_attn: Tensor) -> Tensor:
    """GPT-2 ``c_attn`` (``[h, 3h]`` weight or ``[3h]`` bias; q, k, v blocks) -> grouped."""
    linear = c_attn.t() if c_attn.dim() == 2 else c_attn  # weight: [3h, h]
    q, k, v = linear.chunk(3, dim=0)
    return _fuse_qkv(geo, q, k, v)


def _split_gpt2_qkv(geo: Geometry, fused: Tensor) -> tuple[Tensor, ...]:
    linear = torch.cat(_split_qkv(geo, fused), dim=0)
    return (linear.t().contiguous() if linear.dim() == 2 else linear,)


def _fuse_glu(geo: Geometry, gate: Tensor, up: Tensor) -> Tensor:
    return torch.cat([gate, up], dim=0)  # [2f, h]


def _split_glu(geo: Geometry, fused: Tensor) -> tuple[Tensor, ...]:
    gate, up = fused.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


TRANSFORMS = {  # name -> (to_ours, to_hf), exact inverses
    "same": (_same, _same_back),
    "transpose": (_transpose, _transpose_back),
    "plus_one": (_plus_one, _plus_one_back),
    "qkv": (_fuse_qkv, _split_qkv),
    "gpt2_qkv": (_fuse_gpt2_qkv, _split_gpt2_qkv),
    "glu": (_fuse_glu, _split_glu),
}


def rule(ours: str, hf: str | tuple[str, ...], kind: str = "same", shard: str = REPLICATED) -> Rule:
    """A :class:`Rule` through the transform pair ``kind`` (a key of :data:`TRANSFORMS`)."""
    to_ours, to_hf = TRANSFORMS[kind]
    return Rule(ours, (hf,) if isinstance(hf, str) else hf, to_ours, to_hf, shard)


OURS, HF = "decoder.layers.{i}.", "model.layers.{i}."  # layer prefixes (Llama-style HF names)
_QKV = tuple(f"{HF}self_attn.{p}_proj.weight" for p in "qkv")
ATTENTION = (
    rule(f"{OURS}self_attention.linear_qkv.weight", _QKV, "qkv", COLUMN),
    rule(f"{OURS}self_attention.linear_proj.weight", f"{HF}self_attn.o_proj.weight", shard=ROW),
)
QKV_BIAS = rule(
    f"{OURS}self_attention.linear_qkv.bias",
    tuple(f"{HF}self_attn.{p}_proj.bias" for p in "qkv"),
    "qkv",
    COLUMN,
)
GATED_MLP = (
    rule(
        f"{OURS}mlp.linear_fc1.weight",
        (f"{HF}mlp.gate_proj.weight", f"{HF}mlp.up_proj.weight"),
        "glu",
        GLU,
    ),
    rule(f"{OURS}mlp.linear_fc2.weight", f"{HF}mlp.down_proj.weight", shard=ROW),
)
EMBEDDING = rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", shard=COLUMN)
LM_HEAD = rule("output_layer.weight", "lm_head.weight", shard=COLUMN)  # untied models only


def final_norm(kind: str = "same") -> Rule:
    """The final norm ``model.norm`` (``kind``: ``plus_one`` for Gemma's ``(1 + w)``)."""
    return rule("decoder.final_layernorm.weight", "model.norm.weight", kind)


def llama_layer(norm: str = "same") -> tuple[Rule, ...]:
    """A pre-norm Llama layer: input norm, attention, pre-MLP norm, gated MLP."""
    return (
        rule(f"{OURS}input_layernorm.weight", f"{HF}input_layernorm.weight", norm),
        *ATTENTION,
        rule(f"{OURS}pre_mlp_layernorm.weight", f"{HF}post_attention_layernorm.weight", norm),
        *GATED_MLP,
    )


def per_head_qk_norms(kind: str = "same") -> tuple[Rule, ...]:
    """Per-head q/k norms (Qwen3, Gemma-3): one ``[head_dim]`` weight, replicated over TP."""
    return tuple(
        rule(f"{OURS}self_attention.{p}_layernorm.weight", f"{HF}self_attn.{p}_norm.weight", kind)
        for p in "qk"
    )


def sandwich_layer(norm: str = "plus_one") -> tuple[Rule, ...]:
    """A Gemma layer: norms before *and* after attention and MLP (``(1 + w)`` RMSNorms)."""
    return (
        rule(f"{OURS}input_layernorm.weight", f"{HF}input_layernorm.weight", norm),
        *ATTENTION,
        rule(
            f"{OURS}self_attention.post_norm.weight", f"{HF}post_attention_layernorm.weight", norm
        ),
        rule(f"{OURS}pre_mlp_layernorm.weight", f"{HF}pre_feedforward_layernorm.weight", norm),
        *GATED_MLP,
        rule(f"{OURS}mlp.post_norm.weight", f"{HF}post_feedforward_layernorm.weight", norm),
    )
