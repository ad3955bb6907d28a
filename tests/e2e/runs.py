"""Shared by the end-to-end tests: the small recipe, launching it, and reading what a run
wrote (``metrics.jsonl``, checkpoints), never its console."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import torch

from focus_pretrain.storage.safe_load import load_checkpoint_file
from focus_pretrain.train import read_metrics

ROOT = pathlib.Path(__file__).parents[2]
LAUNCHER = str(ROOT / "launchers" / "pretrain.py")
RECIPE = str(ROOT / "configs" / "tiny.yaml")
# generous: a bound against hangs, not a timing test (a loaded 2-core machine is slow)
TIMEOUT = int(os.environ.get("FOCUS_TEST_TIMEOUT", "1200"))
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=320",
    "model.max_seq_length=128",
    "model.focus.window=16",
    "model.focus.check_finite=true",  # the debugging knob is on in tests
    "data.seq_length=128",
    'data.sources=["demo:80"]',
    "data.vocab_size=300",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "train.warmup_steps=2",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.tensorboard=false",
]


def overrides(out: pathlib.Path, cache: str, *extra: str) -> list[str]:
    """The small recipe writing to ``out`` with its data cache in ``cache``."""
    return [*SMALL, f"run.output_dir={out}", f"data.cache_dir={cache}", *extra]


def script_args(sets: list[str], script: str = LAUNCHER) -> list[str]:
    """``script --config tiny.yaml --set ...`` (what follows ``python`` or a launcher)."""
    args = [script, "--config", RECIPE]
    for item in sets:
        args += ["--set", item]
    return args


def run(args: list[str], timeout: float = TIMEOUT, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args)`` capturing text output, in its own process group: on timeout
    the whole group is killed (a launcher's workers too, not only the launcher)."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def launch(sets: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``python launchers/pretrain.py`` with the tiny recipe and ``sets``."""
    return run([sys.executable, *script_args(sets)], **kwargs)


def train_losses(run: pathlib.Path) -> dict[int, float]:
    """Step -> training loss, from the run's ``metrics.jsonl`` (the last record of a step)."""
    records = read_metrics(run)  # a skipped bad step's record has no loss
    return {r["step"]: r["loss"] for r in records if r.get("split") == "train" and "loss" in r}


def train_steps_logged(run: pathlib.Path) -> list[int]:
    """Every step a ``train`` record was written for, in order (repeats included)."""
    return [r["step"] for r in read_metrics(run) if r.get("split") == "train"]


def events(run: pathlib.Path, name: str) -> list[dict]:
    """The run's ``start`` or ``end`` records, in order (one per launch)."""
    return [r for r in read_metrics(run) if r.get("event") == name]


def module_state(run: pathlib.Path, step: int) -> dict[str, torch.Tensor]:
    """The module weights of checkpoint ``step`` (tensor-parallel rank 0)."""
    path = run / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
    return load_checkpoint_file(path)["module"]  # with the allowlist, as every reader
