"""Configuration classes of exported Focus models (shipped inside the exported directory).

Each is the family's own ``transformers`` config plus a ``focus`` dict (the method's
hyperparameters); ``model_type`` is ``focus_<family>``. Standalone: imports only transformers.
"""

from __future__ import annotations

from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Olmo2Config,
    Qwen2Config,
    Qwen3Config,
)

FOCUS_DEFAULTS = {
    "enabled": True,
    "window_only": False,
    "num_groups": 8,
    "group_dim": 16,
    "window": 128,
    "tau": 0.1,
    "top_k": 1,
    "inference_mode": "hard",
    "gate_lambda": 10.0,
    "normalize": True,
    "backend": "auto",
    "inference_backend": "auto",
    "sinks": 0,
}


def _with_focus(self, focus, kwargs, base) -> None:
    self.focus = {**FOCUS_DEFAULTS, **(focus or {})}
    base.__init__(self, **kwargs)


class FocusGPT2Config(GPT2Config):
    model_type = "focus_gpt2"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, GPT2Config)


class FocusLlamaConfig(LlamaConfig):
    model_type = "focus_llama"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, LlamaConfig)


class FocusMistralConfig(MistralConfig):
    model_type = "focus_mistral"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, MistralConfig)


class FocusQwen2Config(Qwen2Config):
    model_type = "focus_qwen2"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, Qwen2Config)


class FocusOlmo2Config(Olmo2Config):
    model_type = "focus_olmo2"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, Olmo2Config)


class FocusGemma2Config(Gemma2Config):
    model_type = "focus_gemma2"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, Gemma2Config)


class FocusQwen3Config(Qwen3Config):
    model_type = "focus_qwen3"

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, Qwen3Config)


class FocusGemma3Config(Gemma3TextConfig):
    model_type = "focus_gemma3_text"  # the text-only Gemma-3 (HF model_type gemma3_text)

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, Gemma3TextConfig)
