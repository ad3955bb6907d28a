"""Configuration classes of exported Focus models (shipped inside the exported directory).

Each is the family's own ``transformers`` config plus a ``focus`` dict (the method's
hyperparameters); ``model_type`` is ``focus_<family>``. Standalone: imports only transformers
(and ``packaging``, which transformers requires).

**Which transformers.** This code runs in the user's environment, with whatever ``transformers``
is installed there. :data:`TESTED_TRANSFORMERS` is the range it is tested with (CI runs the
export tests at both ends of it, with and without ``focus_pretrain``); an export records it in
its ``config.json`` (``focus_transformers``), and loading the export under a version outside the
recorded range warns once (:class:`FocusTransformersVersionWarning`). Below
:data:`REQUIRED_TRANSFORMERS` it is known not to run (transformers 4 lacks the v5 attention,
mask and cache interfaces): importing this module then raises ``ImportError``.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.specifiers import SpecifierSet
from packaging.version import Version

TESTED_TRANSFORMERS = ">=5.0,<5.25"  # pyproject.toml declares the same range (tested)
REQUIRED_TRANSFORMERS = "5.0"


class FocusTransformersVersionWarning(UserWarning):
    """The installed transformers is outside the range the export's code was tested with."""


def _require_transformers() -> None:
    installed = Version(transformers.__version__)
    if installed.release < Version(REQUIRED_TRANSFORMERS).release:
        raise ImportError(
            f"this Focus model's code needs transformers >= {REQUIRED_TRANSFORMERS} (tested: "
            f"{TESTED_TRANSFORMERS}), but transformers {transformers.__version__} is installed: "
            f"pip install 'transformers{TESTED_TRANSFORMERS}'"
        )


_require_transformers()

from transformers import (  # noqa: E402 (after the version check: older releases lack some)
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


_WARNED: set[tuple[str, str]] = set()  # (installed version, tested range) already warned about


def check_transformers_version(tested: str | None = None) -> bool:
    """Whether the installed transformers is in ``tested`` (a version specifier such as
    ``">=5.0,<5.25"``; default :data:`TESTED_TRANSFORMERS`); outside it, warns once per process
    (:class:`FocusTransformersVersionWarning`) naming the version and the range."""
    tested = tested or TESTED_TRANSFORMERS
    installed = transformers.__version__
    if SpecifierSet(tested).contains(Version(installed), prereleases=True):
        return True
    if (installed, tested) not in _WARNED:
        _WARNED.add((installed, tested))
        warnings.warn(
            f"transformers {installed} is outside the range this Focus model's code was tested "
            f"with ({tested}); it may work, but its logits and generation are unchecked there. "
            f"If anything fails, install a tested version: pip install 'transformers{tested}'",
            FocusTransformersVersionWarning,
            stacklevel=3,
        )
    return False


def export_record() -> dict[str, str]:
    """What an export writes into ``config.json`` as ``focus_transformers``: the tested range
    and the transformers version that wrote it."""
    return {"tested": TESTED_TRANSFORMERS, "exported_with": transformers.__version__}


def _with_focus(self, focus, kwargs, base) -> None:
    """``focus``: the method's settings over :data:`FOCUS_DEFAULTS`. ``focus_transformers``
    (in ``kwargs``): :func:`export_record` of the export this config is loaded from, checked
    against the installed transformers; ``None`` for a config built in code."""
    self.focus = {**FOCUS_DEFAULTS, **(focus or {})}
    self.focus_transformers = kwargs.pop("focus_transformers", None)
    check_transformers_version((self.focus_transformers or {}).get("tested"))
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
