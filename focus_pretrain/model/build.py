"""``build_model(config)``: a megatron-core ``GPTModel`` whose self-attention is Focus.

Work in progress (issue 3): the GQA/RoPE/RMSNorm/SwiGLU family (Llama, Mistral) is built here;
the GPT-2, Qwen2, OLMo-2 and Gemma-2 switches, meta-device counting and recipe files follow.
Megatron's parallel state must be initialised by the caller (and, without CUDA,
:func:`focus_pretrain.parallel.apply_cpu_shim` applied first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from focus_pretrain.focus import FocusConfig
from focus_pretrain.focus.config import check_choice, check_int
from focus_pretrain.model.attention import FocusCoreAttention, FocusSelfAttention

FAMILIES = ("llama",)
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the model (the ``model:`` section of a recipe)."""

    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    max_seq_length: int = 512
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False
    tensor_parallel_size: int = 1
    recompute: str = "none"
    focus: FocusConfig = field(default_factory=FocusConfig)

    def __post_init__(self) -> None:
        check_choice("model.family", self.family, FAMILIES)
        check_choice("model.recompute", self.recompute, RECOMPUTE)
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_length",
            "tensor_parallel_size",
        ):
            check_int(f"model.{name}", getattr(self, name), low=1)
        heads, groups, tp = (
            self.num_attention_heads,
            self.num_query_groups,
            self.tensor_parallel_size,
        )
        if self.hidden_size % heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({heads})"
            )
        if heads % groups:
            raise ValueError(
                f"model.num_attention_heads ({heads}) must be divisible by "
                f"model.num_query_groups ({groups})"
            )
        if heads % tp or groups % tp:
            raise ValueError(
                f"model.num_attention_heads ({heads}) and model.num_query_groups "
                f"({groups}) must be divisible by model.tensor_parallel_size ({tp})"
            )


def transformer_config(config: ModelConfig, params_dtype: torch.dtype = torch.float32):
    """The megatron-core ``TransformerConfig`` for ``config`` (unfused, portable kernels)."""
    recompute = (
        {}
        if config.recompute == "none"
        else dict(
            recompute_granularity=config.recompute,
            **(
                {"recompute_method": "uniform", "recompute_num_layers": 1}
                if config.recompute == "full"
                else {"recompute_modules": ["core_attn"]}
            ),
        )
    )
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        ffn_hidden_size=config.ffn_hidden_size,
        tensor_model_parallel_size=config.tensor_parallel_size,
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=config.init_std,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        **recompute,
    )


def focus_layer_spec(config: ModelConfig) -> ModuleSpec:
    """Megatron's local GPT layer spec with ``self_attention`` swapped for Focus."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    attention = spec.submodules.self_attention
    spec.submodules.self_attention = ModuleSpec(
        module=FocusSelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "focus": config.focus},
        submodules=type(attention.submodules)(
            linear_qkv=ColumnParallelLinear,
            core_attention=partial(FocusCoreAttention, focus=config.focus),
            linear_proj=RowParallelLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    )
    return spec


def build_model(config: ModelConfig, params_dtype: torch.dtype = torch.float32) -> GPTModel:
    """Build the ``GPTModel`` (parallel state must already be initialised)."""
    return GPTModel(
        config=transformer_config(config, params_dtype),
        transformer_layer_spec=focus_layer_spec(config),
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_seq_length,
        position_embedding_type="rope",
        rotary_base=config.rotary_base,
        share_embeddings_and_output_weights=config.tie_embeddings,
    )
