"""A checkpoint's model, built in this process group: what evaluation, analysis and the
retrofit report load.

:func:`load_checkpoint_model` builds the Megatron model of a checkpoint at any tensor-parallel
size (shards are merged and re-cut, :func:`~focus_pretrain.checkpoint.read.megatron_state_dict`;
context parallelism installed when ``parallel.context_parallel_size > 1``), with overrides of
its recipe (another corpus, another inference pattern).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from focus_pretrain.checkpoint.read import (
    checkpoint_config,
    megatron_state_dict,
    resolve_checkpoint,
)
from focus_pretrain.config import Config
from focus_pretrain.data.datasets import tokenizer_path_for
from focus_pretrain.data.tokenizer import Tokenizer
from focus_pretrain.errors import InputError, MissingInputError
from focus_pretrain.model import build_model
from focus_pretrain.parallel.context_parallel import apply_context_parallel
from focus_pretrain.parallel.launch import ParallelLayout

__all__ = ["EvalModel", "load_checkpoint_model"]

# the model keys that decide which weights there are and their shapes (the others, RoPE's
# base, norms' epsilon, dropout, soft-capping, the Focus pattern, change no weight)
SHAPING_KEYS = frozenset(
    {
        "model.family",
        "model.num_layers",
        "model.hidden_size",
        "model.num_attention_heads",
        "model.num_query_groups",
        "model.ffn_hidden_size",
        "model.vocab_size",
        "model.head_dim",
        "model.tie_embeddings",
        "model.focus.num_groups",
        "model.focus.group_dim",
        "model.focus.enabled",  # routers present or not
        "model.focus.window_only",
    }
)


@dataclass
class EvalModel:
    """A checkpoint's model ready to evaluate.

    Attributes:
        model: the Megatron ``GPTModel`` (this rank's shard), in ``eval()`` mode.
        config: the resolved config (the checkpoint's, with the caller's overrides).
        tokenizer: the checkpoint's tokenizer, or ``None`` when its file is gone.
        device: where the model lives.
        layout: the process grid.
        checkpoint: the checkpoint directory.
    """

    model: torch.nn.Module
    config: Config
    tokenizer: Tokenizer | None
    device: torch.device
    layout: ParallelLayout
    checkpoint: Path


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def load_checkpoint_model(
    checkpoint: str | os.PathLike,
    overrides: Sequence[str] = (),
    *,
    need_tokenizer: bool = False,
    check: Callable[[Config], None] | None = None,
) -> EvalModel:
    """The model of ``checkpoint`` (a checkpoint or run directory) with ``overrides``
    (``section.key=value``) applied to its config.

    In a lone process the checkpoint's tensor and context parallelism default to 1 (pass
    ``parallel.*`` overrides and launch with ``torchrun`` to evaluate sharded). Data
    overrides keep the checkpoint's tokenizer unless ``data.tokenizer`` is given.
    ``need_tokenizer``: a tokenizer file that is gone is refused before the model is loaded;
    ``check``: called with the resolved config before the model is loaded (raises what the
    caller refuses).

    Raises:
        MissingInputError: no checkpoint there (the message says what a checkpoint is), or no
            tokenizer where ``need_tokenizer``.
        InputError: a bad override, or a checkpoint that does not fit the model.
    """
    ckpt = resolve_checkpoint(checkpoint)
    trained = checkpoint_config(ckpt)
    extra = list(overrides)
    if _world_size() == 1 and not any(o.strip().startswith("parallel.") for o in extra):
        extra = [
            "parallel.tensor_parallel_size=1",
            "parallel.context_parallel_size=1",
            "parallel.sequence_parallel=false",  # needs tensor parallelism
            *extra,
        ]
    if not any(o.strip().startswith("data.tokenizer=") for o in extra):
        token_file = tokenizer_path_for(trained.data, trained.run.seed)
        extra.append(f"data.tokenizer={token_file}")
    config = checkpoint_config(ckpt, extra)
    if need_tokenizer and not Path(config.data.tokenizer).exists():
        raise MissingInputError(
            f"the tokenizer {config.data.tokenizer} of {ckpt} is gone; pass "
            "--set data.tokenizer=PATH (the .model the run was trained with)"
        )
    if check is not None:
        check(config)
    layout = ParallelLayout.initialize(config.parallel, config.run.seed)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    state, _ = megatron_state_dict(ckpt, layout.tensor_parallel_size, tp_rank)
    focus = config.model.focus
    if not focus.enabled or focus.window_only:  # the trained model without its routers: dense
        state = {k: v for k, v in state.items() if ".router." not in k}  # (a retrofit's
        # original) or the window alone (the floor)
    dtype = torch.bfloat16 if config.train.precision == "bf16" and device.type == "cuda" else None
    model = build_model(config.model, sequence_parallel=config.parallel.sequence_parallel)
    if layout.context_parallel_group is not None:
        apply_context_parallel(model, layout.context_parallel_group, config.parallel.cp_mode)
    _load_weights(model, state, ckpt, trained, config)
    model.to(device=device, dtype=dtype).eval()
    token_file = Path(config.data.tokenizer)
    tokenizer = Tokenizer(token_file) if token_file.exists() else None
    return EvalModel(model, config, tokenizer, device, layout, ckpt)


def _load_weights(
    model: torch.nn.Module, state: dict, ckpt: Path, trained: Config, config: Config
) -> None:
    """``state`` into ``model``; a mismatch is refused naming the overrides that changed the
    architecture (or, with none, the checkpoint's own config)."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
        mismatch = None
    except RuntimeError as err:  # a tensor of another shape
        missing, unexpected, mismatch = [], [], str(err).splitlines()[-1].strip()
    missing = [k for k in missing if not k.endswith("_extra_state")]
    unexpected = [k for k in unexpected if not k.endswith("_extra_state")]
    if not (missing or unexpected or mismatch):
        return
    changed = _model_overrides(trained, config)
    if changed:
        named = ", ".join(f"{key}={new!r} (the checkpoint's: {old!r})" for key, old, new in changed)
        raise InputError(
            f"--set {named} changes the model's weights: a checkpoint loads only into the "
            "architecture it was trained with; drop the override (the inference pattern's "
            "keys may change: model.focus.top_k, .inference_mode, .sinks, .window...)"
        )
    what = mismatch or f"missing {missing[:5]}, unexpected {unexpected[:5]}"
    raise InputError(f"{ckpt} does not fit the model its config.yaml describes: {what}")


def _model_overrides(trained: Config, config: Config) -> list[tuple[str, object, object]]:
    """``(key, the checkpoint's value, the value now)`` of every ``model.*`` key the caller's
    overrides changed that may shape the weights (not the inference pattern's keys)."""
    from focus_pretrain.recipe_files import config_to_dict, flatten

    old = flatten(config_to_dict(trained.model), "model.")
    new = flatten(config_to_dict(config.model), "model.")
    shaping = set(SHAPING_KEYS)
    if config.model.family_spec.positions == "learned_absolute":  # a table of positions
        shaping.add("model.max_seq_length")
    return [
        (key, old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and key in shaping
    ]
