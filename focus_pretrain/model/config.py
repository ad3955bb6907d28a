"""The ``model:`` section of a recipe: architecture and attention family.

Families (each a real switch in the built model):

| family | positions | norm | MLP | biases | attention extras |
|---|---|---|---|---|---|
| ``gpt2`` | learned absolute | LayerNorm (pre) | GELU (tanh) | all linears | MHA, tied embeddings |
| ``llama``/``mistral`` | RoPE | RMSNorm (pre) | SwiGLU | none | GQA |
| ``qwen2`` | RoPE | RMSNorm (pre) | SwiGLU | Q/K/V only | GQA |
| ``olmo2`` | RoPE | RMSNorm *after* attention and MLP | SwiGLU | none | full-width QK-norm |
| ``gemma2`` | RoPE | RMSNorm before *and* after | GeGLU (tanh) | none | local/global, caps |

Gemma-2 also scales its input embeddings by ``sqrt(hidden)``; "caps" are logit soft-caps.

Validation happens at construction, before anything is allocated, and names the key. How the
model is split over devices is the ``parallel:`` section's (:mod:`focus_pretrain.parallel.config`);
the built model reads its tensor- and context-parallel sizes from Megatron's ``parallel_state``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from focus_pretrain.focus import FocusConfig
from focus_pretrain.focus.config import check_choice, check_int, check_positive

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "olmo2", "gemma2")
RECOMPUTE = ("none", "full", "selective")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the model.

    Attributes:
        family: one of :data:`FAMILIES`.
        num_query_groups: KV heads (GQA); ``None`` means ``num_attention_heads`` (MHA).
        head_dim: ``None`` means ``hidden_size / num_attention_heads`` (Gemma-2 sets it).
        tie_embeddings: ``None`` takes the family default (tied for gpt2 and gemma2).
        sliding_window: gemma2 only: keys a local layer sees, HF semantics (``W`` keys
            including the token itself, i.e. a Focus window of ``W - 1``); layers 1, 3, 5, ...
            (1-based) are local, the others global (Focus).
        attn_softcap, final_softcap: gemma2 logit soft-capping (``None`` disables).
        query_pre_attn_scalar: gemma2 attention scale ``query_pre_attn_scalar ** -0.5``.
        hidden_dropout: dropout on the attention and MLP outputs (attention-probability
            dropout is not supported by Focus attention).
        recompute: activation recompute ``none``, ``full`` (every layer) or ``selective``
            (core attention).
        cpu_initialization: build weights on the CPU from one master copy (exact across TP
            sizes); ``False`` initialises on the GPU.
    """

    family: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    ffn_hidden_size: int = 128
    vocab_size: int = 256
    max_seq_length: int = 512
    head_dim: int | None = None
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    tie_embeddings: bool | None = None
    sliding_window: int | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    recompute: str = "none"
    cpu_initialization: bool = True
    focus: FocusConfig = field(default_factory=FocusConfig)

    def __post_init__(self) -> None:
        check_choice("model.family", self.family, FAMILIES)
        check_choice("model.recompute", self.recompute, RECOMPUTE)
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_length",
        ):
            check_int(f"model.{name}", getattr(self, name), low=1)
        for name in ("num_query_groups", "head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                check_int(f"model.{name}", getattr(self, name), low=1)
        for name in ("rotary_base", "norm_epsilon", "init_std"):
            check_positive(f"model.{name}", getattr(self, name))
        if not 0.0 <= self.hidden_dropout < 1.0:
            raise ValueError(f"model.hidden_dropout must be in [0, 1), got {self.hidden_dropout}")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar"):
            if getattr(self, name) is not None:
                check_positive(f"model.{name}", getattr(self, name))
        heads, groups = self.num_attention_heads, self.kv_heads
        if self.head_dim is None and self.hidden_size % heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({heads}) (or set model.head_dim)"
            )
        if heads % groups:
            raise ValueError(
                f"model.num_attention_heads ({heads}) must be divisible by "
                f"model.num_query_groups ({groups})"
            )
        if self.family == "gpt2" and groups != heads:
            raise ValueError(
                "model.num_query_groups must equal model.num_attention_heads for "
                "family gpt2 (multi-head attention)"
            )
        if self.family == "gemma2" and self.sliding_window is None:
            raise ValueError("model.sliding_window is required for family gemma2 (e.g. 4096)")
        if self.family != "gemma2":
            for name in (
                "sliding_window",
                "attn_softcap",
                "final_softcap",
                "query_pre_attn_scalar",
            ):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"model.{name} is only used by family gemma2, "
                        f"got it for family {self.family!r}"
                    )

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise ``ValueError`` unless the heads and KV heads split over ``tp`` ranks."""
        for name, count in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_query_groups", self.kv_heads),
        ):
            if count % tp:
                raise ValueError(
                    f"model.{name} ({count}) must be divisible by "
                    f"parallel.tensor_parallel_size ({tp})"
                )

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def tied(self) -> bool:
        if self.tie_embeddings is not None:
            return self.tie_embeddings
        return self.family in ("gpt2", "gemma2")

    def is_local_layer(self, layer_number: int) -> bool:
        """Gemma-2 interleaving: 1-based odd layers are sliding-window layers."""
        return self.family == "gemma2" and layer_number % 2 == 1
