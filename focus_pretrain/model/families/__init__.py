"""Model families as a registry: one module per family, each a declarative description.

A family module (``llama.py``, ``gemma2.py``, ...) builds a
:class:`~focus_pretrain.model.families.base.Family` (norms, biases, QK-norm, post-norms,
soft-caps, local/global layers, RoPE, embedding scaling, activation, tied default, the HF names,
key map and ``config.json`` mapping) and registers it. This package imports every module in it,
so a new family is one new file (plus its HF parity test); nothing else tests family names.

    family("gemma2").post_norms        # True
    hf_family("gemma3_text").name      # "gemma3"
"""

from __future__ import annotations

import importlib
import pkgutil

from focus_pretrain.model.families.base import REGISTRY, Family, LocalLayers, register

_SHARED = {"base", "keymap", "hf_config"}  # modules of shared machinery, not families
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _SHARED:
        importlib.import_module(f"{__name__}.{_module.name}")

# every family's name, in order of release (error messages and listings)
FAMILIES: tuple[str, ...] = tuple(
    sorted(REGISTRY, key=lambda name: (REGISTRY[name].released, name))
)


def family(name: str) -> Family:
    """The description of family ``name`` (``ValueError`` naming the known ones if none)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return REGISTRY[name]


def hf_family(model_type: str) -> Family | None:
    """The family whose HF ``model_type`` (or our name for it) is ``model_type``, or ``None``."""
    for description in REGISTRY.values():
        if model_type in (description.hf_model_type, description.name):
            return description
    return None


def hf_model_types() -> tuple[str, ...]:
    """The HF ``model_type`` of every family (sorted)."""
    return tuple(sorted(f.hf_model_type for f in REGISTRY.values()))


def refused_hf_model_types() -> dict[str, str]:
    """HF model types we recognise but refuse (every family's), with the reason."""
    return {k: v for f in REGISTRY.values() for k, v in f.hf_refused_model_types.items()}


__all__ = [
    "FAMILIES",
    "REGISTRY",
    "Family",
    "LocalLayers",
    "family",
    "hf_family",
    "hf_model_types",
    "refused_hf_model_types",
    "register",
]
