"""HuggingFace <-> megatron-core key maps, one declarative table per family.

A :class:`Rule` says which of our tensors (Megatron ``GPTModel`` state-dict key, ``{i}`` = layer)
comes from which HuggingFace tensors, through which transform, and how tensor parallelism
shards it. Transforms come in exact inverse pairs (``to_ours`` on import, ``to_hf`` on export),
so a round trip HF -> ours -> HF is bit-identical. Routers have no HF counterpart: import keeps
their initialisation, export writes them under ``model.layers.{i}.self_attn.router.*``.

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


def _rule(ours: str, hf: str | tuple[str, ...], kind: str = "same", shard=REPLICATED) -> Rule:
    pairs = {
        "same": (_same, _same_back),
        "transpose": (_transpose, _transpose_back),
        "plus_one": (_plus_one, _plus_one_back),
        "qkv": (_fuse_qkv, _split_qkv),
        "gpt2_qkv": (_fuse_gpt2_qkv, _split_gpt2_qkv),
        "glu": (_fuse_glu, _split_glu),
    }
    to_ours, to_hf = pairs[kind]
    return Rule(ours, (hf,) if isinstance(hf, str) else hf, to_ours, to_hf, shard)


_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
_QKV = tuple(f"{_H}self_attn.{p}_proj.weight" for p in "qkv")
_ATTN = [
    _rule(f"{_L}self_attention.linear_qkv.weight", _QKV, "qkv", COLUMN),
    _rule(f"{_L}self_attention.linear_proj.weight", f"{_H}self_attn.o_proj.weight", shard=ROW),
]
_MLP = [
    _rule(
        f"{_L}mlp.linear_fc1.weight",
        (f"{_H}mlp.gate_proj.weight", f"{_H}mlp.up_proj.weight"),
        "glu",
        GLU,
    ),
    _rule(f"{_L}mlp.linear_fc2.weight", f"{_H}mlp.down_proj.weight", shard=ROW),
]
_EMBED = [_rule("embedding.word_embeddings.weight", "model.embed_tokens.weight", shard=COLUMN)]
_HEAD = [_rule("output_layer.weight", "lm_head.weight", shard=COLUMN)]


def _llama(norm: str = "same") -> tuple[list[Rule], list[Rule]]:
    layer = [
        _rule(f"{_L}input_layernorm.weight", f"{_H}input_layernorm.weight", norm),
        *_ATTN,
        _rule(f"{_L}pre_mlp_layernorm.weight", f"{_H}post_attention_layernorm.weight", norm),
        *_MLP,
    ]
    return layer, [*_EMBED, _rule("decoder.final_layernorm.weight", "model.norm.weight", norm)]


def _qwen2() -> tuple[list[Rule], list[Rule]]:
    layer, top = _llama()
    bias = tuple(f"{_H}self_attn.{p}_proj.bias" for p in "qkv")
    return [*layer, _rule(f"{_L}self_attention.linear_qkv.bias", bias, "qkv", COLUMN)], top


def _olmo2() -> tuple[list[Rule], list[Rule]]:
    layer = [
        *_ATTN,
        _rule(
            f"{_L}self_attention.q_layernorm.weight", f"{_H}self_attn.q_norm.weight", shard=COLUMN
        ),
        _rule(
            f"{_L}self_attention.k_layernorm.weight", f"{_H}self_attn.k_norm.weight", shard=COLUMN
        ),
        _rule(f"{_L}self_attention.post_norm.weight", f"{_H}post_attention_layernorm.weight"),
        *_MLP,
        _rule(f"{_L}mlp.post_norm.weight", f"{_H}post_feedforward_layernorm.weight"),
    ]
    return layer, [*_EMBED, _rule("decoder.final_layernorm.weight", "model.norm.weight")]


def _qk_norms(kind: str = "same") -> list[Rule]:
    """Per-head q/k norms (Qwen3, Gemma-3): one ``[head_dim]`` weight, replicated over TP."""
    return [
        _rule(f"{_L}self_attention.{p}_layernorm.weight", f"{_H}self_attn.{p}_norm.weight", kind)
        for p in "qk"
    ]


def _qwen3() -> tuple[list[Rule], list[Rule]]:
    layer, top = _llama()
    return [*layer, *_qk_norms()], top


def _gemma2() -> tuple[list[Rule], list[Rule]]:
    one = "plus_one"
    layer = [
        _rule(f"{_L}input_layernorm.weight", f"{_H}input_layernorm.weight", one),
        *_ATTN,
        _rule(f"{_L}self_attention.post_norm.weight", f"{_H}post_attention_layernorm.weight", one),
        _rule(f"{_L}pre_mlp_layernorm.weight", f"{_H}pre_feedforward_layernorm.weight", one),
        *_MLP,
        _rule(f"{_L}mlp.post_norm.weight", f"{_H}post_feedforward_layernorm.weight", one),
    ]
    return layer, [*_EMBED, _rule("decoder.final_layernorm.weight", "model.norm.weight", one)]


def _gemma3() -> tuple[list[Rule], list[Rule]]:
    layer, top = _gemma2()
    return [*layer, *_qk_norms("plus_one")], top  # Gemma's (1 + w) norms, per head too


def _gpt2() -> tuple[list[Rule], list[Rule]]:
    h, t = "transformer.h.{i}.", "transpose"
    layer = [
        _rule(f"{_L}input_layernorm.weight", f"{h}ln_1.weight"),
        _rule(f"{_L}input_layernorm.bias", f"{h}ln_1.bias"),
        _rule(
            f"{_L}self_attention.linear_qkv.weight", f"{h}attn.c_attn.weight", "gpt2_qkv", COLUMN
        ),
        _rule(f"{_L}self_attention.linear_qkv.bias", f"{h}attn.c_attn.bias", "gpt2_qkv", COLUMN),
        _rule(f"{_L}self_attention.linear_proj.weight", f"{h}attn.c_proj.weight", t, ROW),
        _rule(f"{_L}self_attention.linear_proj.bias", f"{h}attn.c_proj.bias"),
        _rule(f"{_L}pre_mlp_layernorm.weight", f"{h}ln_2.weight"),
        _rule(f"{_L}pre_mlp_layernorm.bias", f"{h}ln_2.bias"),
        _rule(f"{_L}mlp.linear_fc1.weight", f"{h}mlp.c_fc.weight", t, COLUMN),
        _rule(f"{_L}mlp.linear_fc1.bias", f"{h}mlp.c_fc.bias", shard=COLUMN),
        _rule(f"{_L}mlp.linear_fc2.weight", f"{h}mlp.c_proj.weight", t, ROW),
        _rule(f"{_L}mlp.linear_fc2.bias", f"{h}mlp.c_proj.bias"),
    ]
    top = [
        _rule("embedding.word_embeddings.weight", "transformer.wte.weight", shard=COLUMN),
        _rule("embedding.position_embeddings.weight", "transformer.wpe.weight"),
        _rule("decoder.final_layernorm.weight", "transformer.ln_f.weight"),
        _rule("decoder.final_layernorm.bias", "transformer.ln_f.bias"),
    ]
    return layer, top


# HF ``model_type`` -> (our family, rule tables)
FAMILY_RULES: dict[str, tuple[str, Callable[[], tuple[list[Rule], list[Rule]]]]] = {
    "gpt2": ("gpt2", _gpt2),
    "llama": ("llama", _llama),
    "mistral": ("mistral", _llama),
    "qwen2": ("qwen2", _qwen2),
    "qwen3": ("qwen3", _qwen3),
    "olmo2": ("olmo2", _olmo2),
    "gemma2": ("gemma2", _gemma2),
    "gemma3_text": ("gemma3", _gemma3),  # Gemma3ForCausalLM (the text-only Gemma-3)
}
# our family -> its HF model_type (they differ only for Gemma-3)
HF_MODEL_TYPES = {family: model_type for model_type, (family, _) in FAMILY_RULES.items()}


def rules_for(model_type: str, num_layers: int, tied: bool) -> list[Rule]:
    """Every rule of a model (``model_type``: HF's or our family name), layer placeholders
    expanded (``lm_head`` only when untied)."""
    if model_type not in FAMILY_RULES:
        model_type = HF_MODEL_TYPES.get(model_type, model_type)
    if model_type not in FAMILY_RULES:
        raise ValueError(
            f"unsupported HuggingFace architecture model_type={model_type!r}; supported: "
            f"{', '.join(sorted(FAMILY_RULES))}"
        )
    layer, top = FAMILY_RULES[model_type][1]()
    rules = [*top, *([] if tied else _HEAD)]
    for i in range(num_layers):
        for rule in layer:
            rules.append(
                Rule(
                    rule.ours.format(i=i),
                    tuple(k.format(i=i) for k in rule.hf),
                    rule.to_ours,
                    rule.to_hf,
                    rule.shard,
                )
            )
    return rules


def shard(tensor: Tensor, kind: str, rank: int, size: int) -> Tensor:
    """This tensor-parallel rank's slice of a full tensor."""
    if size == 1 or kind == REPLICATED:
        return tensor
    if kind == COLUMN:
        return tensor.chunk(size, dim=0)[rank].contiguous()
    if kind == ROW:
        return tensor.chunk(size, dim=1)[rank].contiguous()
    if kind == GLU:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]]).contiguous()
    raise ValueError(f"unknown shard kind {kind!r}")


def unshard(shards: list[Tensor], kind: str) -> Tensor:
    """The full tensor from its tensor-parallel ranks' slices, in rank order (inverse of
    :func:`shard`; a replicated tensor is rank 0's)."""
    if len(shards) == 1 or kind not in (COLUMN, ROW, GLU):
        return shards[0]
    if kind == COLUMN:
        return torch.cat(shards, dim=0)
    if kind == ROW:
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]  # GLU: per rank [gate_r; up_r]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
