"""The description of a model family (:class:`Family`) and the registry that holds them.

Every family is one module of this package that builds a :class:`Family` and passes it to
:func:`register`; the package imports all its modules (:mod:`focus_pretrain.model.families`),
so adding a family is adding its file. Everything family-specific elsewhere (config
validation, the Megatron layer spec, HF import/export, the key maps) reads the description.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from focus_pretrain.model.families.keymap import LM_HEAD, Rule

if TYPE_CHECKING:
    from focus_pretrain.model.config import ModelConfig

NORMS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("silu", "gelu_tanh")  # SiLU (SwiGLU when gated), GELU with the tanh approximation
POSITIONS = ("rope", "learned_absolute")  # megatron-core's position_embedding_type names
QK_NORMS = (None, "per_head", "full_width")
LOCAL_FIELDS = ("sliding_window", "sliding_window_pattern")  # families with local layers
OPTIONAL_FIELDS = ("attn_softcap", "final_softcap", "query_pre_attn_scalar")


@dataclass(frozen=True)
class LocalLayers:
    """Interleaved sliding-window (local) and global layers: 1-based layer ``n`` is global iff
    ``n % pattern == 0`` (HF ``sliding_window_pattern``); ``model.sliding_window`` (required)
    is the keys a local layer sees.

    Attributes:
        default_pattern: the pattern when ``model.sliding_window_pattern`` is unset.
        fixed: the default is the family's only pattern (Gemma-2: 2).
        own_rope: local layers rotate with their own, never scaled, RoPE base
            (``model.local_rotary_base``, default ``rotary_base``; Gemma-3).
    """

    default_pattern: int
    fixed: bool = False
    own_rope: bool = False


@dataclass(frozen=True)
class Family:
    """Everything that sets one attention family apart, read by the rest of the code.

    Architecture (``model/build.py``, ``ModelConfig``'s validation):
        name: ``model.family``. released: first release (``YYYY-MM-DD``), the listing order.
        positions: ``rope`` or ``learned_absolute`` (GPT-2's table).
        norm: ``RMSNorm`` or ``LayerNorm``; pre_norms: norms before attention and MLP;
            post_norms: norms on their outputs before the residual add (OLMo-2, Gemma).
        activation: ``silu`` or ``gelu_tanh``; gated_mlp: ``[gate; up]`` GLU MLP.
        linear_bias: biases on every linear; qkv_bias: biases on Q/K/V.
        qk_norm: ``None``, ``per_head`` (one ``[head_dim]`` weight) or ``full_width`` (one norm
            over all heads, OLMo-2).
        multi_head_only: GQA refused (``num_query_groups`` must equal the heads).
        tied_embeddings: default of ``model.tie_embeddings``.
        scale_embeddings: embeddings multiplied by ``sqrt(hidden_size)`` (Gemma).
        local_layers: local/global layer layout (:class:`LocalLayers`), or ``None``.
        options: the optional ``ModelConfig`` fields of :data:`OPTIONAL_FIELDS` it takes
            (soft-caps: ``attn_softcap``, ``final_softcap``; ``query_pre_attn_scalar``).
        refused: ``ModelConfig`` field -> why this family refuses it (a specific message).

    HuggingFace (``convert/``, the shipped code); unset, Llama's
    (:meth:`_fill_llama_defaults`):
        hf_model_type, hf_config_class, hf_model_class: transformers' names; the shipped
            classes are ``Focus<hf_config_class>`` / ``Focus<hf_model_class>``.
        layer_rules, top_rules: the key map (:mod:`~focus_pretrain.model.families.keymap`;
            ``{i}``: layer), ``lm_head`` added for untied models.
        config_from_hf: ``config.json`` (transformers defaults filled in) -> ``ModelConfig``
            fields; raises ``ValueError`` on what we cannot reproduce.
        config_to_hf: ``ModelConfig`` -> the family's ``config.json`` fields (its inverse).
        hf_activation_key, hf_activations: the key the HF MLP reads and the values accepted.
        hf_router_prefix: where an export puts layer ``{i}``'s router tensors.
        hf_slides: whether transformers runs some layers of a checkpoint with a sliding window
            we do not reproduce (import warns); ``None``: never.
        hf_refused_model_types: HF model types of this family we refuse, and why.
    """

    name: str
    released: str
    hf_model_type: str = ""
    hf_config_class: str = ""
    hf_model_class: str = ""
    layer_rules: tuple[Rule, ...] = ()
    top_rules: tuple[Rule, ...] = ()
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    config_to_hf: Callable[[ModelConfig], dict[str, Any]] | None = None
    positions: str = "rope"
    norm: str = "RMSNorm"
    pre_norms: bool = True
    post_norms: bool = False
    activation: str = "silu"
    gated_mlp: bool = True
    linear_bias: bool = False
    qkv_bias: bool = False
    qk_norm: str | None = None
    multi_head_only: bool = False
    tied_embeddings: bool = False
    scale_embeddings: bool = False
    local_layers: LocalLayers | None = None
    options: frozenset[str] = frozenset()
    refused: Mapping[str, str] = field(default_factory=dict)
    hf_activation_key: str = "hidden_act"
    hf_activations: tuple[str, ...] = ("silu",)
    hf_router_prefix: str = "model.layers.{i}.self_attn.router."
    hf_slides: Callable[[dict[str, Any]], bool] | None = None
    hf_refused_model_types: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._fill_llama_defaults()
        for name, value, allowed in (
            ("positions", self.positions, POSITIONS),
            ("norm", self.norm, NORMS),
            ("activation", self.activation, ACTIVATIONS),
            ("qk_norm", self.qk_norm, QK_NORMS),
        ):
            if value not in allowed:
                raise ValueError(
                    f"family {self.name}: {name} must be one of {allowed}, got {value}"
                )
        unknown = set(self.options) - set(OPTIONAL_FIELDS)
        if unknown:
            raise ValueError(f"family {self.name}: unknown options {sorted(unknown)}")

    def _fill_llama_defaults(self) -> None:
        """What a family leaves unset is Llama's: HF names from the family's name
        (``model_type`` = name, stem = name capitalised, ``<stem>Config``,
        ``<stem>ForCausalLM``), Llama's key map, the Llama-style ``config.json`` mapping."""
        from focus_pretrain.model.families import hf_config  # it reads descriptions: no cycle
        from focus_pretrain.model.families.keymap import EMBEDDING, final_norm, llama_layer

        stem = self.name.capitalize()
        defaults = {
            "hf_model_type": self.name,
            "hf_config_class": f"{stem}Config",
            "hf_model_class": f"{stem}ForCausalLM",
            "layer_rules": llama_layer(),
            "top_rules": (EMBEDDING, final_norm()),
            "config_from_hf": lambda hf: hf_config.decoder_fields(hf, self),
            "config_to_hf": hf_config.decoder_hf_fields,
        }
        for name, default in defaults.items():
            if not getattr(self, name):
                object.__setattr__(self, name, default)  # frozen: set once, at construction

    @property
    def accepted_fields(self) -> frozenset[str]:
        """The family-only ``ModelConfig`` fields this family takes."""
        names = set(self.options)
        if self.local_layers is not None:
            names.update(LOCAL_FIELDS)
            if self.local_layers.own_rope:
                names.add("local_rotary_base")
        return frozenset(names)

    def rules(self, num_layers: int, tied: bool) -> list[Rule]:
        """Every rule of a ``num_layers`` model, layer placeholders expanded (``lm_head`` only
        when untied)."""
        rules = [*self.top_rules, *([] if tied else [LM_HEAD])]
        for i in range(num_layers):
            rules.extend(r.for_layer(i) for r in self.layer_rules)
        return rules


_REGISTRY: dict[str, Family] = {}
REGISTRY: Mapping[str, Family] = MappingProxyType(_REGISTRY)  # name -> description


def register(description: Family) -> Family:
    """Add a family to the registry (its module calls this at import); returns it."""
    known = _REGISTRY.get(description.name)
    if known is not None and known is not description:
        raise ValueError(f"family {description.name!r} is registered twice")
    for other in _REGISTRY.values():
        if other is not description and other.hf_model_type == description.hf_model_type:
            raise ValueError(f"HF model_type {description.hf_model_type!r} has two families")
    _REGISTRY[description.name] = description
    return description
