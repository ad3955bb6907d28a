"""The megatron-core model with Focus attention layers (work in progress: see build.py)."""

from focus_pretrain.model.build import ModelConfig, build_model

__all__ = ["ModelConfig", "build_model"]
