"""The ``model:`` section of a recipe: architecture and attention family.

Families (``model.family``) are described once each in :mod:`focus_pretrain.model.families`
(positions, norms, MLP, biases, QK-norm, local/global layers, soft-caps, embedding scaling,
tied default, the HF mapping); this module validates a recipe against its family's description.
Every RoPE family takes Llama-3.x (``llama3``) or ``linear`` RoPE scaling (:class:`RopeScaling`).

Validation happens at construction, before anything is allocated, and names the key. How the
model is split over devices is the ``parallel:`` section's (:mod:`focus_pretrain.parallel.config`);
the built model reads its tensor- and context-parallel sizes from Megatron's ``parallel_state``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from focus_pretrain.focus import FocusConfig
from focus_pretrain.model.families import FAMILIES, REGISTRY, Family, family
from focus_pretrain.model.rope import ROPE_SCALING_TYPES, RopeScaling
from focus_pretrain.validation import check_choice, check_int, check_positive

RECOMPUTE = ("none", "full", "selective")
__all__ = ["FAMILIES", "RECOMPUTE", "ROPE_SCALING_TYPES", "ModelConfig", "RopeScaling"]


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
        spec = self.family_spec
        if self.rope_scaling is not None and spec.positions != "rope":
            raise ValueError(
                f"model.rope_scaling is for RoPE families; {self.family} has learned absolute "
                "positions"
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
        if spec.multi_head_only and groups != heads:
            raise ValueError(
                "model.num_query_groups must equal model.num_attention_heads for "
                f"family {self.family} (multi-head attention)"
            )
        self._check_family_fields(spec)

    def _check_family_fields(self, spec: Family) -> None:
        """Fields only some families use (as their descriptions say), and a required window."""
        local = spec.local_layers
        if local is not None and self.sliding_window is None:
            raise ValueError(
                f"model.sliding_window is required for family {self.family} (e.g. 4096)"
            )
        pattern = self.sliding_window_pattern
        if local is not None and local.fixed and pattern not in (None, local.default_pattern):
            raise ValueError(
                f"model.sliding_window_pattern must be {local.default_pattern} for family "
                f"{self.family} (its only layout: every {local.default_pattern}-th layer global, "
                f"the others local), got {pattern}"
            )
        for name, why in spec.refused.items():
            if getattr(self, name) is not None:
                raise ValueError(f"model.{name} is not supported for family {self.family}: {why}")
        accepted = {f.name: f.accepted_fields for f in REGISTRY.values()}
        for name in sorted(set().union(*accepted.values())):
            if getattr(self, name) is not None and name not in spec.accepted_fields:
                users = [f for f in FAMILIES if name in accepted[f]]
                raise ValueError(
                    f"model.{name} is only used by family {'/'.join(users)}, "
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
    def family_spec(self) -> Family:
        """The family's description (:class:`~focus_pretrain.model.families.Family`)."""
        return family(self.family)

    @property
    def tied(self) -> bool:
        """Whether input and output embeddings are shared (``tie_embeddings`` or the family's
        default)."""
        if self.tie_embeddings is not None:
            return self.tie_embeddings
        return self.family_spec.tied_embeddings

    @property
    def local_global_pattern(self) -> int | None:
        """Every ``P``-th layer is global (``sliding_window_pattern`` or the family's default)
        in families with local layers; ``None`` for the others."""
        local = self.family_spec.local_layers
        if local is None:
            return None
        return self.sliding_window_pattern or local.default_pattern

    @property
    def local_rope_base(self) -> float | None:
        """The local layers' RoPE base (``local_rotary_base`` or ``rotary_base``) in families
        whose local layers have their own RoPE (Gemma-3); ``None`` for the others (every layer
        uses the model's RoPE)."""
        local = self.family_spec.local_layers
        if local is None or not local.own_rope:
            return None
        return self.local_rotary_base or self.rotary_base

    def is_local_layer(self, layer_number: int) -> bool:
        """Local/global interleaving: 1-based layer ``n`` is a sliding-window layer unless
        ``n % pattern == 0`` (Gemma-2: odd layers; Gemma-3: 5 of every 6)."""
        pattern = self.local_global_pattern
        return pattern is not None and layer_number % pattern != 0
