"""Mistral: Llama's architecture; transformers slides its window over every layer when
``sliding_window`` is set, which Focus's window and groups replace (the import warns)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from focus_pretrain.model.families.base import Family, register
from focus_pretrain.model.families.hf_config import decoder_hf_fields

if TYPE_CHECKING:
    from focus_pretrain.model.config import ModelConfig


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    """Mistral ``config.json`` fields: an export attends without HF's sliding window."""
    return {**decoder_hf_fields(config), "sliding_window": None}


MISTRAL = register(
    Family(
        name="mistral",
        released="2023-09-27",
        config_to_hf=config_to_hf,
        hf_slides=lambda hf: hf.get("sliding_window") is not None,
    )
)
