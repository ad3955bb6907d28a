"""Throughput accounting (FLOPs, MFU), memory, and the log line / TensorBoard scalars."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

from focus_pretrain.model.config import ModelConfig

# Dense bf16 peak per device (TFLOP/s), for MFU when train.peak_tflops is not set.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def attention_pairs(seq: int, window: int, mode: str, density: float | None = None) -> float:
    """Query-key pairs one head computes over a causal sequence of ``seq`` tokens.

    Training (soft gate) computes every causal pair; the hard pattern computes the window plus
    the allowed fraction of the rest (``density`` of all causal pairs, measured or estimated).
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
    Focus actually computes (QK^T and PV: 4 * head_dim FLOPs per pair and head), the router
    projection and its ``K`` logits, and the output layer.
    """
    h, d = config.hidden_size, config.kv_channels
    heads, groups, ffn = config.num_attention_heads, config.kv_heads, config.ffn_hidden_size
    gated = config.family != "gpt2"
    per_token_layer = 2 * (h * (heads + 2 * groups) * d + heads * d * h)  # qkv + proj
    per_token_layer += 2 * h * ffn * (3 if gated else 2)  # mlp
    focus = config.focus
    attn_flops = 0.0
    for layer in range(1, config.num_layers + 1):
        local = config.is_local_layer(layer)
        window = config.sliding_window - 1 if local else focus.window
        if local:
            pairs = sum(min(i, window) + 1 for i in range(seq))
        else:
            mode = "soft" if training or not focus.enabled else focus.inference_mode
            pairs = attention_pairs(seq, window, mode, None if not focus.enabled else density)
            if focus.enabled:
                attn_flops += seq * 2 * (h * focus.group_dim + focus.group_dim * focus.num_groups)
        attn_flops += 4 * d * heads * pairs
    total = seq * config.num_layers * per_token_layer + attn_flops
    total += seq * 2 * h * config.vocab_size  # output layer
    return total * (3 if training else 1)


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


class MetricsLogger:
    """One console line per interval from rank 0, the same scalars to TensorBoard."""

    def __init__(self, output_dir: Path | None, enabled: bool, tensorboard: bool) -> None:
        self.enabled = enabled
        self.writer = None
        if enabled and tensorboard and output_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(output_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float | None], prefix: str = "train") -> None:
        if not self.enabled:
            return
        shown = {k: v for k, v in scalars.items() if v is not None}
        parts = [f"{prefix} step {step}"] + [f"{k} {_fmt(v)}" for k, v in shown.items()]
        print(" | ".join(parts), flush=True)
        if self.writer is not None:
            for key, value in shown.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _fmt(value: float) -> str:
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4g}"
    return f"{value:.3e}"
