"""Validators of config values: each raises :class:`~focus_pretrain.errors.InputError` (a
``ValueError``) whose message names the dotted key, the rule and the value. Every config section
(Focus, model, parallel, data, the recipe) validates with these.
"""

from __future__ import annotations

import math

from focus_pretrain.errors import InputError


def check_int(
    name: str,
    value: object,
    *,
    low: int | None = None,
    high: int | None = None,
    high_name: str | None = None,
) -> None:
    """Raise :class:`InputError` naming ``name`` unless ``value`` is an int in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise InputError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        bound = f"{high_name} ({high})" if high_name else str(high)
        raise InputError(f"{name} must be <= {bound}, got {value}")


def check_positive(name: str, value: object) -> None:
    """Raise :class:`InputError` naming ``name`` unless ``value`` is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InputError(f"{name} must be a finite number > 0, got {value!r}")
    if value <= 0:
        raise InputError(f"{name} must be > 0, got {value}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise :class:`InputError` naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InputError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
