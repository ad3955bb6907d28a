"""Recipes: YAML validated into typed dataclasses, with dotted command-line overrides.

``load_config("configs/7b.yaml", ["run.output_dir=runs/x", "model.focus.window=256"])`` reads the
YAML, applies each ``section.key=value`` override (values parsed as YAML scalars), and builds the
typed :class:`Config`. Unknown keys, wrong types and bad values fail before any work, naming the
dotted key and what is allowed. :func:`save_config` writes the resolved config (every default
filled in) into run and checkpoint directories.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from focus_pretrain.data.datasets import DataConfig
from focus_pretrain.focus.config import check_int
from focus_pretrain.model.config import ModelConfig, check_cp_seq_length
from focus_pretrain.train.config import ParallelConfig, TrainConfig


@dataclass(frozen=True)
class RunConfig:
    """Where and how a run lives.

    Attributes:
        name: a label for logs.
        output_dir: run directory (resolved config, checkpoints, TensorBoard events).
        seed: the base random seed.
    """

    name: str = "focus"
    output_dir: str = "runs/focus"
    seed: int = 1234

    def __post_init__(self) -> None:
        if not self.output_dir:
            raise ValueError("run.output_dir must be a non-empty path")
        check_int("run.seed", self.seed, low=0)


@dataclass(frozen=True)
class Config:
    """A whole recipe: ``run``, ``model`` (with ``model.focus``), ``data``, ``train``,
    ``parallel``. ``model.tensor_parallel_size``, ``model.context_parallel_size`` and
    ``model.cp_mode`` are filled from ``parallel``."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        for key in _FROM_PARALLEL:
            if getattr(self.model, key) != getattr(self.parallel, key):
                raise ValueError(
                    f"model.{key} ({getattr(self.model, key)}) differs from parallel.{key} "
                    f"({getattr(self.parallel, key)}); set only parallel.{key}"
                )
        check_cp_seq_length(self.data.seq_length, self.parallel.context_parallel_size)
        if self.model.max_seq_length < self.data.seq_length:
            raise ValueError(
                f"model.max_seq_length ({self.model.max_seq_length}) must be >= "
                f"data.seq_length ({self.data.seq_length})"
            )


_FROM_PARALLEL = ("tensor_parallel_size", "context_parallel_size", "cp_mode")


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> Config:
    """Load ``path`` (YAML; ``None`` for all defaults), apply ``overrides``, validate.

    Raises:
        FileNotFoundError: the recipe does not exist.
        ValueError: a bad override, key, type or value (the message names the dotted key).
    """
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist (see configs/*.yaml)")
        loaded = yaml.safe_load(path.read_text())
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
        tree = loaded or {}
    for override in overrides:
        apply_override(tree, override)
    # one source of truth for TP and CP: the parallel section feeds the model's validation
    parallel = tree.get("parallel")
    if isinstance(parallel, dict):
        model = tree.setdefault("model", {})
        for key in _FROM_PARALLEL:
            if key in parallel and isinstance(model, dict):
                model.setdefault(key, parallel[key])
    return from_mapping(Config, tree, section="")


def apply_override(tree: dict[str, Any], override: str) -> None:
    """Set ``a.b.c=value`` in the nested mapping ``tree`` (value parsed as a YAML scalar)."""
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ValueError(f"override {override!r} must look like section.key=value")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            dotted = ".".join(parts[: depth + 1])
            raise ValueError(f"override {override!r}: {dotted} is a value, not a section")
        node = child
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def from_mapping(cls: type, values: Mapping[str, Any], section: str) -> Any:
    """Build dataclass ``cls`` from ``values``, recursively, checking keys and types.

    ``section`` is the dotted prefix used in error messages (``""`` at the top level).
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"{section or 'config'} must be a mapping, got {values!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        names = ", ".join(_join(section, key) for key in unknown)
        raise ValueError(f"unknown key(s) {names}; allowed keys: {', '.join(allowed)}")
    hints = typing.get_type_hints(cls)
    kwargs = {
        name: _coerce(hints[name], value, _join(section, name)) for name, value in values.items()
    }
    return cls(**kwargs)


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """``value`` as type ``tp`` (dataclass, Optional/Union, bool, int, float, str, list)."""
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, key)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(option, value, key)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(errors[0] if len(errors) == 1 else f"{key}: {'; '.join(errors)}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{key} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads "3e-4" (no dot) as a string
    if tp is str and isinstance(value, str):
        return value
    raise ValueError(f"{key} must be {getattr(tp, '__name__', tp)}, got {value!r}")


def config_to_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain YAML-ready data (every default filled in)."""
    return dataclasses.asdict(config)


def save_config(config: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config to ``path`` as YAML, atomically (temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=f".{path.name}.", delete=False
    ) as tmp:
        tmp.write(text)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)
    return path
