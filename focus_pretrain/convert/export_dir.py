"""What a directory must hold to be loaded as an export (``focus-pretrain export`` writes one:
``config.json``, the weights, the shipped modeling code its ``auto_map`` names and, when the
run had one, ``tokenizer.json``), checked before anything is loaded, so that a wrong path ends
in one line naming the fix; and the export's tokenizer, loaded without running remote code.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from focus_pretrain.errors import InputError, MissingInputError

EXPORT_HELP = "give a directory written by `focus-pretrain export RUN OUT`"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def read_export(
    path: str | os.PathLike, *, tokenizer: bool = False, focus: bool = False
) -> dict[str, Any]:
    """The ``config.json`` of the export at ``path``, once the directory is checked: it holds
    a config, weights and the code files its ``auto_map`` names; ``tokenizer``: also
    ``tokenizer.json``; ``focus``: the config has a ``focus`` section (a Focus model, not a
    plain HuggingFace one).

    Raises:
        MissingInputError: ``path`` or a file it must hold does not exist (a run or router
            adapter directory is named as such, with the command that exports it).
        InputError: ``path`` is a file, ``config.json`` is not a JSON object, or the model is
            not a Focus model where ``focus`` asks for one.
    """
    path = Path(path)
    if not path.exists():
        raise MissingInputError(f"{path} does not exist: {EXPORT_HELP}")
    if not path.is_dir():
        raise InputError(f"{path} is a file, not an export directory: {EXPORT_HELP}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise MissingInputError(f"{config_file} does not exist: {_not_an_export(path)}")
    config = read_json_object(config_file, "export again")
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise MissingInputError(
            f"{path} has no weights ({' or '.join(WEIGHT_FILES[:2])}): an incomplete export; "
            "export again"
        )
    code = sorted({f"{v.partition('.')[0]}.py" for v in (config.get("auto_map") or {}).values()})
    missing = [name for name in code if not (path / name).is_file()]
    if missing:
        raise MissingInputError(
            f"{path} lacks {', '.join(missing)}, the model code its config.json names: copy the "
            "whole export directory, or export again"
        )
    check_remote_code(path)
    if focus and not isinstance(config.get("focus"), dict):
        raise InputError(
            f"{path} is a HuggingFace model without a focus section in config.json, not a "
            f"Focus export: {EXPORT_HELP}"
        )
    if tokenizer and not (path / "tokenizer.json").is_file():
        raise MissingInputError(
            f"{path} has no tokenizer.json (exported with --no-tokenizer, or from a run whose "
            "tokenizer was not found): export again, with --tokenizer PATH if needed"
        )
    return config


def read_json_object(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json``).

    Raises:
        InputError: it is not valid JSON, or not an object; ``fix`` says what to do.
    """
    try:
        value = json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InputError(f"{path} is not valid JSON ({error}): {fix}") from error
    if not isinstance(value, dict):
        raise InputError(f"{path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value


def check_remote_code(path: str | os.PathLike) -> None:
    """The shipped ``.py`` files ``trust_remote_code`` runs are those the export wrote: their
    sha256 equal the ``remote_code_sha256`` of ``focus_export.json`` (an export from before
    that record, or without ``focus_export.json``, is not checked).

    Raises:
        InputError: a file differs (edited or replaced after the export) or is missing.
    """
    record_file = Path(path) / "focus_export.json"
    try:
        digests = json.loads(record_file.read_text()).get("remote_code_sha256") or {}
    except (OSError, ValueError, AttributeError):
        return
    for name, expected in sorted(digests.items()):
        code = Path(path) / name
        if not code.is_file():
            raise MissingInputError(f"{code} is missing (the export shipped it): export again")
        if hashlib.sha256(code.read_bytes()).hexdigest() != expected:
            raise InputError(
                f"{code} is not the file the export wrote (its sha256 differs from "
                f"{record_file}'s remote_code_sha256), and trust_remote_code would run it: "
                "export again; if you changed it on purpose, put its new sha256 there"
            )


def _not_an_export(path: Path) -> str:
    """What ``path`` (a directory without ``config.json``) is instead, and the fix."""
    if (path / "focus_adapter.json").is_file():
        return (
            f"{path} holds the routers alone (export --adapter-only), not a whole model: "
            "attach them to their base model (modeling_focus.attach_focus_adapter), or export "
            "the run without --adapter-only"
        )
    if any((path / name).exists() for name in ("config.yaml", "checkpoints", "latest")):
        return (
            f"{path} is a training run or checkpoint, not an export: export it first "
            f"(focus-pretrain export {path} OUT) and give OUT"
        )
    return EXPORT_HELP


def export_tokenizer(path: str | os.PathLike):
    """The export's tokenizer (``tokenizer.json`` with its ``tokenizer_config.json``) as a
    ``transformers`` fast tokenizer, without ``trust_remote_code``: ``AutoTokenizer`` would
    read ``config.json``, whose model type only the export's own code defines."""
    from transformers import PreTrainedTokenizerFast  # heavy; the callers load a model next

    return PreTrainedTokenizerFast.from_pretrained(Path(path))


INFERENCE_SETTINGS = (  # how an export infers; its other focus keys are what its routers learned
    "enabled",  # false: the original dense model (the routers unused)
    "window_only",
    "window",
    "sinks",
    "top_k",
    "key_groups",  # own: the method's rule, own_and_previous: a key in its predecessor's too
    "inference_mode",
    "inference_backend",  # hard mode's kernels
    "backend",  # soft mode's (the training backend)
)


def focus_overrides(
    focus: dict[str, Any],
    settings: Sequence[str],
    given: dict[str, Any] | None = None,
    named: str = "",
) -> dict[str, Any]:
    """The export's ``focus`` section with the overrides ``given`` by other options (``named``
    as the user wrote them, e.g. ``"--mode soft"``) and the ``KEY=VALUE`` ``settings``
    (``--focus top_k=2``, repeatable, the last one of a key wins) applied: the whole section
    to load the export with, checked by the rules its shipped code applies
    (``validate_focus``). ``true``/``false`` are flags, an optionally signed number of digits
    an integer, anything else a name.

    Raises:
        InputError: a setting without ``=``, a key that is not one of
            :data:`INFERENCE_SETTINGS`, or a value the shipped rules refuse.
    """
    from focus_pretrain.convert.hf_modeling.configuration_focus import (
        FOCUS_DEFAULTS,
        validate_focus,
    )

    overrides: dict[str, Any] = dict(given or {})
    for setting in settings:
        key, equals, text = (part.strip() for part in setting.partition("="))
        if not equals or not key or not text:
            raise InputError(f"--focus {setting!r}: give KEY=VALUE, e.g. --focus top_k=2")
        if key not in INFERENCE_SETTINGS:
            learned = " (what the routers were trained with)" if key in FOCUS_DEFAULTS else ""
            raise InputError(
                f"--focus {setting}: {key!r} is not an inference setting{learned}; choose "
                f"from {', '.join(INFERENCE_SETTINGS)}"
            )
        lowered = text.lower()
        if lowered in ("true", "false"):
            overrides[key] = lowered == "true"
        else:
            overrides[key] = int(text) if re.fullmatch(r"[-+]?[0-9]+", text) else text
    section = {**focus, **overrides}
    try:  # validate_focus is standalone (shipped): its ValueErrors are about the settings
        validate_focus({**FOCUS_DEFAULTS, **section})
    except ValueError as error:
        options = " ".join([named, *(f"--focus {s}" for s in settings)]).strip()
        raise InputError(f"{options}: {error}") from error
    return section
