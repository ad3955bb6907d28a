"""The megatron-core model with Focus attention layers."""

from focus_pretrain.model.build import build_model, count_parameters
from focus_pretrain.model.config import FAMILIES, ModelConfig

__all__ = ["FAMILIES", "ModelConfig", "build_model", "count_parameters"]
