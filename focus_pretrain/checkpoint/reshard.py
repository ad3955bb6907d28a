"""Resharding: resume a checkpoint at another data-parallel size, tensor-parallel size or ZeRO
stage with the optimizer state kept, through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds each rank's optimizer partition (fp32 master weights, Adam moments) of
its tensor-parallel shard, so a plain resume needs the layout it was saved at. The universal
form holds every parameter whole: ``step_N/universal/zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``
(DeepSpeed's ``ds_to_universal`` merges ZeRO partitions and tensor-parallel shards into it),
and DeepSpeed's universal loading (``"checkpoint": {"load_universal": true}``) cuts each rank's
piece again at whatever layout the run has now.

What is ours:

* :func:`universal_checkpoint_info`: the merge rules the converter reads from every checkpoint
  (``UNIVERSAL_CHECKPOINT_INFO``), made from the tensor-parallel shard kinds of
  :mod:`focus_pretrain.model.tp_rules`. Megatron's fused QKV is laid out per KV group
  (``[q heads of g; k_g; v_g]``) and tensor parallelism gives each rank whole groups, so its
  shards concatenate along dim 0 like any column-parallel weight; the gated MLP's ``fc1`` is
  ``[gate; up]`` on every rank, DeepSpeed's "two sub-parameters along dim 0"; row-parallel
  weights concatenate along dim 1; norms and routers are replicated (the converter checks that
  every rank's copy is identical).
* :func:`convert_to_universal`: runs the converter on the checkpoint's own files into
  ``step_N/universal`` (written under a temporary name, renamed when complete), then makes the
  folder loadable at any ZeRO stage: every state file carries its full shape and merge rule
  (ZeRO-3 at TP=1 leaves flat tensors), the Adam step count is on every parameter (ZeRO-3 keeps
  it once), ``optimizer_state.pt`` has the fields of both optimizer families, the model-states
  files are there under both names (``mp_rank_*`` and ``zero_pp_rank_0_mp_rank_*``), and
  ``extras.pt`` holds what the optimizer does not (buffers such as the routers' balance offsets,
  frozen weights), whole.
* :func:`load_universal`: the engine's universal load, then the extras cut for this rank; and
  two repairs of DeepSpeed's ZeRO-3 loader: it gives every optimizer group the first group's
  hyperparameters (weight decay included; the recipe's are put back) and one shared Adam step
  tensor (which each group's update would then increment: every group gets its own).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from focus_pretrain.checkpoint.read import checkpoint_config
from focus_pretrain.config import Config
from focus_pretrain.errors import InputError
from focus_pretrain.model.config import ModelConfig
from focus_pretrain.model.tp_rules import COLUMN, GLU, REPLICATED, ROW, rules_for, shard, unshard
from focus_pretrain.storage.safe_load import (
    UnsafeCheckpointError,
    install_in_worker,
    load_checkpoint_file,
    weights_only_loading,
)

__all__ = [
    "EXTRAS_FILE",
    "STATES",
    "UNIVERSAL_DIR",
    "convert_to_universal",
    "declare_universal_info",
    "ensure_universal",
    "load_universal",
    "mark_tensor_parallel_layout",
    "shard_kinds",
    "universal_checkpoint_info",
    "universal_path",
]

UNIVERSAL_DIR = "universal"
EXTRAS_FILE = "extras.pt"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
_MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def shard_kinds(model: ModelConfig, names: list[str]) -> dict[str, str]:
    """How tensor parallelism splits each of ``names`` (our state-dict keys): the family's
    rule, or replicated for what no rule names (norms, routers, row-parallel biases)."""
    rules = {r.ours: r.shard for r in rules_for(model.family, model.num_layers, model.tied)}
    return {name: rules.get(name, REPLICATED) for name in names}


def universal_checkpoint_info(model: ModelConfig, names: list[str]) -> dict[str, Any]:
    """DeepSpeed's ``UNIVERSAL_CHECKPOINT_INFO`` for the parameters ``names``: one exact pattern
    per parameter (the converter refuses a pattern that matches nothing, so only parameters
    the optimizer holds may be named); column-parallel is its default and needs none."""
    from deepspeed.checkpoint import constants as c

    lists: dict[str, list[str]] = {REPLICATED: [], ROW: [], GLU: [], COLUMN: []}
    for name, kind in shard_kinds(model, names).items():
        lists[kind].append(re.escape(name) + "$")
    return {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.TP_REPLICATED_PARAMETER_PATTERNS: lists[REPLICATED],
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: lists[ROW],
        c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: lists[GLU],
    }


def declare_universal_info(engine, model: ModelConfig) -> None:
    """Make every checkpoint ``engine`` saves carry :func:`universal_checkpoint_info` (DeepSpeed
    writes the module's ``universal_checkpoint_info`` attribute into the model-states file)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    setattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, universal_checkpoint_info(model, names))


# -- the layout a checkpoint was saved at --------------------------------------------------------


# -- conversion ----------------------------------------------------------------------------------


def universal_path(checkpoint: Path) -> Path:
    """Where the universal form of ``checkpoint`` lives (inside it: pruned with it)."""
    return Path(checkpoint) / UNIVERSAL_DIR


def convert_to_universal(checkpoint: str | os.PathLike, workers: int | None = None) -> Path:
    """The universal form of ``checkpoint`` (a ``step_N`` directory), converted once: an
    existing complete ``step_N/universal`` is reused. ``workers``: processes extracting ZeRO
    fragments (merging uses half as many); ``None``: one for a checkpoint under 1 GiB (no
    process pool), else up to 8. Raises ``ValueError`` for a checkpoint without ZeRO (stage 0
    has no partitions to convert)."""
    from deepspeed.checkpoint import ds_to_universal

    ckpt = Path(checkpoint)
    out = universal_path(ckpt)
    if out.is_dir():
        return out
    config = checkpoint_config(ckpt)
    if config.parallel.zero_stage == 0:
        raise ValueError(
            f"{ckpt} was saved without ZeRO (parallel.zero_stage=0); train.load_universal "
            "converts ZeRO checkpoints (stages 1-3) only"
        )
    work = _scratch(ckpt)
    source = work / "source"  # the checkpoint's own files only (the converter walks subfolders)
    source.mkdir()
    for path in ckpt.iterdir():
        if path.is_file() and path.suffix == ".pt":
            _link_or_sanitize(path, source / path.name)
    if workers is None:
        size = sum(p.stat().st_size for p in ckpt.glob("*_optim_states.pt"))
        workers = 1 if size < 1 << 30 else min(8, os.cpu_count() or 1)
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(work / UNIVERSAL_DIR),
        num_extract_workers=workers,
        num_merge_workers=max(1, workers // 2),
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    with contextlib.redirect_stdout(sys.stderr), _weights_only_conversion(ckpt):
        ds_to_universal.main(args)  # its progress (stdout) is not our console's
    _complete(work / UNIVERSAL_DIR, ckpt, config)
    os.replace(work / UNIVERSAL_DIR, out)
    shutil.rmtree(work, ignore_errors=True)
    return out


SCRATCH_MARK = ".focus-pretrain-scratch"  # what makes a ``.tmp-universal`` ours to delete


def _scratch(ckpt: Path) -> Path:
    """An empty ``ckpt/.tmp-universal`` for a conversion, marked as ours. A leftover of an
    interrupted conversion (it holds the mark) is cleared; a directory of that name without
    the mark is someone else's: refused, untouched.

    Raises:
        InputError: naming the directory and the fix.
    """
    work = ckpt / ".tmp-universal"
    if work.exists():
        if not (work / SCRATCH_MARK).is_file():
            raise InputError(
                f"{work} exists but was not made by a focus-pretrain conversion; move it out "
                "of the checkpoint and convert again"
            )
        shutil.rmtree(work)
    work.mkdir()
    (work / SCRATCH_MARK).touch()
    return work


@contextlib.contextmanager
def _weights_only_conversion(ckpt: Path):
    """:func:`weights_only_loading` for DeepSpeed's converter, its worker processes included:
    its ``ProcessPoolExecutor`` forks them (Python's default on Linux up to 3.13: they inherit
    the state); a worker started otherwise (spawn, fork server) gets it from the initializer."""
    from deepspeed.checkpoint import ds_to_universal

    pool = ds_to_universal.ProcessPoolExecutor
    ds_to_universal.ProcessPoolExecutor = functools.partial(pool, initializer=install_in_worker)
    try:
        with weights_only_loading(ckpt):
            yield
    finally:
        ds_to_universal.ProcessPoolExecutor = pool


def _link_or_sanitize(path: Path, to: Path) -> None:
    """Link a checkpoint file into the converter's input; a ZeRO-1/2 model-states file is
    copied without the ``None`` entries of its module state (Megatron's ``_extra_state``),
    which the converter would try to turn into fp32 tensors."""
    if not path.name.startswith("mp_rank_"):
        to.symlink_to(path.resolve())
        return
    state = load_checkpoint_file(path)
    module = state.get("module") or {}
    state["module"] = {k: v for k, v in module.items() if v is not None}
    torch.save(state, to)


def _complete(out: Path, ckpt: Path, config: Config) -> None:
    """Make the converter's output loadable at every ZeRO stage (see the module docstring)."""
    zero = out / "zero"
    first = min(p for p in out.iterdir() if _MODEL_FILE.match(p.name))
    groups = load_checkpoint_file(first)["param_shapes"]
    shapes = {name: torch.Size(shape) for group in groups for name, shape in group.items()}
    step = _normalize_optimizer_state(zero / "optimizer_state.pt")
    sample = load_checkpoint_file(zero / next(iter(shapes)) / "fp32.pt")
    if not isinstance(sample, dict):  # ZeRO-3 at TP=1: flat tensors, and the shapes are whole
        kinds = shard_kinds(config.model, list(shapes))
        for name, shape in shapes.items():
            for state in STATES:
                _normalize_state(zero / name / f"{state}.pt", shape, kinds[name])
    for name in shapes:
        if not (zero / name / "step.pt").is_file():
            torch.save(step, zero / name / "step.pt")
    _model_states_under_both_names(out)
    torch.save(_extras(ckpt, set(shapes), config.model), out / EXTRAS_FILE)


def _normalize_state(path: Path, shape: torch.Size, kind: str) -> None:
    """One state file as a dict holding the full tensor and how tensor parallelism cuts it."""
    from deepspeed.checkpoint import constants as c

    state = load_checkpoint_file(path)
    tensor = state[c.PARAM] if isinstance(state, dict) else state
    meta = {c.PARAM: tensor.reshape(shape)}
    if kind in (COLUMN, ROW, GLU):
        meta[c.CAT_DIM] = 1 if kind == ROW else 0
    if kind == GLU:
        meta[c.PARAM_N_SUB_PARAMS] = 2
    if not isinstance(state, dict) or any(
        state.get(k) != v for k, v in meta.items() if k != c.PARAM
    ):
        torch.save(meta, path)


def _normalize_optimizer_state(path: Path):
    """``optimizer_state.pt`` readable by both optimizer families (ZeRO-1/2 read ``param_groups``
    and ``ds_version``; ZeRO-3 reads the step and groups under ``optimizer_state_dict``), without
    the rank-0 partitions a ZeRO-3 source leaves in it. Returns Adam's step count."""
    from deepspeed import __version__
    from deepspeed.checkpoint import constants as c

    state = load_checkpoint_file(path)
    inner = state.get(c.OPTIMIZER_STATE_DICT)
    if inner is not None:
        step = inner["state"][0]["step"]
    else:  # ZeRO-1/2: every parameter's folder has the step already
        first = next(p for p in path.parent.rglob("step.pt"))
        step = load_checkpoint_file(first)
    slim = {k: v for k, v in state.items() if k not in (c.OPTIMIZER_STATE_DICT, c.FP32_FLAT_GROUPS)}
    slim[c.OPTIMIZER_STATE_DICT] = {
        "state": {0: {"step": step}},
        "param_groups": state["param_groups"],
    }
    slim.setdefault(c.DS_VERSION, __version__)
    torch.save(slim, path)
    return step


def _model_states_under_both_names(out: Path) -> None:
    """DeepSpeed reads ``mp_rank_XX_model_states.pt`` at ZeRO-1/2 and
    ``zero_pp_rank_0_mp_rank_XX_model_states.pt`` at ZeRO-3: link each name to the other."""
    for path in list(out.iterdir()):
        match = _MODEL_FILE.match(path.name)
        if match is None or match.group(1) not in (None, "0"):
            continue  # ZeRO-3 files of data-parallel ranks > 0: never read when loading
        tp = match.group(2)
        zero3 = match.group(1) is not None
        other = out / (f"mp_rank_{tp}" if zero3 else f"zero_pp_rank_0_mp_rank_{tp}")
        other = other.with_name(other.name + "_model_states.pt")
        if not other.exists():
            os.link(path, other)


def _extras(ckpt: Path, optimized: set[str], model: ModelConfig) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state the optimizer does not hold (buffers, frozen weights),
    whole: merged over tensor-parallel ranks by the family's shard kinds. ZeRO-3 partitions
    frozen weights too; only then is the checkpoint consolidated for them."""
    files = sorted(
        (int(m.group(2)), p)
        for p in ckpt.iterdir()
        if (m := _MODEL_FILE.match(p.name)) and m.group(1) in (None, "0")
    )
    modules = [load_checkpoint_file(p)["module"] for _, p in files]
    names = [n for n, v in modules[0].items() if n not in optimized and torch.is_tensor(v)]
    if any(modules[0][n].numel() == 0 for n in names):
        from focus_pretrain.checkpoint.read import megatron_state_dict

        state, _ = megatron_state_dict(ckpt, tp_size=1, tp_rank=0)
        return {n: state[n].clone() for n in names}
    kinds = shard_kinds(model, names)
    return {n: unshard([m[n] for m in modules], kinds[n]).clone() for n in names}


def ensure_universal(checkpoint: Path, is_main: bool) -> Path:
    """Convert ``checkpoint`` on rank 0 (once), the other ranks waiting; every rank returns the
    universal folder. A failed conversion fails every rank (its error is broadcast; a refused
    checkpoint file stays an :class:`UnsafeCheckpointError`)."""
    error: list = [None]
    if is_main:
        try:
            convert_to_universal(checkpoint)
        except Exception as err:
            error = [(isinstance(err, UnsafeCheckpointError), f"{type(err).__name__}: {err}")]
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        unsafe, message = error[0]
        failed = f"converting {checkpoint} to a universal checkpoint failed: {message}"
        raise UnsafeCheckpointError(failed) if unsafe else RuntimeError(failed)
    return universal_path(checkpoint)


def mark_tensor_parallel_layout(module: nn.Module, model: ModelConfig) -> None:
    """Tell DeepSpeed's ZeRO-3 universal loader how each parameter is cut over tensor-parallel
    ranks (it reads a per-parameter attribute; without it, it would give each rank a piece of
    the whole tensor instead of its own shard)."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    params = dict(module.named_parameters())
    tp = dist.get_world_size(_tp_group()) if dist.is_initialized() else 1
    for name, kind in shard_kinds(model, list(params)).items():
        param = params[name]
        full = list(getattr(param, "ds_shape", param.shape))
        if kind == REPLICATED:
            meta: dict[str, Any] = {"replicated": True, "partition_dim": None}
        else:
            dim = 1 if kind == ROW else 0
            full[dim] *= tp
            meta = {"partition_dim": dim, "logical_shape": full}
            if kind == GLU:
                meta["sub_param_sizes"] = [full[0] // 2, full[0] // 2]
        setattr(param, DS_AUTOTP_UC_META, meta)


def _tp_group():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


@contextlib.contextmanager
def _deepspeed_tp_group():
    """Megatron's tensor-parallel group in DeepSpeed's own registry while loading: its ZeRO-3
    universal loader asks that registry, which only DeepSpeed's AutoTP fills (an ``mpu`` does
    not)."""
    from deepspeed.utils import groups

    if groups._TENSOR_MODEL_PARALLEL_GROUP is not None:
        yield
        return
    groups._TENSOR_MODEL_PARALLEL_GROUP = _tp_group()
    try:
        yield
    finally:
        groups._TENSOR_MODEL_PARALLEL_GROUP = None


def load_universal(engine, folder: Path, config: Config) -> dict[str, Any]:
    """Load the universal checkpoint ``folder`` into ``engine`` at this run's layout; returns
    the client state (step, consumed samples, RNG states of the saved rank this one maps to)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]
    zero3_tp = config.parallel.zero_stage == 3 and config.parallel.tensor_parallel_size > 1
    if zero3_tp:
        mark_tensor_parallel_layout(engine.module, config.model)
    previous = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True  # what {"checkpoint": {"load_universal"}} sets
    try:
        tp_group = _deepspeed_tp_group() if zero3_tp else contextlib.nullcontext()
        with tp_group, weights_only_loading(folder):
            path, client_state = engine.load_checkpoint(str(folder.parent), tag=folder.name)
    finally:
        engine._config.load_universal_checkpoint = previous
        if zero3_tp:
            from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

            for param in engine.module.parameters():
                if hasattr(param, DS_AUTOTP_UC_META):
                    delattr(param, DS_AUTOTP_UC_META)
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load the universal checkpoint {folder}")
    for group, saved in zip(engine.optimizer.param_groups, groups, strict=True):
        group.update(saved)  # the recipe's weight decay, betas, eps, names
    for state in engine.optimizer.optimizer.state.values():  # the wrapped torch optimizer
        if torch.is_tensor(state.get("step")):
            # ZeRO-3's loader gives every group the same step tensor, which Adam then
            # increments once per group and step (wrong bias correction after the first group)
            state["step"] = state["step"].clone()
    _load_extras(engine.module, folder / EXTRAS_FILE, config.model)
    return client_state


def _load_extras(module: nn.Module, path: Path, model: ModelConfig) -> None:
    """Copy the whole buffers and frozen weights of ``extras.pt``, cut for this rank."""
    from megatron.core import parallel_state

    extras = load_checkpoint_file(path)
    rank = parallel_state.get_tensor_model_parallel_rank()
    size = parallel_state.get_tensor_model_parallel_world_size()
    targets = dict(module.named_parameters()) | dict(module.named_buffers())
    kinds = shard_kinds(model, list(extras))
    with torch.no_grad():
        for name, full in extras.items():
            if name not in targets:
                continue
            piece = shard(full, kinds[name], rank, size)
            target = targets[name]
            if hasattr(target, "ds_tensor"):  # ZeRO-3 partition of a frozen weight
                _copy_partition(target, piece)
            else:
                target.copy_(piece.to(target.dtype))


def _copy_partition(param: nn.Parameter, piece: torch.Tensor) -> None:
    """This data-parallel rank's ZeRO-3 partition of ``piece`` (flat, zero-padded), and the
    gathered copy too where ZeRO-3 keeps one (small, "persistent" parameters)."""
    part = param.ds_tensor
    rank = dist.get_rank(group=param.ds_process_group)
    flat = piece.reshape(-1).to(part.dtype)
    start = rank * part.numel()
    chunk = flat[start : start + part.numel()]
    part.data.zero_()
    part.data[: chunk.numel()].copy_(chunk)
    if param.data.numel() == piece.numel():
        param.data.copy_(piece.reshape(param.data.shape))
