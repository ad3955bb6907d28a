"""The ``model:`` section of a recipe: architecture and attention family.

Families (each a real switch in the built model):

| family | positions | norm | MLP | biases | attention extras |
|---|---|---|---|---|---|
| ``gpt2`` | learned absolute | LayerNorm (pre) | GELU (tanh) | all linears | MHA, tied embeddings |
| ``llama``/``mistral`` | RoPE | RMSNorm (pre) | SwiGLU | none | GQA |
| ``qwen2`` | RoPE | RMSNorm (pre) | SwiGLU | Q/K/V only | GQA |
| ``olmo2`` | RoPE | RMSNorm *after* attention and MLP | SwiGLU | none | full-width QK-norm |
| ``qwen3`` | RoPE | RMSNorm (pre) | SwiGLU | none | GQA, per-head QK-norm |
| ``gemma2`` | RoPE | RMSNorm before *and* after | GeGLU (tanh) | none | local/global, caps |
| ``gemma3`` | RoPE, local base | as gemma2 | GeGLU (tanh) | none | as gemma2, QK-norm |

Gemma-2 and -3 also scale their input embeddings by ``sqrt(hidden)``; "caps" are logit soft-caps.
Every RoPE family takes Llama-3.x (``llama3``) or ``linear`` RoPE scaling (:class:`RopeScaling`).

Validation happens at construction, before anything is allocated, and names the key. How the
model is split over devices is the ``parallel:`` section's (:mod:`focus_pretrain.parallel.config`);
the built model reads its tensor- and context-parallel sizes from Megatron's ``parallel_state``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from focus_pretrain.focus import FocusConfig
from focus_pretrain.validation import check_choice, check_int, check_positive

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma2", "gemma3")
RECOMPUTE = ("none", "full", "selective")
GEMMA = ("gemma2", "gemma3")  # local/global layers, sandwich norms, soft-caps, scaled embeddings
QK_NORM_PER_HEAD = ("qwen3", "gemma3")
ROPE_SCALING_TYPES = ("llama3", "linear")
_LLAMA3_KEYS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# 1-based layer n is global iff n % pattern == 0 (HF ``sliding_window_pattern``)
DEFAULT_SLIDING_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, HuggingFace semantics (``rope_parameters`` of ``config.json``).

    The scaled inverse frequencies are computed as ``transformers`` computes them
    (``_compute_llama3_parameters``, ``_compute_linear_scaling_rope_parameters``) and written
    into the model's rotary embedding, so the logits equal the HF model's.

    Attributes:
        type: ``llama3`` (Llama-3.1/3.2: low frequencies divided by ``factor``, high ones kept,
            a smooth ramp between) or ``linear`` (every frequency divided by ``factor``).
        factor: the scaling factor (> 0; 1 leaves ``linear`` unchanged).
        low_freq_factor, high_freq_factor, original_max_position_embeddings: ``llama3`` only
            (required there): wavelengths above ``original / low_freq_factor`` are divided by
            ``factor``, those below ``original / high_freq_factor`` kept.
    """

    type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        check_choice("model.rope_scaling.type", self.type, ROPE_SCALING_TYPES)
        check_positive("model.rope_scaling.factor", self.factor)
        given = [k for k in _LLAMA3_KEYS if getattr(self, k) is not None]
        if self.type == "linear" and given:
            raise ValueError(
                f"model.rope_scaling.{given[0]} is only used by type llama3, got it for linear"
            )
        if self.type == "llama3":
            missing = [k for k in _LLAMA3_KEYS if getattr(self, k) is None]
            if missing:
                raise ValueError(
                    f"model.rope_scaling.{missing[0]} is required for type llama3 (Llama-3.1 "
                    "uses low_freq_factor 1, high_freq_factor 4, "
                    "original_max_position_embeddings 8192)"
                )
            check_positive("model.rope_scaling.low_freq_factor", self.low_freq_factor)
            check_positive("model.rope_scaling.high_freq_factor", self.high_freq_factor)
            check_int(
                "model.rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                low=1,
            )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"model.rope_scaling.high_freq_factor ({self.high_freq_factor}) must be > "
                    f"model.rope_scaling.low_freq_factor ({self.low_freq_factor})"
                )

    @classmethod
    def from_mapping(cls, values: Mapping) -> RopeScaling:
        """From a plain mapping (``ModelConfig(rope_scaling={...})``), unknown keys refused."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(allowed))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join('model.rope_scaling.' + k for k in unknown)}; "
                f"allowed keys: {', '.join(allowed)}"
            )
        return cls(**values)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the model.

    Attributes:
        family: one of :data:`FAMILIES`.
        num_query_groups: KV heads (GQA); ``None`` means ``num_attention_heads`` (MHA).
        head_dim: ``None`` means ``hidden_size / num_attention_heads`` (Gemma sets it).
        rope_scaling: RoPE frequency scaling (:class:`RopeScaling`, or a mapping of its
            fields); ``None``: plain RoPE. Gemma-3 applies it to its global layers only.
        tie_embeddings: ``None`` takes the family default (tied for gpt2, gemma2, gemma3).
        sliding_window: gemma2/gemma3 only: keys a local layer sees, HF semantics (``W`` keys
            including the token itself, i.e. a Focus window of ``W - 1``).
        sliding_window_pattern: gemma2/gemma3 only: 1-based layer ``n`` is global (Focus) iff
            ``n % pattern == 0``, the others are local; ``None``: 2 for gemma2 (layers 1, 3,
            5, ... local; the only pattern Gemma-2 has), 6 for gemma3 (five local, one global).
        local_rotary_base: gemma3 only: RoPE base of the local layers (HF
            ``rope_local_base_freq``; ``None``: ``rotary_base``); they are never scaled.
        attn_softcap: gemma2 attention-logit soft-capping (``None`` disables; transformers'
            Gemma-3 has none, whatever its config says).
        final_softcap: gemma2/gemma3 final-logit soft-capping (``None`` disables).
        query_pre_attn_scalar: gemma2/gemma3 attention scale ``query_pre_attn_scalar ** -0.5``.
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
    rope_scaling: RopeScaling | None = None
    norm_epsilon: float = 1e-5
    init_std: float = 0.02
    hidden_dropout: float = 0.0
    tie_embeddings: bool | None = None
    sliding_window: int | None = None
    sliding_window_pattern: int | None = None
    local_rotary_base: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    recompute: str = "none"
    cpu_initialization: bool = True
    focus: FocusConfig = field(default_factory=FocusConfig)

    def __post_init__(self) -> None:
        check_choice("model.family", self.family, FAMILIES)
        check_choice("model.recompute", self.recompute, RECOMPUTE)
        if isinstance(self.rope_scaling, Mapping):  # frozen: set through object.__setattr__
            object.__setattr__(self, "rope_scaling", RopeScaling.from_mapping(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"model.rope_scaling must be a mapping of RopeScaling fields, got "
                f"{self.rope_scaling!r}"
            )
        if self.rope_scaling is not None and self.family == "gpt2":
            raise ValueError(
                "model.rope_scaling is for RoPE families; gpt2 has learned absolute positions"
            )
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_length",
        ):
            check_int(f"model.{name}", getattr(self, name), low=1)
        for name in ("num_query_groups", "head_dim", "sliding_window", "sliding_window_pattern"):
            if getattr(self, name) is not None:
                check_int(f"model.{name}", getattr(self, name), low=1)
        for name in ("rotary_base", "norm_epsilon", "init_std"):
            check_positive(f"model.{name}", getattr(self, name))
        if not 0.0 <= self.hidden_dropout < 1.0:
            raise ValueError(f"model.hidden_dropout must be in [0, 1), got {self.hidden_dropout}")
        for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar", "local_rotary_base"):
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
        self._check_family_fields()

    def _check_family_fields(self) -> None:
        """Fields only some families use, and Gemma's required window."""
        if self.family in GEMMA and self.sliding_window is None:
            raise ValueError(
                f"model.sliding_window is required for family {self.family} (e.g. 4096)"
            )
        pattern = self.sliding_window_pattern
        if self.family == "gemma2" and pattern not in (None, 2):
            raise ValueError(
                f"model.sliding_window_pattern must be 2 for family gemma2 (alternating local and "
                f"global layers), got {pattern}"
            )
        if self.family == "gemma3" and self.attn_softcap is not None:
            raise ValueError(
                "model.attn_softcap is not supported for family gemma3: transformers' Gemma-3 "
                "does not soft-cap attention logits (its config's attn_logit_softcapping is "
                "ignored), so such a model could not be exported or match an imported one; "
                "remove it (family gemma2 soft-caps attention logits)"
            )
        only = {
            name: GEMMA for name in ("sliding_window", "sliding_window_pattern", "final_softcap")
        }
        only["query_pre_attn_scalar"] = GEMMA
        only["attn_softcap"] = ("gemma2",)
        only["local_rotary_base"] = ("gemma3",)
        for name, families in only.items():
            if getattr(self, name) is not None and self.family not in families:
                raise ValueError(
                    f"model.{name} is only used by family {'/'.join(families)}, "
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
        return self.family in ("gpt2", *GEMMA)

    @property
    def local_global_pattern(self) -> int | None:
        """Gemma: every ``P``-th layer is global (``sliding_window_pattern`` or the family's
        default); ``None`` for the other families (no local layers)."""
        if self.family not in GEMMA:
            return None
        return self.sliding_window_pattern or DEFAULT_SLIDING_WINDOW_PATTERN[self.family]

    @property
    def local_rope_base(self) -> float | None:
        """Gemma-3: the local layers' RoPE base (``local_rotary_base`` or ``rotary_base``);
        ``None`` for the other families (every layer uses the model's RoPE)."""
        if self.family != "gemma3":
            return None
        return self.local_rotary_base or self.rotary_base

    def is_local_layer(self, layer_number: int) -> bool:
        """Gemma interleaving: 1-based layer ``n`` is a sliding-window layer unless
        ``n % sliding_window_pattern == 0`` (Gemma-2: odd layers; Gemma-3: 5 of every 6)."""
        pattern = self.local_global_pattern
        return pattern is not None and layer_number % pattern != 0
