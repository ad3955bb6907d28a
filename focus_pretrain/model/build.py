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

from focus_pretrain.model.attention import FocusCoreAttention, FocusSelfAttention
from focus_pretrain.model.config import GEMMA, QK_NORM_PER_HEAD, ModelConfig
from focus_pretrain.model.layers import FullWidthQKNorm, PerHeadQKNorm, PostNormMLP, TorchNorm
from focus_pretrain.model.rope import set_rope_frequencies

_RMS = ("llama", "mistral", "qwen2", "qwen3", "olmo2", *GEMMA)


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
    family = config.family
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
        normalization=_normalization(config),
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=family != "gpt2",
        activation_func=partial(F.gelu, approximate="tanh")
        if family in ("gpt2", *GEMMA)
        else F.silu,
        add_bias_linear=family == "gpt2",
        add_qkv_bias=family in ("gpt2", "qwen2"),
        qk_layernorm=family in QK_NORM_PER_HEAD,
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
    family = config.family
    spec = get_gpt_layer_local_spec(normalization=_normalization(config))
    norm = TorchNorm  # Megatron's torch norm, usable under sequence parallelism
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm  # also post-norms
    local_window = None
    if config.is_local_layer(layer_number):
        local_window = config.sliding_window - 1
    elif config.focus.enabled and config.focus.window_only:
        local_window = config.focus.window  # the sliding-window ablation twin
    family_local = config.is_local_layer(layer_number)  # the family's window: no sinks
    core = partial(
        FocusCoreAttention,
        focus=config.focus,
        softcap=config.attn_softcap,
        local_window=local_window,
        sinks=config.focus.sinks if config.focus.enabled and not family_local else 0,
    )
    post_norm = family in ("olmo2", *GEMMA)
    local_rotary_base = None  # Gemma-3's local layers: their own, unscaled RoPE
    if config.is_local_layer(layer_number):
        local_rotary_base = config.local_rope_base  # None for gemma2 (one RoPE)
    spec.submodules.self_attention = ModuleSpec(
        module=FocusSelfAttention,
        params={
            "attn_mask_type": AttnMaskType.causal,
            "focus": config.focus,
            "post_norm": norm if post_norm else None,
            "local_rotary_base": local_rotary_base,
        },
        submodules=type(spec.submodules.self_attention.submodules)(
            linear_qkv=ColumnParallelLinear,
            core_attention=core,
            linear_proj=RowParallelLinear,
            q_layernorm=_qk_norm(family, "q"),
            k_layernorm=_qk_norm(family, "k"),
        ),
    )
    if family == "olmo2":  # norms after attention and MLP only
        spec.submodules.input_layernorm = IdentityOp
        spec.submodules.pre_mlp_layernorm = IdentityOp
    if post_norm:
        mlp = spec.submodules.mlp
        spec.submodules.mlp = ModuleSpec(
            module=PostNormMLP, params={"post_norm": norm}, submodules=mlp.submodules
        )
    return spec


def _qk_norm(family: str, which: str) -> ModuleSpec | type:
    """OLMo-2: one RMSNorm over all heads; Qwen3, Gemma-3: one per head; others: none."""
    if family == "olmo2":
        return ModuleSpec(module=FullWidthQKNorm, params={"which": which})
    if family in QK_NORM_PER_HEAD:
        return PerHeadQKNorm
    return IdentityOp


def block_spec(config: ModelConfig) -> TransformerBlockSubmodules:
    """One layer spec per layer (Gemma interleaves local and global layers)."""
    specs = [layer_spec(config, n) for n in range(1, config.num_layers + 1)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TorchNorm)


def _normalization(config: ModelConfig) -> str:
    return "RMSNorm" if config.family in _RMS else "LayerNorm"


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
    model = GPTModel(
        config=transformer_config(config, params_dtype, sequence_parallel),
        transformer_layer_spec=block_spec(config),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_seq_length,
        position_embedding_type="learned_absolute" if config.family == "gpt2" else "rope",
        rotary_base=config.rotary_base,
        share_embeddings_and_output_weights=config.tied,
    )
    if config.family == "gpt2":
        # megatron-core makes the learned position table a plain fp32 nn.Embedding whatever
        # params_dtype says; fp32 positions added to bf16 words would turn every activation
        # after them fp32 and fail in the first bf16 linear
        model.embedding.position_embeddings.to(dtype=params_dtype)
    if config.rope_scaling is not None:  # HF's exact scaled frequencies (any llama3 values)
        set_rope_frequencies(
            model.rotary_pos_emb, config.kv_channels, config.rotary_base, config.rope_scaling
        )
    rotary = getattr(model, "rotary_pos_emb", None)
    for module in model.modules():  # per-token RoPE positions of packed documents
        if isinstance(module, FocusSelfAttention):
            module.__dict__["model_rotary"] = rotary  # a reference, not a submodule
    if config.family in GEMMA:
        model.embedding.register_forward_hook(_scale_embeddings(config.hidden_size**0.5))
        if config.final_softcap is not None:
            model.output_layer.register_forward_hook(_softcap_logits(config.final_softcap))
    return model


def _scale_embeddings(factor: float):
    """Gemma multiplies the embeddings by ``sqrt(hidden)`` (rounded to their dtype)."""

    def hook(module, args, output):
        return output * torch.tensor(factor, dtype=output.dtype, device=output.device)

    return hook


def _softcap_logits(cap: float):
    """Gemma's final logit soft-capping ``cap * tanh(logits / cap)`` on ``(logits, bias)``."""

    def hook(module, args, output):
        logits, bias = output
        return cap * torch.tanh(logits / cap), bias

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
