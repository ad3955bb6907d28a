"""End-to-end training through the launcher: learn, checkpoint, resume exactly, survive SIGTERM
(on every rank or on one), freeze what the policy freezes, and agree across parallel layouts.
What a run measured is read from the ``metrics.jsonl`` it writes."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed import free_port, run_workers
from tests.e2e import runs
from tests.e2e.runs import (
    LAUNCHER,
    ROOT,
    TIMEOUT,
    events,
    launch,
    module_state,
    overrides,
    script_args,
    train_losses,
    train_steps_logged,
)
from tests.helpers import require_packages

pytestmark = pytest.mark.e2e


def run_retrying_port(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a launcher whose rendezvous port we must pick (``deepspeed --master_port``, srun's
    ``MASTER_PORT``): ``command`` may hold ``{port}``; a port another process took between
    choosing and binding it is retried with a new one (a loaded machine, concurrent runs)."""
    for _attempt in range(3):
        port = str(free_port())
        run = runs.run([part.replace("{port}", port) for part in command], **kwargs)
        if run.returncode == 0 or "Address already in use" not in run.stdout + run.stderr:
            return run
    return run


def test_trains_checkpoints_and_resumes_exactly(tmp_path, cache):
    straight = launch(overrides(tmp_path / "a", cache, "train.steps=6"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = launch(overrides(tmp_path / "b", cache, "train.steps=3"))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = launch(overrides(tmp_path / "b", cache, "train.steps=6"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = events(tmp_path / "b", "start")
    assert [(e["step"], e["resumed"]) for e in starts] == [(0, False), (3, True)]
    assert "resuming at step 3" in resumed.stdout  # what the user is told
    (end,) = events(tmp_path / "a", "end")
    assert end["step"] == 6 and end["stopped_by_signal"] is None
    assert end["checkpoint"] == str(tmp_path / "a" / "checkpoints" / "step_00000006")
    full, split = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert train_steps_logged(tmp_path / "b") == [1, 2, 3, 4, 5, 6]
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
    record = [r for r in _records(tmp_path / "a") if r.get("split") == "train"][-1]
    for key in (
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tflops",
        "peak_mem_gb",
        "max_group_share",
        "tokens_seen",
        "elapsed_s",
        "eta_s",
        "time",
    ):
        assert isinstance(record[key], float), key
    assert record["tokens_seen"] == 6 * 4 * 128 and record["eta_s"] == 0.0  # 6 of 6 steps
    line = next(line for line in straight.stdout.splitlines() if line.startswith("train step 6"))
    assert line.startswith("train step 6/6 |")  # step of total
    assert "| loss " in line and "| max_group_share " in line  # the console shows the same
    assert "rerun the same command with a larger train.steps" in straight.stdout  # how to go on
    resolved = f"focus-pretrain: resolved config ({tmp_path / 'a' / 'config.yaml'}):\nrun:\n"
    assert straight.stdout.count("resolved config") == 1 and resolved in straight.stdout


@pytest.mark.hf
def test_sparse_training_learns_resumes_and_exports_like_soft(tmp_path, cache, monkeypatch):
    """``model.focus.training_mode=hard`` (sparse training on the gated hard pattern): the loss
    falls, after 2 soft warm-up steps each log line has the share of pairs computed (what FLOPs
    and MFU count), a checkpoint resumes, and the export is a plain Focus model (no
    training-only key) whose hard-pattern logits equal ours from the checkpoint."""
    from focus_pretrain.convert import export_hf
    from tests.e2e.test_export import _export_outputs

    sets = ["model.focus.training_mode=hard", "model.focus.soft_warmup_steps=2"]
    first = launch(overrides(tmp_path / "run", cache, "train.steps=3", *sets))
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = launch(overrides(tmp_path / "run", cache, "train.steps=6", *sets))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "sparse training after 2 soft-gate steps" in first.stdout  # what the user is told
    starts = events(tmp_path / "run", "start")
    assert [(e["step"], e["resumed"]) for e in starts] == [(0, False), (3, True)]
    losses = train_losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and losses[6] < losses[1]
    records = [r for r in _records(tmp_path / "run") if r.get("split") == "train"]
    assert len(records) == 6 and not any("attention_density" in r for r in records[:2])
    assert all(0 < r["attention_density"] < 1 for r in records[2:])  # sparse after warm-up
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000006"
    assert "training_mode: hard" in (ckpt / "config.yaml").read_text()
    out = export_hf(tmp_path / "run", tmp_path / "hf")
    focus = json.loads((out / "config.json").read_text())["focus"]
    assert "training_mode" not in focus and focus["inference_mode"] == "hard"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokens = torch.randint(3, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    (ours,) = run_workers("tests.e2e.workers_train:checkpoint_logits", 1, str(ckpt), tokens, 4)
    _, hard, _, greedy = _export_outputs(out, tokens, 4)
    torch.testing.assert_close(hard, ours["hard"][..., : hard.shape[-1]], rtol=1e-4, atol=1e-4)
    assert greedy.tolist() == ours["greedy"].tolist()


def test_resume_with_another_model_is_refused_unless_allowed(tmp_path, cache, one_process):
    """A resume whose recipe changes a ``model`` key is refused before anything is built,
    naming the key and both values; with ``train.allow_changes`` it continues, and the run
    records what changed."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(one_process[1], run)
    sets = overrides(run, cache, "train.steps=4", "model.focus.gate_lambda=5.0")
    refused = launch(sets)
    assert refused.returncode != 0
    assert "model.focus.gate_lambda: 10.0 in the checkpoint, 5.0 now" in refused.stderr
    assert [e["step"] for e in events(run, "start")] == [0]  # nothing ran
    status = tmp_path / "exit-status"
    env = {**os.environ, "FOCUS_EXIT_STATUS_FILE": str(status)}
    allowed = launch([*sets, "train.allow_changes=true"], env=env)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert status.read_text() == "done 4\n"  # launchers/slurm.sh does not requeue this
    start = events(run, "start")[-1]
    assert start["resumed"] and start["step"] == 3
    assert start["recipe_changes"] == {"model.focus.gate_lambda": [10.0, 5.0]}
    assert events(run, "end")[-1]["step"] == 4


def _records(run: pathlib.Path) -> list[dict]:
    from focus_pretrain.train import read_metrics

    return read_metrics(run)


def _wait_for_step(run: pathlib.Path, step: int, proc: subprocess.Popen) -> None:
    """Until the run has logged ``step`` (or the process ended, or the time bound passed)."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        if (run / "metrics.jsonl").is_file() and max(train_steps_logged(run), default=0) >= step:
            return
        time.sleep(0.2)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, cache):
    out = tmp_path / "run"
    args = [sys.executable, *script_args(overrides(out, cache, "train.steps=400"))]
    status = tmp_path / "exit-status"  # what launchers/slurm.sh reads to decide a requeue
    env = {**os.environ, "FOCUS_EXIT_STATUS_FILE": str(status)}
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    try:
        _wait_for_step(out, 2, proc)
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, rest
    assert "stopped by signal" in rest
    (end,) = events(out, "end")
    assert end["stopped_by_signal"] == signal.SIGTERM
    tag = (out / "checkpoints" / "latest").read_text()
    stopped_at = int(tag.split("_")[1])
    assert 2 <= stopped_at < 400 and end["step"] == stopped_at
    assert not list((out / "checkpoints").glob(".tmp-*"))  # nothing half-written remains
    assert status.read_text() == f"stopped_by_signal {int(signal.SIGTERM)} {stopped_at}\n"


@pytest.mark.multiprocess
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, cache):
    """Two torchrun processes (DP=2, ZeRO-1): only rank 1 receives SIGTERM, as step 3 begins.
    The ranks agree on the stop: both finish step 3, save its checkpoint (both optimizer shards)
    and exit 0, instead of one saving while the other waits in a collective; the restart
    resumes at step 3 and finishes."""
    out = tmp_path / "run"
    sets = overrides(out, cache, "train.steps=6")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    torchrun += ["--nproc-per-node", "2"]
    inject = str(ROOT / "tests" / "e2e" / "signal_during_step.py")
    stopped = runs.run([*torchrun, inject, "2", "1", *script_args(sets)], cwd=tmp_path)
    assert stopped.returncode == 0, stopped.stdout[-3000:] + stopped.stderr[-3000:]
    (end,) = events(out, "end")
    assert end["step"] == 3 and end["stopped_by_signal"] == signal.SIGTERM
    assert train_steps_logged(out) == [1, 2, 3]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000003"
    files = {p.name for p in (ckpts / "step_00000003").iterdir()}
    assert len([f for f in files if "optim_states" in f]) == 2, files
    assert not list(ckpts.glob(".tmp-*"))
    resumed = runs.run([*torchrun, *script_args(sets)], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert [(e["step"], e["resumed"]) for e in events(out, "start")] == [(0, False), (3, True)]
    assert train_steps_logged(out) == [1, 2, 3, 4, 5, 6]
    assert (ckpts / "latest").read_text() == "step_00000006"


def test_sigkill_while_saving_keeps_the_previous_checkpoint(tmp_path, cache):
    """SIGKILL after the first file of checkpoint 4 is written: ``latest`` still names
    checkpoint 2, which resumes; the half-written directory is cleared on restart."""
    sets = overrides(tmp_path, cache, "train.steps=6", "train.save_interval=2", "train.keep_last=5")
    args = [sys.executable, str(ROOT / "tests" / "e2e" / "kill_during_save.py"), "4"]
    killed = runs.run([*args, *script_args(sets)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000002"
    partial = ckpts / ".tmp-step_00000004"
    assert partial.is_dir() and not (ckpts / "step_00000004").exists()
    resumed = launch(sets)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert events(tmp_path, "start")[-1]["step"] == 2
    assert train_steps_logged(tmp_path)[-4:] == [3, 4, 5, 6]  # the restart's records
    assert (ckpts / "latest").read_text() == "step_00000006"
    assert not partial.exists()


@pytest.mark.parametrize(
    "bad, message",
    [  # refused by the recipe's validation: tests/unit/test_cli_bad_inputs.py (in-process)
        (
            'data.sources=["/no/such/corpus.jsonl"]',
            "corpus file /no/such/corpus.jsonl does not exist",
        ),
        ("model.vocab_size=256", "the tokenizer has 300 tokens but model.vocab_size is 256"),
    ],
)
def test_bad_input_fails_before_training(tmp_path, cache, bad, message):
    run = launch(overrides(tmp_path, cache, *(bad if isinstance(bad, list) else [bad])))
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-2000:]  # the user reads the error on stderr
    assert "train step" not in run.stdout and not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / "metrics.jsonl").exists() or not train_steps_logged(tmp_path)


def test_bf16_trains_like_fp32(tmp_path, cache, one_process):
    """bf16 under DeepSpeed (CPU here): the first loss within bf16 rounding of fp32's, and it
    learns. (fp16 needs a GPU: refused on CPU, see the bad-input test.)"""
    _, fp32_run = one_process  # the same recipe in fp32 for 3 steps
    bf16 = launch(overrides(tmp_path / "bf16", cache, "train.steps=3", "train.precision=bf16"))
    assert bf16.returncode == 0, bf16.stderr[-3000:]
    full, half = train_losses(fp32_run), train_losses(tmp_path / "bf16")
    assert half[1] == pytest.approx(full[1], rel=1e-2)
    assert half[3] < half[1] - 0.2
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert module_state(tmp_path / "bf16", 3)[qkv].dtype == torch.bfloat16
    assert module_state(fp32_run, 3)[qkv].dtype == torch.float32


def test_weights_and_biases_gets_the_same_keys_offline(tmp_path, cache):
    """``train.wandb=offline``: the run is written under ``run.output_dir/wandb`` without a
    network, with every train and valid scalar of ``metrics.jsonl`` under the TensorBoard
    keys (``train/loss``...) and the logged values (read from the offline run file, where the
    keys and the values' JSON are stored as text); the resolved config goes with it. Without
    the package the option is refused with the install command."""
    require_packages("wandb", extra="wandb")
    sets = overrides(tmp_path, cache, "train.steps=2", "train.eval_interval=2",
                     "train.eval_iters=1", "train.recall_docs=0", "train.wandb=offline",
                     "run.name=wb-test")  # fmt: skip
    run = launch(sets, env={**os.environ, "WANDB_SILENT": "true"})
    assert run.returncode == 0, run.stderr[-3000:]
    (log,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    data = log.read_bytes()
    records = [r for r in _records(tmp_path) if r.get("split") in ("train", "valid")]
    assert {r["split"] for r in records} == {"train", "valid"}
    for record in records:
        for key, value in record.items():
            if key in ("split", "step", "time") or value is None:
                continue
            assert f"{record['split']}/{key}".encode() in data, key
            shown = {json.dumps(value)}  # W&B writes a whole float as an int
            if isinstance(value, float) and value.is_integer():
                shown.add(json.dumps(int(value)))
            assert any(text.encode() in data for text in shown), (key, value)
    assert b"wb-test" in data and b"focus-pretrain" in data  # run name, project


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
    (start,) = events(tmp_path, "start")
    assert start["frozen"] > 0 and start["router"] == 2176
    assert start["optimized"] == 2176  # router parameters only
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


def _dry_run(recipe: str, *sets: str) -> tuple[str, dict]:
    """``--dry-run``: its console table and the plan (the JSON of its last line)."""
    args = [sys.executable, LAUNCHER, "--config", str(ROOT / "configs" / recipe), "--dry-run"]
    args += [x for item in sets for x in ("--set", item)]
    result = runs.run(args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, json.loads(result.stdout.strip().splitlines()[-1])


def test_dry_run_plans_the_7b_recipe():
    """Memory per GPU, parameters per GPU as ZeRO-3 partitions them, what the run reads
    (tokens per step, total) and how long it takes at the stated MFU, and a warning that the
    recipe as shipped trains on the synthetic demo corpus."""
    table, plan = _dry_run("7b.yaml", "train.peak_tflops=989")
    assert plan["parameters"] == 7_241_732_096 + 32 * (4096 * 16 + 4 * 16)
    assert plan["gpus"] == 32 and plan["fits"] and plan["total_gb"] < 80
    assert plan["zero_stage"] == 3 and plan["parameters_per_gpu"] == plan["parameters"] // 32
    data = plan["data"]
    assert data["tokens_per_step"] == 256 * 4096 and data["total_tokens"] > 1.9e9
    six_n = 6 * plan["parameters"] * data["total_tokens"] / (32 * 989e12 * 0.4) / 3600
    assert six_n < data["hours"] < 1.5 * six_n  # 6N per token plus attention
    assert "WARNING: this 7.2B-parameter recipe trains on the synthetic demo corpus" in table
    table, mine = _dry_run("7b.yaml", 'data.sources=["/data/shards"]', "parallel.gpus=1")
    assert not mine["fits"] and mine["data"]["demo_warning"] is None  # 16 B/param > 80 GB
    assert "WARNING" not in table and mine["data"]["hours"] is None  # no GPU: no peak known


def test_dry_run_plans_the_million_token_recipe():
    """configs/7b-1m.yaml: 2^20 tokens on TP 8 x CP 8 (ring) fits 80 GB GPUs; the same model
    without context parallelism (TP 8, 8 GPUs: 2^20 tokens per GPU) does not."""
    table, million = _dry_run("7b-1m.yaml")
    assert "CP 8 (ring)" in table
    assert million["gpus"] == 64 and million["context_parallel"] == 8
    assert million["tokens_per_gpu"] == 2**20 // 8 and million["fits"]
    assert 0 < million["context_parallel_gb"] < 2 and million["total_gb"] < 72
    _, alone = _dry_run("7b-1m.yaml", "parallel.context_parallel_size=1", "parallel.gpus=8")
    assert alone["tokens_per_gpu"] == 2**20 and not alone["fits"]
    assert alone["activations_gb"] > 7 * million["activations_gb"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    ["tp2", "dp2", "dp2-zero3", "dp2-offload", "cp2-ring-zero3", "tp2-sp-cp2-ring"],
)
def test_parallel_layouts_match_one_process(tmp_path, one_process, layout_run, layout):
    """TP=2 (through DeepSpeed's mpu adapter), DP=2 with ZeRO-2, ZeRO-3 or ZeRO-2 with the
    optimizer offloaded to CPU (DeepSpeedCPUAdam), and context parallelism (CP=2 ring under
    ZeRO-3; TP=2 with sequence parallelism x CP=2 ring; all-to-all in the torchrun test below)
    train like one process (same global batch: DP=1 accumulates two micro-batches; TP=2 x CP=2
    runs four processes; the layouts are in ``tests/e2e/conftest.py``)."""
    single, single_run = one_process
    results, run = layout_run(layout)
    assert len(results) == (4 if layout == "tp2-sp-cp2-ring" else 2)
    for result in results:
        assert result["step"] == 3
        assert result["train_loss"] == pytest.approx(single["train_loss"], rel=2e-4)
    if layout == "cp2-ring-zero3":  # a context-parallel ZeRO-3 checkpoint exports like one
        from safetensors.torch import load_file

        from focus_pretrain.convert import export_hf

        exported = [
            load_file(export_hf(path, tmp_path / f"hf-{i}") / "model.safetensors")
            for i, path in enumerate((single_run, run))
        ]
        assert exported[0].keys() == exported[1].keys()
        for key, value in exported[0].items():  # balance offsets included (Sinkhorn over CP)
            torch.testing.assert_close(exported[1][key], value, rtol=1e-3, atol=1e-4, msg=key)


@pytest.mark.multiprocess
def test_checkpoints_of_every_layout_hold_only_allowlisted_globals(
    tmp_path, one_process, layout_run
):
    """Every ``.pt`` file of the runs above (one process at ZeRO-1, and each parallel layout:
    TP=2, ZeRO-2, ZeRO-3, CPU offload, CP ring, TP x SP x CP) and of the ZeRO-3 run's universal
    form names no Python global outside ``storage.safe_load``'s allowlist, none of numpy's (the
    trainer stores numpy's RNG state as a list), and loads weights-only."""
    from focus_pretrain.checkpoint.reshard import UNIVERSAL_DIR, convert_to_universal
    from focus_pretrain.storage.safe_load import load_checkpoint_file, unsafe_globals

    layouts = ["tp2", "dp2", "dp2-zero3", "dp2-offload", "cp2-ring-zero3", "tp2-sp-cp2-ring"]
    runs_ = [one_process[1], *(layout_run(name)[1] for name in layouts)]
    folders = [max((run / "checkpoints").glob("step_*")) for run in runs_]
    zero3 = shutil.copytree(folders[3], tmp_path / folders[3].name)  # the shared run untouched
    before = {p.name: p.stat().st_size for p in zero3.iterdir()}
    folders.append(convert_to_universal(zero3))
    # the conversion deleted only its own scratch (.tmp-universal): every file of the input
    # checkpoint is still there, unchanged in size, beside the new universal form
    after = {p.name: p.stat().st_size for p in zero3.iterdir() if p.name != UNIVERSAL_DIR}
    assert after == before and (zero3 / UNIVERSAL_DIR).is_dir()
    named: set[str] = set()
    files = [path for folder in folders for path in sorted(folder.rglob("*.pt"))]
    for path in files:
        assert unsafe_globals(path) == [], path
        named.update(torch.serialization.get_unsafe_globals_in_checkpoint(path))
        load_checkpoint_file(path)
    assert len(files) > 100 and any("universal" in str(path) for path in files)
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in named  # the allowlist is used
    assert not [name for name in named if name.startswith("numpy")]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "launcher, zero_stage",
    [("deepspeed", 2), ("deepspeed", 3), ("torchrun", 1), ("srun", 2)],
)
def test_cluster_launchers_start_two_processes(tmp_path, cache, launcher, zero_stage):
    """``deepspeed``, ``torchrun`` and srun-style tasks (what ``launchers/slurm.sh`` starts:
    ranks only in ``SLURM_*`` variables) run two real (gloo) processes of the launcher script:
    data-parallel ZeRO training learns and leaves a checkpoint."""
    sets = overrides(
        tmp_path, cache, "train.steps=8", f"parallel.zero_stage={zero_stage}", "train.lr=3e-3"
    )
    script = script_args(sets)
    if launcher == "srun":
        run = _srun_like(script, tmp_path)
    elif launcher == "deepspeed":
        deepspeed = pathlib.Path(sys.executable).with_name("deepspeed")
        command = [str(deepspeed), "--num_gpus", "2", "--master_port", "{port}", *script]
        run = run_retrying_port(command, cwd=tmp_path)
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", *script]
        run = runs.run(command, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (start,) = events(tmp_path, "start")
    assert start["dp"] == 2
    assert train_steps_logged(tmp_path) == list(range(1, 9))  # one record per step, rank 0's
    assert len([line for line in run.stdout.splitlines() if line.startswith("train step")]) == 8
    seen = train_losses(tmp_path)
    assert seen[8] < seen[1] - 0.5, seen
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000008"
    files = {p.name for p in (ckpts / "step_00000008").iterdir()}
    assert "config.yaml" in files and len([f for f in files if "optim_states" in f]) == 2, files


def _srun_like(script: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Two tasks with the environment ``srun`` gives them (no RANK/WORLD_SIZE); a rendezvous
    port taken by another process meanwhile is retried with a new one."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    for _attempt in range(3):
        port = str(free_port())
        env.update(SLURM_STEP_NUM_TASKS="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs = [
            subprocess.Popen(
                [sys.executable, *script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=cwd,
                env={**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            )
            for rank in range(2)
        ]
        try:
            outs = [p.communicate(timeout=TIMEOUT) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        code = max(abs(p.returncode) for p in procs)
        errors = outs[0][1] + outs[1][1]
        if code == 0 or "Address already in use" not in errors:
            break
    return subprocess.CompletedProcess(procs[0].args, code, outs[0][0], errors)


def _hf_gpt2_with_tokenizer(root: pathlib.Path) -> pathlib.Path:
    """A tiny random HF GPT-2 plus its own byte-level BPE tokenizer, in one directory."""
    import transformers

    from focus_pretrain.data import demo_documents
    from tests.helpers import make_hf_tokenizer

    path = make_hf_tokenizer(root / "hf-gpt2", demo_documents(200, seed=1234), vocab_size=400)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=400, n_positions=128
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path


RETROFIT_GPT2 = [
    "model.family=gpt2",
    "model.num_attention_heads=4",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=256",
    "model.vocab_size=400",
    "model.norm_epsilon=1e-5",
]


def test_retrofit_from_a_huggingface_checkpoint(tmp_path, cache):
    """``train.init_from_hf``: the imported weights (GPT-2 here) stay bit-identical to the HF
    checkpoint's while only the routers train, on the checkpoint's own tokenizer; another
    tokenizer is refused before any work."""
    from focus_pretrain.convert import hf_model_config, import_hf

    hf = _hf_gpt2_with_tokenizer(tmp_path)
    sets = overrides(
        tmp_path / "run",
        str(tmp_path / "cache"),
        *RETROFIT_GPT2,
        f"data.tokenizer={hf}",
        f"train.init_from_hf={hf}",
        "train.freeze=retrofit",
        "train.steps=3",
        "train.save_interval=1",
        "train.keep_last=5",
    )
    run = launch(sets)
    assert run.returncode == 0, run.stderr[-3000:]
    (start,) = events(tmp_path / "run", "start")
    assert start["hf_tensors"] == 28 and start["optimized"] == 2176
    imported = import_hf(hf, hf_model_config(hf), tp_rank=0)
    one, three = module_state(tmp_path / "run", 1), module_state(tmp_path / "run", 3)
    for name, tensor in imported.items():
        assert torch.equal(three[name], tensor), name  # frozen and exactly the HF weights
    routers = [n for n in one if ".router." in n and isinstance(one[n], torch.Tensor)]
    assert routers and all(not torch.equal(one[n], three[n]) for n in routers)

    # the routers alone, as an adapter on the original, unmodified HF model
    adapter = tmp_path / "adapter"
    tool = [sys.executable, str(ROOT / "tools" / "convert_to_hf.py"), str(tmp_path / "run")]
    done = runs.run([*tool, str(adapter), "--adapter-only"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((adapter / "focus_adapter.json").read_text())["parameters"] == 2 * (
        64 * 16 + 4 * 16
    )
    import transformers

    from focus_pretrain.convert import attach_focus_adapter

    original = transformers.GPT2LMHeadModel.from_pretrained(hf).eval()
    attach_focus_adapter(original, adapter)
    x = torch.randint(0, 400, (2, 100), generator=torch.Generator().manual_seed(0))
    ckpt = str(tmp_path / "run" / "checkpoints" / "step_00000003")
    (ours,) = run_workers("tests.e2e.workers_train:checkpoint_logits", 1, ckpt, x, 0)
    with torch.no_grad():
        hard = original(x).logits
    assert not torch.allclose(ours["hard"], ours["soft"])
    torch.testing.assert_close(hard, ours["hard"], rtol=1e-4, atol=1e-4)

    wrong = launch(overrides(tmp_path / "wrong", cache, *RETROFIT_GPT2, f"train.init_from_hf={hf}"))
    assert wrong.returncode == 2  # one line naming the fix, before any data work
    assert "ships its own tokenizer" in wrong.stderr and "train step" not in wrong.stdout
    family = launch(overrides(tmp_path / "family", cache, f"train.init_from_hf={hf}"))  # llama
    assert family.returncode == 2 and "Traceback" not in family.stderr
    assert "model.family is 'llama' but the HuggingFace checkpoint has 'gpt2'" in family.stderr
    assert "tokenising" not in family.stdout + family.stderr  # refused before the data


@pytest.mark.multiprocess
def test_context_parallel_with_data_parallel_through_torchrun(tmp_path, cache, one_process):
    """Four torchrun processes: CP=2 (all-to-all) x DP=2 with ZeRO-2 train like one process."""
    single, _ = one_process
    sets = overrides(
        tmp_path / "cp", cache, "train.steps=3", "parallel.context_parallel_size=2",
        "parallel.cp_mode=a2a", "parallel.zero_stage=2",
    )  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "4", *script_args(sets)]
    run = runs.run(command, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (start,) = events(tmp_path / "cp", "start")
    assert (start["dp"], start["tp"], start["cp"]) == (2, 1, 2)
    seen = train_losses(tmp_path / "cp")
    assert sorted(seen) == [1, 2, 3]
    assert seen[3] == pytest.approx(single["train_loss"], rel=2e-4)
    assert (tmp_path / "cp" / "checkpoints" / "latest").read_text() == "step_00000003"


DOCUMENT_KEYS = [
    "data.document_mask=true",
    "data.reset_position_ids=true",
    "data.eod_mask_loss=true",
    "train.eval_interval=3",
    "train.eval_iters=1",
    "train.recall_docs=0",  # demo recall needs longer samples than the small recipe's
    "probes.lengths=[128]",  # scored with the run's document fields
    "probes.count=1",
    "probes.kinds=[passkey]",
    "probes.depths=[0.5]",
]


@pytest.mark.multiprocess
def test_packed_documents_train_alike_under_context_parallelism(tmp_path, cache, one_process):
    """The document keys on: the small recipe in one process and at CP=2 (ring; the shards
    carry the global document starts) train alike, validation runs on packed documents, and
    the run differs from the same recipe without them (demo documents are shorter than a
    sample, so the masking changes the losses)."""
    single, _ = one_process
    got = {}
    for name, processes, extra in (
        ("one", 1, []),
        ("cp2", 2, ["parallel.context_parallel_size=2", "parallel.cp_mode=ring"]),
    ):
        sets = overrides(tmp_path / name, cache, "train.steps=3", *DOCUMENT_KEYS, *extra)
        got[name] = run_workers("tests.e2e.workers_train:train", processes, sets)
    (one,) = got["one"]
    for result in got["cp2"]:
        assert result["step"] == 3
        assert result["train_loss"] == pytest.approx(one["train_loss"], rel=2e-4)
    assert abs(one["train_loss"] - single["train_loss"]) > 1e-4
    from focus_pretrain.train import read_metrics

    valid = [r for r in read_metrics(tmp_path / "cp2") if r.get("split") == "valid"]
    assert valid and math.isfinite(valid[-1]["loss"])
    assert math.isfinite(valid[-1]["passkey_loss"])
