"""Training throughput of whole recipes on this machine (``tools/measure_mfu.py``).

For each recipe the real trainer (:class:`~focus_pretrain.train.Trainer`, what
``launchers/pretrain.py`` runs) trains ``steps`` optimizer steps in a child process of its own
(``python -m focus_pretrain.bench.training --child``), so that one recipe's failure (a CUDA
out-of-memory error, a crash, a timeout) becomes a row with its error and the next recipe still
runs on a clean device. The child logs every ``log_interval`` steps to ``metrics.jsonl``
(:class:`~focus_pretrain.train.metrics.MetricsLogger`); the parent reads that file, drops the
first ``warmup_intervals`` intervals (data loader start, ``torch.compile`` of the attention
kernels, allocator growth) and combines the rest over their wall time:

* tokens/s: tokens of the kept steps over their time;
* TFLOP/s per device and MFU: the run's own figures
  (:func:`~focus_pretrain.train.metrics.flops_per_sample`: matmul FLOPs, forward x 3, attention
  over the causal pairs it computes; MFU against ``train.peak_tflops`` or the GPU's dense bf16
  peak, e.g. 989 for an H100), time-weighted. ``mfu_full_attention`` is the same time counted
  with attention over all ``s^2`` pairs (the torchtitan/nanoGPT convention), for comparisons;
* peak memory: the largest ``peak_mem_gb`` the run logged (``max_memory_allocated`` on a GPU,
  the process's peak resident memory on CPU), and the allocator's peak reservation;
* loss: the mean training loss of the first and of the last interval.

The measurement turns off what is not training throughput: validation (``eval_interval=0``),
TensorBoard, periodic checkpoints, and the trainer's final checkpoint (the child skips it: a 1B
model's would write ~17 GB). Each recipe's run directory (``output_dir/<recipe stem>``) keeps
its resolved ``config.yaml``, ``metrics.jsonl`` and the child's console in ``train.log``.
CPU runs are smoke tests, not figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from focus_pretrain.bench.report import markdown
from focus_pretrain.config import Config, load_config
from focus_pretrain.storage.files import check_output_dir
from focus_pretrain.train.metrics import flops_per_sample, read_metrics

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPES = ["configs/1b-8k.yaml", "configs/1b-8k-dense.yaml"]
CHILD_RESULT = "mfu_child.json"
LOG_TAIL = 4000  # characters of a failed child's console kept in its row


@dataclass
class MfuConfig:
    """What to measure (see ``tools/measure_mfu.py --help``).

    Attributes:
        recipes: YAML recipes, measured one after the other.
        overrides: ``section.key=value`` applied to every recipe (before the measurement's own
            ``train.steps``, ``train.log_interval`` and ``run.output_dir``).
        steps: optimizer steps per recipe (the default 8 of configs/1b-8k.yaml are 128
            micro-batches of 8192 tokens: ~3 minutes with Focus on an H100, 1 dense).
        log_interval: steps per logged interval.
        warmup_intervals: leading intervals left out of the figures.
        output_dir: parent of the per-recipe run directories (each is emptied first, if the
            benchmark made it; another directory of that name is refused).
        timeout_s: wall-clock limit of one recipe's child (start-up and data preparation
            included); a child past it is killed and its row records the timeout.
    """

    recipes: list[str] = field(default_factory=lambda: list(DEFAULT_RECIPES))
    overrides: list[str] = field(default_factory=list)
    steps: int = 8
    log_interval: int = 2
    warmup_intervals: int = 1
    output_dir: str = "runs/mfu"
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if not self.recipes:
            raise ValueError("name at least one recipe")
        if self.log_interval < 1 or self.warmup_intervals < 0:
            raise ValueError("log_interval must be >= 1 and warmup_intervals >= 0")
        if self.steps < (self.warmup_intervals + 1) * self.log_interval:
            raise ValueError(
                f"steps ({self.steps}) must cover the {self.warmup_intervals} warm-up "
                f"interval(s) and at least one measured interval of {self.log_interval} steps"
            )

    def recipe_overrides(self, run_dir: Path) -> list[str]:
        """The overrides of one recipe's run: no validation, TensorBoard or periodic
        checkpoint, then the user's, then the measurement's steps, cadence and directory."""
        quiet = [
            "train.eval_interval=0",
            "train.save_interval=0",
            "train.tensorboard=false",
            "probes.lengths=[]",
        ]
        cadence = [
            f"train.steps={self.steps}",
            f"train.log_interval={self.log_interval}",
            f"run.output_dir={run_dir}",
        ]
        return [*quiet, *self.overrides, *cadence]


def run_dir_for(cfg: MfuConfig, recipe: str) -> Path:
    """``output_dir/<recipe file stem>`` (``1b-8k``, ``1b-8k-dense``)."""
    return Path(cfg.output_dir) / Path(recipe).stem


RUN_MARKER = "focus_bench_run.json"  # written into every run directory the benchmark makes


def check_run_dir(run_dir: Path) -> None:
    """Refuse ``run_dir`` unless the benchmark made it (its marker) and no run holds it: a
    directory of the user's (a training run of the same name, say) is never emptied."""
    check_output_dir(
        run_dir, force=True, marker=RUN_MARKER, what="benchmark run",
        owned=lambda out: {p.name for p in out.iterdir()},
        option="measure_mfu (choose another --output-dir)",
    )  # fmt: skip


def claim_run_dir(run_dir: Path) -> None:
    """Empty ``run_dir`` for a new measurement (a leftover checkpoint would be resumed), after
    :func:`check_run_dir`, and mark it as the benchmark's."""
    check_run_dir(run_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / RUN_MARKER).write_text(json.dumps({"made_by": "focus-pretrain measure_mfu"}))


def full_attention_ratio(config: Config) -> float:
    """FLOPs of a training sample with attention over all ``s^2`` pairs, over
    :func:`~focus_pretrain.train.metrics.flops_per_sample` (causal pairs)."""
    model, seq = config.model, config.data.seq_length
    counted = flops_per_sample(model, seq)
    global_layers = sum(not model.is_local_layer(n) for n in range(1, model.num_layers + 1))
    missing = seq * seq - seq * (seq + 1) / 2  # pairs above the diagonal
    extra = 3 * 4 * model.kv_channels * model.num_attention_heads * missing * global_layers
    return (counted + extra) / counted


def summarize(
    records: list[dict], config: Config, warmup_intervals: int
) -> dict[str, float | int | None]:
    """Throughput, memory and loss of one run from its ``metrics.jsonl`` ``records``.

    The ``train`` records after the first ``warmup_intervals`` are combined over their wall
    time (each interval's time is its tokens over its ``tokens_per_s``). Figures are ``None``
    when no interval is left after the warm-up.
    """
    train = [r for r in records if r.get("split") == "train"]
    by_step: dict[int, dict] = {}
    for record in train:  # a step logged twice (a restart) counts once: the later record
        by_step[record["step"]] = record
    train = [by_step[s] for s in sorted(by_step)]
    tokens_per_step = config.train.global_batch_size * config.data.seq_length
    start = next((r for r in records if r.get("event") == "start"), {})
    out: dict[str, float | int | None] = {
        "parameters": (start["trainable"] + start["frozen"]) if "trainable" in start else None,
        "grad_accum": start.get("grad_accum"),
        "steps_done": train[-1]["step"] if train else 0,
        "steps_timed": 0,
        "step_s": None,
        "tokens_per_s": None,
        "tflops": None,
        "mfu": None,
        "mfu_full_attention": None,
        "peak_mem_gb": max((r["peak_mem_gb"] for r in train if "peak_mem_gb" in r), default=None),
        "loss_first": train[0]["loss"] if train else None,
        "loss_last": train[-1]["loss"] if train else None,
    }
    kept = train[warmup_intervals:]
    if not kept:
        return out
    previous = train[warmup_intervals - 1]["step"] if warmup_intervals else 0
    steps = tokens = seconds = tflop = mfu = 0.0
    for record in kept:
        count = record["step"] - previous
        previous = record["step"]
        interval_s = count * tokens_per_step / record["tokens_per_s"]
        steps, tokens, seconds = (
            steps + count,
            tokens + count * tokens_per_step,
            seconds + interval_s,
        )
        tflop += record["tflops"] * interval_s
        mfu = None if mfu is None or "mfu" not in record else mfu + record["mfu"] * interval_s
    out.update(
        steps_timed=int(steps),
        step_s=seconds / steps,
        tokens_per_s=tokens / seconds,
        tflops=tflop / seconds,
        mfu=None if mfu is None else mfu / seconds,
    )
    if out["mfu"] is not None:
        out["mfu_full_attention"] = out["mfu"] * full_attention_ratio(config)
    return out


def measure_recipe(recipe: str, cfg: MfuConfig) -> dict[str, Any]:
    """Train ``recipe`` in a child process and return its row (see :func:`summarize`), with
    ``error`` set (and ``log_tail``, the end of the child's console) when the child failed."""
    run_dir = run_dir_for(cfg, recipe)
    sets = cfg.recipe_overrides(run_dir)
    config = load_config(recipe, sets)  # a bad recipe or override fails here, before any run
    claim_run_dir(run_dir)
    command = [sys.executable, "-m", "focus_pretrain.bench.training", "--child", recipe]
    command += ["--result", str(run_dir / CHILD_RESULT)]
    command += [item for override in sets for item in ("--set", override)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    started = time.perf_counter()
    error = _run_child(command, env, run_dir / "train.log", cfg.timeout_s)
    child = _read_json(run_dir / CHILD_RESULT)
    error = child.get("error") or error
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    row: dict[str, Any] = {
        "recipe": recipe,
        "name": config.run.name,
        "attention": _attention(config),
        "seq": config.data.seq_length,
        "micro_batch": config.train.micro_batch_size,
        "global_batch": config.train.global_batch_size,
        "precision": config.train.precision,
        **summarize(records, config, cfg.warmup_intervals),
        "reserved_gb": child.get("max_reserved_gb"),
        "device": child.get("device"),
        "wall_s": time.perf_counter() - started,
        "run_dir": str(run_dir),
        "error": error,
    }
    if error:
        log = run_dir / "train.log"
        row["log_tail"] = log.read_text(errors="replace")[-LOG_TAIL:] if log.is_file() else ""
    return row


def _attention(config: Config) -> str:
    focus = config.model.focus
    if not focus.enabled:
        return "dense"
    if focus.window_only:
        return f"window {focus.window}"
    return f"focus K={focus.num_groups} top{focus.top_k} w={focus.window}"


def _run_child(command: list[str], env: dict, log_path: Path, timeout_s: float) -> str | None:
    """Run ``command`` in its own process group with its console in ``log_path``; ``None``
    when it exits with 0, else what went wrong. On timeout (or an interrupt of this process)
    the whole group is killed."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout_s:g} s (killed)"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if code == 0:
        return None
    if code < 0:
        return f"child killed by signal {-code}"
    return f"child exited with code {code}"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def run_benchmark(cfg: MfuConfig, log=print) -> list[dict]:
    """Measure every recipe of ``cfg`` in turn; one row per recipe."""
    for recipe in cfg.recipes:  # every output checked before the first run
        load_config(recipe, cfg.recipe_overrides(run_dir_for(cfg, recipe)))
        check_run_dir(run_dir_for(cfg, recipe))
    rows = []
    for recipe in cfg.recipes:
        log(f"measure_mfu: {recipe}: training {cfg.steps} steps (log {run_dir_for(cfg, recipe)})")
        row = measure_recipe(recipe, cfg)
        log(f"measure_mfu: {recipe}: {_brief(row)}")
        if row["error"]:
            log(row.get("log_tail", ""))
        rows.append(row)
    return rows


def _brief(row: dict) -> str:
    if row["tokens_per_s"] is None:
        return f"no measured interval; {row['error'] or 'no metrics'}"
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    text = (
        f"{row['tokens_per_s']:,.0f} tokens/s, {row['tflops']:.1f} TFLOP/s per device, "
        f"MFU {mfu}, peak {_num(row['peak_mem_gb'])} GB, loss {_num(row['loss_last'])}"
    )
    return text + (f"; error: {row['error']}" if row["error"] else "")


def _count(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:.3f}B" if value >= 1e9 else f"{value / 1e6:.2f}M"


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    """One line per recipe."""
    columns = ["recipe", "attention", "params", "seq x batch", "steps timed", "s/step"]
    columns += ["tokens/s", "TFLOP/s per device", "MFU", "MFU (s^2 attention)"]
    columns += ["peak mem (GB)", "reserved (GB)", "loss first -> last", "error"]
    return markdown(columns, "llrlrrrrrrrrll", (_markdown_cells(row) for row in rows))


def _markdown_cells(row: dict) -> list[object]:
    tokens = "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}"
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    full = row["mfu_full_attention"]
    full = "-" if full is None else f"{100 * full:.1f}%"
    error = (row["error"] or "").replace("|", "/").replace("\n", " ")[:120]
    return [
        row["name"], row["attention"], _count(row["parameters"]),
        f"{row['seq']} x {row['global_batch']}", row["steps_timed"], _num(row["step_s"], 3),
        tokens, _num(row["tflops"], 1), mfu, full, _num(row["peak_mem_gb"]),
        _num(row["reserved_gb"]), f"{_num(row['loss_first'], 3)} -> {_num(row['loss_last'], 3)}",
        error or "-",
    ]  # fmt: skip


# -- the child ----------------------------------------------------------------------------------


def _skip_checkpoint(step: int, *, last: bool = False) -> None:
    """Stands in for ``Checkpointer.save`` in a measurement: nothing is written."""
    return None


def child_main(argv: list[str] | None = None) -> int:
    """Train one recipe like ``launchers/pretrain.py`` does, without the final checkpoint, and
    write ``{"error", "device", "max_allocated_gb", "max_reserved_gb", "result"}`` to
    ``--result``. Returns the exit code (1 when training raised)."""
    parser = argparse.ArgumentParser(description="one recipe of tools/measure_mfu.py")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("recipe")
    parser.add_argument("--result", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"error": None, "device": "cpu"}
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    try:
        from focus_pretrain.train import Trainer

        trainer = Trainer(load_config(args.recipe, args.overrides))
        trainer.checkpointer.save = _skip_checkpoint  # a measurement writes no checkpoint
        out["result"] = trainer.train()
    except Exception as error:  # any failure is the row's error
        traceback.print_exc()
        message = str(error).strip().splitlines()
        out["error"] = f"{type(error).__name__}: {message[0] if message else ''}"[:300]
    if torch.cuda.is_available():
        out["max_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        out["max_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    Path(args.result).write_text(json.dumps(out, indent=1, default=str))
    return 1 if out["error"] else 0


if __name__ == "__main__":
    sys.exit(child_main())
