"""Loading a model to inspect: one of our checkpoints or an exported HuggingFace directory.

Ours go through :func:`focus_pretrain.checkpoint.model.load_checkpoint_model` (one process; the
model in ``eval()``, so layers run the inference pattern); an export through
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` (its shipped code; its
``tokenizer.json`` through :class:`~focus_pretrain.data.Tokenizer`, no remote code).
Either way the result says how to run a ``[b, s]`` token batch and the pattern's settings.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from focus_pretrain.checkpoint.model import load_checkpoint_model
from focus_pretrain.checkpoint.read import resolve_checkpoint
from focus_pretrain.convert.export_dir import read_export
from focus_pretrain.data import Tokenizer
from focus_pretrain.errors import MissingInputError

CHECKPOINT_HELP = (
    "pass a run directory (e.g. runs/tiny), a checkpoint directory "
    "(runs/tiny/checkpoints/step_00000800) or an exported HuggingFace directory "
    "(tools/convert_to_hf.py; it has config.json)"
)


@dataclass
class InspectedModel:
    """A model ready to run, with its pattern's settings.

    Attributes:
        kind: ``"checkpoint"`` (ours) or ``"hf-export"``.
        path: what was loaded.
        module: the model (its routers are hooked by
            :class:`~focus_pretrain.analysis.capture.RouterCapture`).
        run: runs a token batch ``[b, s]`` (int64, any device) through the model, no grad.
        tokenizer: the model's tokenizer (or the one passed), ``None`` when it has none.
        num_groups, window, top_k, sinks, key_groups: the hard pattern (``focus`` settings).
        inference_mode: the pattern the layers run in (``"hard"`` or ``"soft"``).
        max_length: the longest sequence the model takes.
        add_bos: ``data.add_bos`` of the run (an export: ``"auto"``): what a sample begins
            with, as the model's training documents did.
    """

    kind: str
    path: Path
    module: nn.Module
    run: Callable[[Tensor], None]
    tokenizer: Tokenizer | None
    num_groups: int
    window: int
    top_k: int
    sinks: int
    inference_mode: str
    max_length: int
    add_bos: bool | str = "auto"
    key_groups: str = "own"


def check_inspectable(path: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> str:
    """What :func:`load_for_inspection` would load at ``path``, checked without loading it:
    ``"hf-export"`` or ``"checkpoint"``.

    Raises:
        MissingInputError: ``path`` or ``tokenizer`` does not exist, or ``path`` is not a
            checkpoint or an export (or an incomplete export).
        InputError: an export that is not a Focus model.
    """
    path = Path(path)
    if not path.exists():
        raise MissingInputError(f"checkpoint {path} does not exist: {CHECKPOINT_HELP}")
    if tokenizer is not None and not Path(tokenizer).exists():
        raise MissingInputError(
            f"--tokenizer {tokenizer} does not exist: pass a SentencePiece .model file or a "
            "HuggingFace tokenizer directory (tokenizer.json)"
        )
    if (path / "config.json").is_file():
        read_export(path, focus=True)  # weights, code, a focus section
        return "hf-export"
    try:
        resolve_checkpoint(path)
    except MissingInputError as error:
        raise MissingInputError(f"{error}; {CHECKPOINT_HELP}") from error
    return "checkpoint"


def load_for_inspection(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = None,
    device: str | None = None,
    overrides: tuple[str, ...] = (),
) -> InspectedModel:
    """Load ``path``: an exported HF directory (``config.json``) or one of our checkpoints
    (a run or checkpoint directory; ``overrides`` apply to its config). ``tokenizer`` (a
    SentencePiece ``.model`` or an HF tokenizer directory) replaces the model's own.

    Raises:
        MissingInputError, InputError: what :func:`check_inspectable` refuses.
    """
    path = Path(path)
    if check_inspectable(path, tokenizer) == "hf-export":
        return _load_export(path, tokenizer, device)
    try:
        loaded = load_checkpoint_model(path, overrides)
    except MissingInputError as error:
        raise MissingInputError(f"{error}; {CHECKPOINT_HELP}") from error
    model, focus = loaded.model, loaded.config.model.focus
    if device is not None:
        model.to(device)
    target = next(model.parameters()).device

    def run(tokens: Tensor) -> None:
        tokens = tokens.to(target)
        positions = torch.arange(tokens.shape[1], device=target)[None].expand_as(tokens)  # [b, s]
        with torch.no_grad():
            model(tokens, positions, None)

    return InspectedModel(
        kind="checkpoint",
        path=loaded.checkpoint,
        module=model,
        run=run,
        tokenizer=Tokenizer(tokenizer) if tokenizer is not None else loaded.tokenizer,
        num_groups=focus.num_groups,
        window=focus.window,
        top_k=focus.top_k,
        sinks=getattr(focus, "sinks", 0),
        inference_mode=focus.inference_mode,
        max_length=loaded.config.model.max_seq_length,
        add_bos=loaded.config.data.add_bos,
        key_groups=getattr(focus, "key_groups", "own"),
    )


def _load_export(
    path: Path, tokenizer: str | os.PathLike | None, device: str | None
) -> InspectedModel:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # an export is self-contained
    from transformers import AutoModelForCausalLM  # heavy; only this path needs it

    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    model = model.to(device or "cpu").eval()
    config = model.config
    focus = config.focus  # read_export checked that config.json has one
    max_length = getattr(config, "max_position_embeddings", None) or config.n_positions
    if tokenizer is None and (path / "tokenizer.json").is_file():
        tokenizer = path
    target = next(model.parameters()).device

    def run(tokens: Tensor) -> None:
        with torch.no_grad():
            model(input_ids=tokens.to(target), use_cache=False)

    return InspectedModel(
        kind="hf-export",
        path=path,
        module=model,
        run=run,
        tokenizer=None if tokenizer is None else Tokenizer(tokenizer),
        num_groups=focus["num_groups"],
        window=focus["window"],
        top_k=focus["top_k"],
        sinks=focus.get("sinks", 0),
        inference_mode=focus.get("inference_mode", "hard"),
        max_length=int(max_length),
    )
