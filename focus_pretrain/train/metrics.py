"""Throughput accounting (FLOPs, MFU), memory, and what a run records: the console line,
TensorBoard scalars and ``metrics.jsonl``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import resource
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from focus_pretrain.config import config_to_dict
from focus_pretrain.errors import InputError
from focus_pretrain.model.config import ModelConfig

METRICS_FILE = "metrics.jsonl"
_DETAIL = re.compile(r"_L\d+_d\d+_")  # per length and depth probe scores: files only

# Dense bf16 peak per device (TFLOP/s), for MFU when train.peak_tflops is not set.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def attention_pairs(seq: int, mode: str, density: float | None = None) -> float:
    """Query-key pairs one head computes over a causal sequence of ``seq`` tokens.

    The soft gate computes every causal pair; the hard patterns (``hard`` inference,
    ``hard_gated`` sparse training) compute ``density`` of them (the window's pairs included;
    measured or estimated), all of them when unknown.
    """
    causal = seq * (seq + 1) / 2
    if mode == "soft" or density is None:
        return causal
    return density * causal


def flops_per_sample(
    config: ModelConfig, seq: int, *, training: bool = True, density: float | None = None
) -> float:
    """Model FLOPs of one sample of ``seq`` tokens (forward x3 when ``training``).

    Dense matmuls (2 FLOPs per multiply-add per weight and token), attention over the pairs
    Focus actually computes (QK^T and PV: 4 * head_dim FLOPs per pair and head: every causal
    pair for the soft gate; ``density`` of them for the hard patterns, inference and sparse
    training, ``focus.training_mode: hard``), the router projection and its ``K`` logits, and
    the output layer.
    """
    h, d = config.hidden_size, config.kv_channels
    heads, groups, ffn = config.num_attention_heads, config.kv_heads, config.ffn_hidden_size
    gated = config.family_spec.gated_mlp
    per_token_layer = 2 * (h * (heads + 2 * groups) * d + heads * d * h)  # qkv + proj
    per_token_layer += 2 * h * ffn * (3 if gated else 2)  # mlp
    focus = config.focus
    attn_flops = 0.0
    for layer in range(1, config.num_layers + 1):
        local = config.is_local_layer(layer)
        if local:
            window = config.sliding_window - 1
            pairs = sum(min(i, window) + 1 for i in range(seq))
        else:
            mode = focus.training_pattern if training else focus.inference_mode
            mode = mode if focus.enabled else "soft"
            pairs = attention_pairs(seq, mode, None if not focus.enabled else density)
            if focus.enabled:
                attn_flops += router_flops(config, seq)
        attn_flops += 4 * d * heads * pairs
    total = seq * config.num_layers * per_token_layer + attn_flops
    total += seq * 2 * h * config.vocab_size  # output layer
    return total * (3 if training else 1)


def attention_mass_flops_per_sample(config: ModelConfig, seq: int) -> float:
    """Model FLOPs of one sample under ``train.objective: attention_mass``: a forward of the
    dense model (:func:`flops_per_sample` with Focus off, no backward) and, per Focus layer,
    its router's forward and backward and four more passes over every causal pair (the dense
    and the gated log-sum-exps, the gated one's backward counted as two)."""
    focus = config.focus
    total = flops_per_sample(
        replace(config, focus=replace(focus, enabled=False)), seq, training=False
    )
    if not focus.enabled:
        return total
    routed = sum(not config.is_local_layer(n) for n in range(1, config.num_layers + 1))
    pairs = 4 * config.kv_channels * config.num_attention_heads * attention_pairs(seq, "soft")
    return total + routed * (3 * router_flops(config, seq) + 4 * pairs)


def router_flops(config: ModelConfig, seq: int) -> float:
    """Forward FLOPs of one Focus layer's router over ``seq`` tokens: the projection to
    ``group_dim`` and the ``K`` centroid logits."""
    focus = config.focus
    return seq * 2 * (config.hidden_size * focus.group_dim + focus.group_dim * focus.num_groups)


def step_flops_per_sample(config: ModelConfig, seq: int, objective: str = "lm") -> float:
    """Model FLOPs of one training sample under ``train.objective``: a forward and backward
    (:func:`flops_per_sample`; a distillation teacher's pass not counted), or
    :func:`attention_mass_flops_per_sample`."""
    if objective == "attention_mass":
        return attention_mass_flops_per_sample(config, seq)
    return flops_per_sample(config, seq)


def peak_tflops(configured: float | None) -> float | None:
    """Per-device peak TFLOP/s: the configured one, or the GPU's from :data:`PEAK_TFLOPS`."""
    if configured is not None:
        return configured
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def peak_memory_gb() -> float:
    """Peak device memory (GPU) or peak resident memory of the process (CPU), in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 1e9


class IntervalMeter:
    """Loss and throughput over one log interval (reset by :meth:`scalars`).

    Args:
        flops_per_sample: model FLOPs of one training sample (:func:`flops_per_sample`).
        samples_per_step: the global batch.
        tokens_per_sample: the sequence length.
        devices: all ranks (TFLOP/s and MFU are per device).
        peak: per-device peak TFLOP/s for MFU, or ``None``.
    """

    def __init__(
        self,
        flops_per_sample: float,
        samples_per_step: int,
        tokens_per_sample: int,
        devices: int,
        peak: float | None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.flops_per_sample = flops_per_sample
        self.samples_per_step = samples_per_step
        self.tokens_per_sample = tokens_per_sample
        self.devices = devices
        self.peak = peak
        self.clock = clock
        self._reset()

    def _reset(self) -> None:
        self.loss, self.losses, self.steps, self.tic = 0.0, 0, 0, self.clock()
        self.outside: dict[str, float] = {}  # seconds spent in excluded work, by name

    @contextlib.contextmanager
    def excluded(self, name: str) -> Iterator[None]:
        """Time spent inside (evaluation, checkpointing) is left out of the interval's
        throughput and reported as ``<name>_s`` instead."""
        start = self.clock()
        try:
            yield
        finally:
            spent = self.clock() - start
            self.outside[name] = self.outside.get(name, 0.0) + spent

    def add(self, loss: float | None) -> None:
        """One optimizer step's mean loss (``None``: a skipped bad step, counted in the
        throughput but not in the loss)."""
        if loss is not None:
            self.loss += loss
            self.losses += 1
        self.steps += 1

    def scalars(self, flops_per_sample: float | None = None) -> dict[str, float | None]:
        """``loss`` (mean over the interval's good steps; ``None`` if none), ``tokens_per_s``,
        ``tflops`` (per device), ``mfu`` over the training time of the interval, and
        ``<name>_s`` for the time spent in each :meth:`excluded` part (evaluation,
        checkpointing); starts the next interval. ``flops_per_sample``: this interval's, when
        it differs from the constructor's (sparse training: the pairs counted this interval)."""
        elapsed = self.clock() - self.tic - sum(self.outside.values())
        elapsed = max(elapsed, 1e-9)
        samples = self.steps * self.samples_per_step
        flops = self.flops_per_sample if flops_per_sample is None else flops_per_sample
        tflops = flops * samples / elapsed / (self.devices * 1e12)
        out = {
            "loss": self.loss / self.losses if self.losses else None,
            "tokens_per_s": samples * self.tokens_per_sample / elapsed,
            "tflops": tflops,
            "mfu": None if self.peak is None else tflops / self.peak,
            **{f"{name}_s": spent for name, spent in self.outside.items()},
        }
        self._reset()
        return out


class MetricsLogger:
    """What a run measured, from rank 0: one console line per interval, the same scalars to
    TensorBoard (``run.output_dir/tensorboard``) and to ``run.output_dir/metrics.jsonl``.

    ``metrics.jsonl`` holds one JSON object per line: ``{"split": "train" | "valid", "step",
    <scalars>}`` for every log line, and ``{"event": "start" | "end", ...}`` records around
    each launch (a resumed run appends; a step logged twice, after a restart from an earlier
    checkpoint, is measured again: the later record is the one that counts). It is what tests,
    plots and scripts read; the console is for people.
    """

    def __init__(
        self,
        output_dir: Path | None,
        enabled: bool,
        tensorboard: bool,
        wandb_run: Callable[[], object] | None = None,
    ) -> None:
        self.enabled = enabled and output_dir is not None
        self.writer = None
        self.jsonl = None
        self.wandb = None
        self.total_steps: int | None = None  # shown as "step N/total" when set
        if not self.enabled:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(output_dir / METRICS_FILE, "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        if wandb_run is not None:
            self.wandb = wandb_run()

    def log(self, step: int, scalars: dict[str, float | None], prefix: str = "train") -> None:
        """One interval's scalars (``None`` values are left out). The console line leaves out
        per-length-and-depth probe scores (``passkey_L4096_d50_acc``...); TensorBoard and
        ``metrics.jsonl`` get every scalar."""
        if not self.enabled:
            return
        shown = {k: v for k, v in scalars.items() if v is not None}
        brief = {k: v for k, v in shown.items() if not _DETAIL.search(k)}
        of = f"/{self.total_steps}" if self.total_steps else ""
        parts = [f"{prefix} step {step}{of}"] + [f"{k} {_fmt(v)}" for k, v in brief.items()]
        print(" | ".join(parts), flush=True)
        self._append({"split": prefix, "step": step, **shown})
        if self.writer is not None:
            for key, value in shown.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
            self.writer.flush()
        if self.wandb is not None:  # the same keys as TensorBoard
            self.wandb.log({f"{prefix}/{key}": value for key, value in shown.items()}, step=step)

    def event(self, name: str, **fields: object) -> None:
        """A run-level record (``start``: layout, parameter counts, resumed step; ``end``)."""
        if self.enabled:
            self._append({"event": name, **fields})

    def _append(self, record: dict) -> None:
        record = {**record, "time": round(time.time(), 3)}  # unix seconds: when it was written
        record = {  # strict JSON: a non-finite value is written as null
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in record.items()
        }
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.jsonl is not None:
            self.jsonl.close()


def wandb_run(config, output_dir: Path) -> Callable[[], object] | None:
    """A function starting the run's Weights & Biases run (``train.wandb``), or ``None``: the
    run id is derived from the output directory, so a resumed run continues the same W&B run;
    offline runs are written under ``output_dir/wandb`` (``wandb sync`` uploads them).

    Raises:
        InputError: ``train.wandb`` is set but the package is not installed.
    """
    mode = config.train.wandb
    if mode is None:
        return None
    try:
        import wandb
    except ImportError as err:
        raise InputError(
            f"train.wandb={mode} needs the wandb package: pip install -e '.[wandb]' (or unset "
            "train.wandb)"
        ) from err
    run_id = hashlib.sha256(str(output_dir.resolve()).encode()).hexdigest()[:16]

    def start():
        return wandb.init(
            project=config.train.wandb_project, name=config.run.name, id=run_id, resume="allow",
            dir=str(output_dir), mode=mode, config=config_to_dict(config),
        )  # fmt: skip

    return start


def read_metrics(output_dir: str | Path) -> list[dict]:
    """The records of ``output_dir/metrics.jsonl``, in order."""
    path = Path(output_dir) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _fmt(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"
