"""Recipe files: YAML read (a shipped recipe by name, ``defaults:`` bases merged), dotted
``section.key=value`` overrides, typed dataclasses built from the result with errors that name
the dotted key, and the resolved config written atomically. Generic: the recipe's sections and
their checks are in :mod:`focus_pretrain.config` (which re-exports these names).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from focus_pretrain.errors import InputError
from focus_pretrain.storage.files import write_atomic

# the recipes shipped inside the package (``configs/`` of a source checkout links here)
RECIPES_DIR = Path(__file__).resolve().parent / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """Name (``tiny``) -> path of each recipe shipped with the package."""
    return {path.stem: path for path in sorted(RECIPES_DIR.glob("*.yaml"))}


def _shipped_recipe(name: str | os.PathLike) -> Path | None:
    """The shipped recipe a bare name (``tiny`` or ``tiny.yaml``, no directory) names."""
    path = Path(name)
    if len(path.parts) != 1:
        return None
    return shipped_recipes().get(path.name.removesuffix(".yaml"))


def resolve_recipe(path: str | os.PathLike) -> Path:
    """``path`` when it is a file or names a directory; else a shipped recipe of that name
    (``tiny`` or ``tiny.yaml``): ``--config tiny`` works from any directory and any install."""
    given = Path(path)
    return given if given.is_file() else _shipped_recipe(given) or given


def read_recipe(path: Path, including: tuple[Path, ...]) -> dict[str, Any]:
    """The sections of the recipe at ``path``, on top of its base recipes: a top-level
    ``defaults:`` names one or a list (paths relative to the recipe, else to the working
    directory, else a shipped recipe's name), merged in order, then the recipe's own
    sections, section by section (a nested mapping merges key by key; any other value replaces
    the base's)."""
    if not path.is_file():
        names = ", ".join(shipped_recipes())
        raise FileNotFoundError(
            f"config file {path} does not exist; give a recipe's path or a shipped recipe's "
            f"name ({names}; `focus-pretrain recipes` describes them)"
        )
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise InputError(f"{path} is not valid YAML: {err}".replace("\n", " ")) from err
    if loaded is None:  # a mistake (a wrong or truncated file), not "every default"
        raise ValueError(
            f"recipe {path} is empty: give a recipe with its sections (see configs/*.yaml)"
        )
    if not isinstance(loaded, dict):
        raise ValueError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
    tree = loaded
    bases = tree.pop("defaults", None)
    if bases is None:
        return tree
    if not isinstance(bases, (str, list)) or not all(isinstance(b, str) for b in _listed(bases)):
        raise ValueError(f"{path}: defaults must be a recipe path or a list of them")
    merged: dict[str, Any] = {}
    for base in _listed(bases):
        candidates = [path.parent / base, Path(base), _shipped_recipe(base) or Path(base)]
        # a recipe named like its base (retrofit.yaml on `defaults: retrofit.yaml`) is not it
        found = next((c for c in candidates if c.is_file() and c.resolve() != path.resolve()), None)
        if found is None:
            raise FileNotFoundError(f"{path}: its defaults recipe {base} does not exist")
        if found.resolve() in including or found.resolve() == path.resolve():
            raise ValueError(f"{path}: defaults include {found} in a cycle")
        base_tree = read_recipe(found, (*including, path.resolve()))
        merged = _merged(merged, base_tree)
    return _merged(merged, tree)


def _listed(value: str | list) -> list:
    return [value] if isinstance(value, str) else value


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``: mappings merge key by key, other values replace."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


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
    try:
        return cls(**kwargs)
    except ValueError as err:  # its own validation: keys named as the recipe spells them
        qualified = _qualify(str(err), section, allowed)
        if qualified == str(err):
            raise
        kind = type(err) if type(err) in (ValueError, InputError) else ValueError
        raise kind(qualified) from err


def _qualify(message: str, section: str, keys: Sequence[str]) -> str:
    """``message`` of a nested section's own validation with its ``keys`` spelled from the
    recipe's top: ``focus.top_k`` -> ``model.focus.top_k`` for ``section="model.focus"``
    (a section validates itself under its own name; the recipe nests it). Only a whole key
    name not inside a path, a dotted name or a quoted value is rewritten."""
    local = section.rsplit(".", 1)[-1]
    if local == section or not keys:
        return message
    names = "|".join(re.escape(key) for key in sorted(keys, key=len, reverse=True))
    pattern = rf"(?<![\w./'\"]){re.escape(local)}\.({names})\b(?![.\w/])"
    return re.sub(pattern, rf"{section}.\1", message)


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """``value`` as type ``tp`` (dataclass, Optional/Union, bool, int, float, str, list,
    ``dict[str, Any]``: a mapping kept as YAML data)."""
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
    if tp is Any or tp is object:
        return value
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ValueError(f"{key} must be a mapping, got {value!r}")
        return {str(k): v for k, v in value.items()}
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


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and ``None`` stay values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_to_dict(config: Any) -> dict[str, Any]:
    """The resolved config as plain YAML-ready data (every default filled in)."""
    return dataclasses.asdict(config)


def save_config(config: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config to ``path`` as YAML, atomically and durably (a temporary file,
    fsynced, renamed, the directory fsynced), with the umask's mode."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, yaml.safe_dump(config_to_dict(config), sort_keys=False))
