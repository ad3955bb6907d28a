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

import math
import warnings

import torch
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

# The families: not listed here. ``Focus<Base>`` (``FocusLlamaConfig``) is generated on first
# use (:func:`__getattr__`) as a subclass of transformers' ``<Base>`` with the ``focus`` dict and
# model_type ``focus_<its model_type>``; modeling_focus.py does the same for the causal LMs. An
# export's ``auto_map`` names the classes of its family (focus_pretrain's family description
# names the base classes), so a new family needs no line in the shipped code.

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
    "gate_form": "sigmoid",
    "normalize": True,
    "backend": "auto",
    "inference_backend": "auto",
    "sinks": 0,
    "key_groups": "own",
}


# The values the shipped code accepts: FocusConfig's rules (focus_pretrain/focus/config.py),
# copied because this file must load without the package (a test checks the two agree).
FOCUS_INT_RANGES = {  # name: (low, high or the name of the field bounding it, or None)
    "num_groups": (1, 64),  # hard membership is an int64 bitmask, one bit per group
    "group_dim": (1, None),
    "window": (0, None),
    "top_k": (1, "num_groups"),
    "sinks": (0, None),
}
FOCUS_POSITIVE = ("tau", "gate_lambda")
FOCUS_FLAGS = ("enabled", "window_only", "normalize")
FOCUS_CHOICES = {
    "inference_mode": ("hard", "soft"),
    "gate_form": ("sigmoid", "dot"),
    # FocusConfig's names plus "dense": this code's own masked dense path (forced)
    "backend": ("auto", "reference", "flex", "triton", "dense"),
    "inference_backend": ("auto", "reference", "decomposed", "flex", "triton", "dense"),
    "key_groups": ("own", "own_and_previous"),
}
# the backends that compute key_groups="own_and_previous": the package's reference and flex
# (what "auto" picks from) and this code's own dense path (a test checks them against the
# registry)
KEY_GROUPS_BACKENDS = ("auto", "reference", "flex", "dense")


def validate_focus(focus: dict) -> None:
    """Raise ``ValueError`` naming the key, the rule and the value unless ``focus`` holds exactly
    the Focus settings (:data:`FOCUS_DEFAULTS`' keys) with valid values."""
    unknown = sorted(set(focus) - set(FOCUS_DEFAULTS), key=str)
    if unknown:
        raise ValueError(
            f"unknown focus key(s) {', '.join(map(str, unknown))}; allowed keys: "
            f"{', '.join(FOCUS_DEFAULTS)}"
        )
    missing = [name for name in FOCUS_DEFAULTS if name not in focus]
    if missing:
        raise ValueError(f"focus lacks {', '.join(missing)}")
    for name in FOCUS_FLAGS:
        if not isinstance(focus[name], bool):
            raise ValueError(f"focus.{name} must be true or false, got {focus[name]!r}")
    for name, (low, high) in FOCUS_INT_RANGES.items():
        value = focus[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"focus.{name} must be an integer, got {value!r}")
        if value < low:
            raise ValueError(f"focus.{name} must be >= {low}, got {value}")
        bound = focus[high] if isinstance(high, str) else high
        if bound is not None and value > bound:
            named = f"{high} ({bound})" if isinstance(high, str) else str(bound)
            raise ValueError(f"focus.{name} must be <= {named}, got {value}")
    for name in FOCUS_POSITIVE:
        value = focus[name]
        number = not isinstance(value, bool) and isinstance(value, int | float)
        if not number or not math.isfinite(value) or value <= 0:
            raise ValueError(f"focus.{name} must be a finite number > 0, got {value!r}")
    for name, choices in FOCUS_CHOICES.items():
        if focus[name] not in choices:
            raise ValueError(
                f"focus.{name} must be one of {', '.join(map(repr, choices))}; got {focus[name]!r}"
            )
    _validate_focus_backends(focus)


def _validate_focus_backends(focus: dict) -> None:
    """The inference backends that compute one pattern only, and the rule of the keys' groups
    (the sigmoid gate, and the backends that compute it)."""
    if focus["key_groups"] != "own":
        if focus["gate_form"] != "sigmoid":
            raise ValueError(
                f"focus.key_groups={focus['key_groups']!r} needs focus.gate_form='sigmoid', "
                f"got {focus['gate_form']!r}; set key_groups='own' or gate_form='sigmoid'"
            )
        takes = ", ".join(map(repr, KEY_GROUPS_BACKENDS))
        for key in ("backend", "inference_backend"):
            if focus[key] not in KEY_GROUPS_BACKENDS:
                raise ValueError(
                    f"focus.{key} {focus[key]!r} does not compute focus.key_groups="
                    f"{focus['key_groups']!r}; use one of {takes}"
                )
    backend, mode, top_k = focus["inference_backend"], focus["inference_mode"], focus["top_k"]
    if backend == "decomposed" and (top_k != 1 or mode != "hard"):
        raise ValueError(
            "focus.inference_backend 'decomposed' computes hard top-1 attention only, got "
            f"top_k={top_k}, inference_mode={mode!r}; use 'auto' or 'flex'"
        )
    if backend == "triton" and mode != "soft" and top_k != 1:
        raise ValueError(
            "focus.inference_backend 'triton' computes the soft pattern and hard top-1 "
            f"attention only, got top_k={top_k}, inference_mode={mode!r}; use 'auto' or 'flex'"
        )


_VALID_FOCUS: set[tuple] = set()  # settings already validated (checked again on any change)


def checked_focus(focus: dict) -> dict:
    """``focus`` after :func:`validate_focus`, run once per distinct content: the model checks
    its settings at each call, so an edit after loading (``model.config.focus["top_k"] = 0``)
    is refused instead of silently running another pattern. Under ``torch.compile`` the
    settings are validated as traced (the graph's guards retrace on any change), without the
    cache, whose hashing some torch versions' dynamo does not trace (2.11)."""
    if torch.compiler.is_compiling():
        validate_focus(focus)
        return focus
    try:
        snapshot = tuple(sorted(focus.items(), key=lambda item: str(item[0])))
        hash(snapshot)
    except TypeError:  # an unhashable value: invalid anyway
        snapshot = None
    if snapshot is None or snapshot not in _VALID_FOCUS:
        validate_focus(focus)
        if snapshot is not None:
            _VALID_FOCUS.add(snapshot)
    return focus


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
    self.focus = checked_focus({**FOCUS_DEFAULTS, **(focus or {})})
    self.focus_transformers = kwargs.pop("focus_transformers", None)
    check_transformers_version((self.focus_transformers or {}).get("tested"))
    base.__init__(self, **kwargs)


def _focus_config_class(base: type) -> type:
    """``Focus<base>``: the family's config class ``base`` plus the ``focus`` dict."""

    def __init__(self, focus: dict | None = None, **kwargs) -> None:
        _with_focus(self, focus, kwargs, base)

    name = f"Focus{base.__name__}"
    namespace = {
        "model_type": f"focus_{base.model_type}",
        "__init__": __init__,
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": f"{base.__name__} with the Focus settings (``focus``).",
    }
    return type(base)(name, (base,), namespace)


# the classes made by this run of the module: fresh when transformers runs the module again
# (another export's code under the same module name), so no class of an earlier run is reused;
# an earlier run's classes left in the namespace (older code set them there) are removed
_MADE: dict[str, type] = {}
for _stale in [n for n in globals() if n.startswith("Focus") and n.endswith("Config")]:
    del globals()[_stale]


def focus_config_class(base_name: str) -> type:
    """``Focus<base_name>``: transformers' config class ``base_name`` (``"LlamaConfig"``) with
    the ``focus`` dict, made once per run of this module (the same class on every call)."""
    name = f"Focus{base_name}"
    if name not in _MADE:
        base = getattr(transformers, base_name, None)
        if not (
            isinstance(base, type)
            and issubclass(base, transformers.PretrainedConfig)
            and getattr(base, "model_type", "")  # a family's config, not the base class
        ):
            raise AttributeError(
                f"{__name__} has no {name}: transformers {transformers.__version__} has no "
                f"model family config class {base_name}"
            )
        _MADE[name] = _focus_config_class(base)
    return _MADE[name]


def __getattr__(name: str) -> type:
    """``Focus<X>Config`` for any transformers config class ``<X>Config`` (PEP 562: what an
    export's ``auto_map`` and ``from configuration_focus import FocusLlamaConfig`` ask for)."""
    if name.startswith("Focus") and name.endswith("Config") and name != "FocusConfig":
        return focus_config_class(name.removeprefix("Focus"))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
