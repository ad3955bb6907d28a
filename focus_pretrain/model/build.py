"""``build_model(config)``: a megatron-core ``GPTModel`` whose self-attention is Focus.

Megatron's parallel state must be initialised by the caller (without CUDA, after
:func:`focus_pretrain.parallel.apply_cpu_shim`): the model takes its tensor- and
context-parallel sizes from it; Megatron sequence parallelism is
``build_model(..., sequence_parallel=True)`` (the trainer passes ``parallel.sequence_parallel``).
Build under ``torch.device("meta")`` to count parameters of a large config without allocating
memory (:func:`count_parameters`).

Sequence parallelism: the embedding scatters its output over the tensor-parallel ranks, so
that norms, dropout and residual adds run on ``[s / tp, b, h]``; ``linear_qkv``/``linear_fc1``
all-gather the sequence, ``linear_proj``/``linear_fc2`` reduce-scatter it, the output layer
gathers it back. The Focus routers project their rank's tokens and gather the projection
(:meth:`~focus_pretrain.model.attention.FocusSelfAttention.route`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from focus_pretrain.focus.pattern import soft_cap
from focus_pretrain.model.attention import FocusCoreAttention, FocusSelfAttention
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.model.families import Family
from focus_pretrain.model.layers import FullWidthQKNorm, PerHeadQKNorm, PostNormMLP, TorchNorm
from focus_pretrain.model.rope import set_rope_frequencies

_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": partial(F.gelu, approximate="tanh")}


def parallel_sizes() -> tuple[int, int]:
    """``(tensor, context)``-parallel sizes of Megatron's parallel state (``(1, 1)`` before it
    is initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 1
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )


def transformer_config(
    config: ModelConfig,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
):
    """The megatron-core ``TransformerConfig`` for ``config`` (unfused, portable kernels) at
    the parallel state's tensor- and context-parallel sizes, with Megatron sequence parallelism
    if ``sequence_parallel`` (Megatron refuses it without tensor parallelism)."""
    spec = config.family_spec
    tp, cp = parallel_sizes()
    config.check_tensor_parallel(tp)
    recompute = {}
    if config.recompute == "full":
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    elif config.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    scale = None
    if config.query_pre_attn_scalar is not None:
        scale = config.query_pre_attn_scalar**-0.5
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.kv_heads,
        kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        normalization=spec.norm,
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=spec.gated_mlp,
        activation_func=_ACTIVATIONS[spec.activation],
        add_bias_linear=spec.linear_bias,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm == "per_head",
        softmax_scale=scale,
        hidden_dropout=config.hidden_dropout,
        attention_dropout=0.0,
        init_method_std=config.init_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=config.cpu_initialization,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )


def layer_spec(config: ModelConfig, layer_number: int) -> ModuleSpec:
    """Megatron's local GPT layer spec with Focus self-attention and the family's norms."""
    spec = config.family_spec
    layer = get_gpt_layer_local_spec(normalization=spec.norm)
    norm = TorchNorm  # Megatron's torch norm, usable under sequence parallelism
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    layer.submodules.self_attention = ModuleSpec(
        module=FocusSelfAttention,
        params={
            "attn_mask_type": AttnMaskType.causal,
            "focus": config.focus,
            "post_norm": norm if spec.post_norms else None,
            **_rope_params(config, layer_number),
        },
        submodules=type(layer.submodules.self_attention.submodules)(
            linear_qkv=ColumnParallelLinear,
            core_attention=_core_attention(config, layer_number),
            linear_proj=RowParallelLinear,
            q_layernorm=_qk_norm(spec, "q"),
            k_layernorm=_qk_norm(spec, "k"),
        ),
    )
    if not spec.pre_norms:  # norms after attention and MLP only (OLMo-2)
        layer.submodules.input_layernorm = IdentityOp
        layer.submodules.pre_mlp_layernorm = IdentityOp
    if spec.post_norms:
        mlp = layer.submodules.mlp
        layer.submodules.mlp = ModuleSpec(
            module=PostNormMLP, params={"post_norm": norm}, submodules=mlp.submodules
        )
    return layer


def _core_attention(config: ModelConfig, layer_number: int) -> partial:
    """Focus core attention of one layer: a family's local layer keeps its sliding window (no
    sinks); otherwise Focus, or the window-only ablation twin's window."""
    family_local = config.is_local_layer(layer_number)
    local_window = None
    if family_local:
        local_window = config.sliding_window - 1
    elif config.focus.enabled and config.focus.window_only:
        local_window = config.focus.window  # the sliding-window ablation twin
    return partial(
        FocusCoreAttention,
        focus=config.focus,
        softcap=config.attn_softcap,
        local_window=local_window,
        sinks=config.focus.sinks if config.focus.enabled and not family_local else 0,
    )


def _rope_params(config: ModelConfig, layer_number: int) -> dict:
    """The layer's own RoPE, given at construction: the model's base and scaling (per-token
    positions of packed documents), or a local layer's own unscaled base (Gemma-3); none for
    learned absolute positions."""
    if config.family_spec.positions != "rope":
        return {}
    local_base = config.local_rope_base if config.is_local_layer(layer_number) else None
    if local_base is not None:
        return {"local_rotary_base": local_base}
    return {"rotary_base": config.rotary_base, "rope_scaling": config.rope_scaling}


def _qk_norm(spec: Family, which: str) -> ModuleSpec | type:
    """One RMSNorm over all heads (OLMo-2), one per head (Qwen3, Gemma-3), or none."""
    if spec.qk_norm == "full_width":
        return ModuleSpec(module=FullWidthQKNorm, params={"which": which})
    if spec.qk_norm == "per_head":
        return PerHeadQKNorm
    return IdentityOp


def block_spec(config: ModelConfig) -> TransformerBlockSubmodules:
    """One layer spec per layer (Gemma interleaves local and global layers)."""
    specs = [layer_spec(config, n) for n in range(1, config.num_layers + 1)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TorchNorm)


def build_model(
    config: ModelConfig,
    params_dtype: torch.dtype = torch.float32,
    *,
    sequence_parallel: bool = False,
) -> GPTModel:
    """Build the ``GPTModel`` for ``config`` (parallel state must already be initialised).

    ``sequence_parallel``: Megatron sequence parallelism (needs tensor parallelism;
    ``parallel.sequence_parallel``). Its parameters tagged ``sequence_parallel`` need
    their gradients summed over the tensor-parallel group
    (:func:`focus_pretrain.parallel.sequence_parallel.reduce_sequence_parallel_grads`).
    """
    spec = config.family_spec
    model = GPTModel(
        config=transformer_config(config, params_dtype, sequence_parallel),
        transformer_layer_spec=block_spec(config),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_seq_length,
        position_embedding_type=spec.positions,
        rotary_base=config.rotary_base,
        share_embeddings_and_output_weights=config.tied,
    )
    if spec.positions == "learned_absolute":
        # megatron-core makes the learned position table a plain fp32 nn.Embedding whatever
        # params_dtype says; fp32 positions added to bf16 words would turn every activation
        # after them fp32 and fail in the first bf16 linear
        model.embedding.position_embeddings.to(dtype=params_dtype)
    if config.rope_scaling is not None:  # HF's exact scaled frequencies (any llama3 values)
        set_rope_frequencies(
            model.rotary_pos_emb, config.kv_channels, config.rotary_base, config.rope_scaling
        )
    if spec.scale_embeddings:
        model.embedding.register_forward_hook(_scale_embeddings(config.hidden_size**0.5))
    if config.final_softcap is not None:
        model.output_layer.register_forward_hook(_softcap_logits(config.final_softcap))
    return model


def _scale_embeddings(factor: float):
    """Embeddings multiplied by ``sqrt(hidden)`` (rounded to their dtype; Gemma)."""

    def hook(module, args, output):
        return output * torch.tensor(factor, dtype=output.dtype, device=output.device)

    return hook


def _softcap_logits(cap: float):
    """Final logit soft-capping (:func:`~focus_pretrain.focus.pattern.soft_cap`) on ``(logits,
    bias)`` (Gemma)."""

    def hook(module, args, output):
        logits, bias = output
        return soft_cap(logits, cap), bias

    return hook


def count_parameters(config: ModelConfig) -> dict[str, int]:
    """Parameter counts of ``config`` built on the meta device (no memory is allocated).

    Counts are of this rank's shards (at the initialised parallel state's tensor-parallel
    size). Returns ``{"total", "router", "without_router"}``.
    """
    with torch.device("meta"):
        model = build_model(config)
    router = sum(p.numel() for n, p in model.named_parameters() if ".router." in n)
    total = sum(p.numel() for p in model.parameters())
    return {"total": total, "router": router, "without_router": total - router}
