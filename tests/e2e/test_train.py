"""End-to-end training through the launcher: learn, checkpoint, resume exactly, survive SIGTERM,
freeze what the policy freezes, and agree across parallel layouts."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed import run_workers

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).parents[2]
LAUNCHER = str(ROOT / "launchers" / "pretrain.py")
RECIPE = str(ROOT / "configs" / "tiny.yaml")
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.vocab_size=320",
    "model.max_seq_length=128",
    "model.focus.window=16",
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


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data-cache"))


def overrides(out: pathlib.Path, cache: str, *extra: str) -> list[str]:
    return [*SMALL, f"run.output_dir={out}", f"data.cache_dir={cache}", *extra]


def launch(sets: list[str], **kwargs) -> subprocess.CompletedProcess:
    args = [sys.executable, LAUNCHER, "--config", RECIPE]
    for item in sets:
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, **kwargs)


def module_state(run: pathlib.Path, step: int) -> dict[str, torch.Tensor]:
    path = run / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def losses(stdout: str) -> dict[int, float]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("train step"):
            fields = dict(part.strip().rsplit(" ", 1) for part in line.split("|"))
            out[int(fields["train step"])] = float(fields["loss"])
    return out


def test_trains_checkpoints_and_resumes_exactly(tmp_path, cache):
    straight = launch(overrides(tmp_path / "a", cache, "train.steps=6"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = launch(overrides(tmp_path / "b", cache, "train.steps=3"))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = launch(overrides(tmp_path / "b", cache, "train.steps=6"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at step 3" in resumed.stdout
    full, split = losses(straight.stdout), {**losses(first.stdout), **losses(resumed.stdout)}
    assert sorted(full) == sorted(split) == [1, 2, 3, 4, 5, 6]
    assert full[6] < full[1]  # it learns
    for step in full:
        assert split[step] == pytest.approx(full[step], rel=1e-5), step
    a, b = module_state(tmp_path / "a", 6), module_state(tmp_path / "b", 6)
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    ckpts = tmp_path / "b" / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000006"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003", "step_00000006"]
    assert (ckpts / "step_00000006" / "config.yaml").is_file()
    assert (tmp_path / "b" / "config.yaml").is_file()
    line = next(line for line in straight.stdout.splitlines() if line.startswith("train step 6"))
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops",
        "peak_mem_gb",
        "max_group_share",
    ):
        assert f"| {key} " in line, key


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, cache):
    out = tmp_path / "run"
    args = [sys.executable, LAUNCHER, "--config", RECIPE]
    for item in overrides(out, cache, "train.steps=400"):
        args += ["--set", item]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    seen = ""
    deadline = time.time() + 300
    while "train step 2 " not in seen and time.time() < deadline:
        seen += proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, seen + rest
    assert "stopped by signal" in rest
    tag = (out / "checkpoints" / "latest").read_text()
    stopped_at = int(tag.split("_")[1])
    assert 2 <= stopped_at < 400
    assert not list((out / "checkpoints").glob(".tmp-*"))  # nothing half-written remains


def test_retrofit_trains_only_routers(tmp_path, cache):
    run = launch(
        overrides(
            tmp_path,
            cache,
            "train.steps=3",
            "train.save_interval=1",
            "train.keep_last=5",
            "train.freeze=retrofit",
        )
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert " 0 frozen" not in run.stdout and "(2,176 router)" in run.stdout
    one, three = module_state(tmp_path, 1), module_state(tmp_path, 3)
    tensors = {n: t for n, t in one.items() if isinstance(t, torch.Tensor)}
    assert any(".router." in n for n in tensors) and len(tensors) > 10
    for name, tensor in tensors.items():
        if ".router." in name:
            assert not torch.equal(three[name], tensor), name  # routers (and offsets) move
        else:
            assert torch.equal(three[name], tensor), name  # original weights never change


def test_two_phase_unfreezes_after_router_only_steps(tmp_path, cache):
    run = launch(
        overrides(
            tmp_path,
            cache,
            "train.steps=4",
            "train.save_interval=1",
            "train.keep_last=5",
            "train.freeze=two_phase",
            "train.router_only_steps=2",
        )
    )
    assert run.returncode == 0, run.stderr[-3000:]
    one, two, four = (module_state(tmp_path, s) for s in (1, 2, 4))
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    centroids = "decoder.layers.0.self_attention.router.centroids"
    assert torch.equal(one[qkv], two[qkv]) and not torch.equal(two[qkv], four[qkv])
    assert not torch.equal(one[centroids], two[centroids])


def test_dry_run_plans_the_7b_recipe():
    args = [sys.executable, LAUNCHER, "--config", str(ROOT / "configs" / "7b.yaml"), "--dry-run"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, check=True)
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["parameters"] == 7_241_732_096 + 32 * (4096 * 16 + 4 * 16)
    assert plan["gpus"] == 32 and plan["fits"] and plan["total_gb"] < 80
    one_gpu = subprocess.run(
        [*args, "--set", "parallel.gpus=1"], capture_output=True, text=True, timeout=300, check=True
    )
    assert not json.loads(one_gpu.stdout.strip().splitlines()[-1])["fits"]  # 16 B/param > 80 GB


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["tp2", "dp2", "dp2-zero3"])
def test_parallel_layouts_match_one_process(tmp_path, cache, layout):
    """TP=2 (through DeepSpeed's mpu adapter) and DP=2 with ZeRO-2 or ZeRO-3 train like one
    process (same global batch: DP=1 accumulates two micro-batches)."""
    base = overrides(tmp_path / "one", cache, "train.steps=3")
    (single,) = run_workers("tests.e2e.workers_train:train", 1, base)
    extra = {
        "tp2": ["parallel.tensor_parallel_size=2"],
        "dp2": ["parallel.zero_stage=2"],
        "dp2-zero3": ["parallel.zero_stage=3"],
    }[layout]
    sets = overrides(tmp_path / layout, cache, "train.steps=3", *extra)
    results = run_workers("tests.e2e.workers_train:train", 2, sets)
    for result in results:
        assert result["step"] == 3
        assert result["train_loss"] == pytest.approx(single["train_loss"], rel=2e-4)
