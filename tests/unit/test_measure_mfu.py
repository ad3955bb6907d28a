"""tools/measure_mfu.py: the figures from a run's metrics, the child runs, fused AdamW on GPUs."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

import pytest
import torch

from focus_pretrain.bench.training import MfuConfig, measure_recipe, summarize
from focus_pretrain.config import load_config
from focus_pretrain.train.metrics import flops_per_sample
from focus_pretrain.train.optim import build_optimizer, use_fused_adamw
from tests.e2e.runs import SMALL

ROOT = pathlib.Path(__file__).parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def test_summary_drops_warmup_and_weights_intervals_by_time():
    config = load_config(TINY, ["train.global_batch_size=16", "data.seq_length=128"])
    tokens = 16 * 128  # per step
    records = [
        {"event": "start", "trainable": 900, "frozen": 100, "grad_accum": 1},
        {"split": "train", "step": 2, "loss": 9.0, "tokens_per_s": 1.0, "tflops": 1.0, "mfu": 0.1},
        # 2 steps in 1 s, then 4 steps in 1 s (10 and 30 TFLOP/s): 6 steps in 2 s
        {"split": "train", "step": 4, "loss": 6.0, "tokens_per_s": 2 * tokens, "tflops": 10.0},
        {"split": "train", "step": 8, "loss": 5.0, "tokens_per_s": 4 * tokens, "tflops": 30.0},
    ]
    for record in records[2:]:
        record.update(mfu=record["tflops"] / 100, peak_mem_gb=record["step"] / 2)
    out = summarize(records, config, warmup_intervals=1)
    assert out["parameters"] == 1000 and out["steps_done"] == 8 and out["steps_timed"] == 6
    assert out["tokens_per_s"] == pytest.approx(6 * tokens / 2)
    assert out["step_s"] == pytest.approx(2 / 6)
    assert out["tflops"] == pytest.approx(20.0) and out["mfu"] == pytest.approx(0.2)
    assert out["peak_mem_gb"] == 4.0 and (out["loss_first"], out["loss_last"]) == (9.0, 5.0)
    # s^2 attention (torchtitan's convention) adds the pairs above the diagonal
    m, s = config.model, 128
    extra = 3 * 4 * m.kv_channels * m.num_attention_heads * (s * s - s * (s + 1) / 2) * 2
    ratio = 1 + extra / flops_per_sample(m, s)
    assert out["mfu_full_attention"] == pytest.approx(0.2 * ratio)
    nothing = summarize(records[:2], config, warmup_intervals=1)
    assert nothing["tokens_per_s"] is None and nothing["steps_timed"] == 0


def test_steps_must_leave_a_measured_interval():
    with pytest.raises(ValueError, match="at least one measured interval"):
        MfuConfig(steps=5, log_interval=5, warmup_intervals=1)


def test_fused_adamw_only_on_a_gpu_without_offload(monkeypatch):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(3))], "weight_decay": 0.0}]
    train = load_config(TINY).train
    assert not use_fused_adamw(groups, cpu_offload=False)  # no GPU here
    assert not build_optimizer(groups, train, cpu_offload=False).defaults["fused"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert use_fused_adamw(groups, cpu_offload=False)  # CPU-initialised: DeepSpeed moves it
    assert not use_fused_adamw(groups, cpu_offload=True)
    assert build_optimizer(groups, train, cpu_offload=False).defaults["fused"]
    ints = [{"params": [torch.zeros(3, dtype=torch.int64)], "weight_decay": 0.0}]
    assert not use_fused_adamw(ints, cpu_offload=False)


@pytest.mark.e2e
def test_measures_a_tiny_recipe_on_cpu(tmp_path):
    """The CLI end to end: one recipe trained in a child process, its row in JSON and
    markdown; a child past its timeout becomes a row with the error."""
    spec = importlib.util.spec_from_file_location("measure_mfu", ROOT / "tools" / "measure_mfu.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    sets = [*SMALL, f"data.cache_dir={tmp_path / 'cache'}", "train.peak_tflops=1.0"]
    out = tmp_path / "mfu"
    args = ["--config", TINY, "--steps", "3", "--log-interval", "1", "--warmup-intervals", "1"]
    args += ["--output-dir", str(out), "--json", str(tmp_path / "r.json")]
    args += ["--markdown", str(tmp_path / "r.md")] + [x for s in sets for x in ("--set", s)]
    assert tool.main(args) == 0
    report = json.loads((tmp_path / "r.json").read_text())
    (row,) = report["rows"]
    assert report["environment"]["config"]["steps"] == 3 and row["error"] is None
    assert (
        row["steps_done"] == 3 and row["steps_timed"] == 2 and row["attention"].startswith("focus")
    )
    assert row["tokens_per_s"] > 0 and row["tflops"] > 0 and row["parameters"] > 0
    assert row["mfu"] == pytest.approx(row["tflops"] / 1.0)
    assert row["peak_mem_gb"] > 0 and math.isfinite(row["loss_last"])
    assert not (out / "tiny" / "checkpoints").exists()  # a measurement saves nothing
    assert "| tiny | focus K=4" in (tmp_path / "r.md").read_text()

    cfg = MfuConfig(recipes=[TINY], overrides=sets, steps=3, log_interval=1)
    cfg.output_dir, cfg.timeout_s = str(tmp_path / "slow"), 0.5
    late = measure_recipe(TINY, cfg)
    assert late["error"].startswith("timed out after 0.5 s") and late["tokens_per_s"] is None


def test_a_run_directory_is_emptied_only_when_the_benchmark_made_it(tmp_path):
    """measure_mfu empties ``OUTPUT_DIR/<recipe stem>`` before measuring: a directory of that
    name it did not make (a training run of the user's) is refused for every recipe before
    the first is measured, and left whole; its own earlier one is emptied and marked again."""
    from focus_pretrain.bench.training import RUN_MARKER, claim_run_dir, run_benchmark
    from focus_pretrain.errors import InputError

    user = tmp_path / "tiny"  # the tiny recipe's run directory name
    (user / "checkpoints").mkdir(parents=True)
    (user / "checkpoints" / "latest").write_text("step_00000800")
    cfg = MfuConfig(recipes=[TINY], output_dir=str(tmp_path), steps=4, log_interval=1)
    measured = []
    with pytest.raises(InputError, match=r"measure_mfu \(choose another --output-dir\) replaces"):
        run_benchmark(cfg, log=measured.append)
    assert measured == [] and (user / "checkpoints" / "latest").read_text() == "step_00000800"
    ours = tmp_path / "ours"
    claim_run_dir(ours)
    (ours / "checkpoints").mkdir()  # what a measurement left
    claim_run_dir(ours)
    assert [p.name for p in ours.iterdir()] == [RUN_MARKER]
