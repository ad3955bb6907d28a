"""Bad steps on a real run: a micro-batch poisoned to NaN makes its optimizer step a skipped
step (weights, Adam state and router balance exactly as before it, the batch consumed, the
count logged), and training goes on; ``train.max_consecutive_bad_steps`` bad steps in a row stop
the run with a checkpoint, the reason and a non-zero exit. The fault is injected from outside
the product (``poison_micro_batches.py``)."""

from __future__ import annotations

import math
import os
import pathlib
import sys

import pytest
import torch

from tests.e2e import runs
from tests.e2e.runs import events, overrides, script_args

pytestmark = pytest.mark.e2e
POISON = str(pathlib.Path(__file__).with_name("poison_micro_batches.py"))


def optimizer_tensors(run: pathlib.Path, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``step``'s optimizer state (fp32 master weights, Adam
    moments and step counts), by file and key path."""
    found: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(f"{prefix}/{key}", item)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)

    for path in sorted((run / "checkpoints" / f"step_{step:08d}").glob("*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)
        # ZeRO >= 1: the *optim_states.pt files; ZeRO-0: the model states' "optimizer"
        walk(path.name, state if "optim_states" in path.name else state.get("optimizer"))
    assert found, f"no optimizer state in checkpoint {step}"
    return found


def module_state(run: pathlib.Path, step: int) -> dict:
    """The module state of checkpoint ``step`` (under ZeRO-3 its parameters are empty: the
    fp32 partitions in the optimizer files hold them; buffers are there)."""
    (path,) = (run / "checkpoints" / f"step_{step:08d}").glob("*mp_rank_00_model_states.pt")
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


def same(a: dict, b: dict) -> bool:
    """Equal keys, and every tensor bit-for-bit equal (non-tensors, e.g. extra state: ==)."""
    tensors = [k for k in a if isinstance(a[k], torch.Tensor)]
    assert len(tensors) > 2
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if k in tensors else a[k] == b[k] for k in a
    )


@pytest.mark.parametrize(("zero_stage", "precision"), [(0, "bf16"), (2, "fp32"), (3, "bf16")])
def test_bad_steps_are_skipped_and_too_many_stop_the_run(tmp_path, cache, zero_stage, precision):
    """ZeRO-0 with bf16 is where DeepSpeed itself would take the NaN step (its ZeRO-1/2/3
    optimizers skip a non-finite norm on their own in this version): the trainer's skip is
    what keeps the weights there."""
    out, status = tmp_path / "run", tmp_path / "exit-status"
    sets = overrides(
        out,
        cache,
        "train.steps=8",
        "train.save_interval=1",
        "train.keep_last=10",
        "train.max_consecutive_bad_steps=2",
        f"parallel.zero_stage={zero_stage}",
        f"train.precision={precision}",
    )
    # two micro-batches a step: step 2 is bad (one of its two), steps 4 and 5 are bad
    args = [sys.executable, POISON, "2,6,7,8", *script_args(sets)]
    run = runs.run(args, env={**os.environ, "FOCUS_EXIT_STATUS_FILE": str(status)})
    assert run.returncode != 0, run.stdout[-2000:]
    assert "2 consecutive optimizer steps (4-5)" in run.stderr, run.stderr[-3000:]
    assert "train.max_consecutive_bad_steps" in run.stderr and "Traceback" not in run.stderr
    assert status.read_text() == "failed bad_steps 5\n"  # launchers/slurm.sh does not requeue
    assert (out / "checkpoints" / "latest").read_text() == "step_00000005"
    (end,) = events(out, "end")
    assert end["step"] == 5 and end["bad_steps"] == 2 and "stopped with checkpoint" in end["error"]

    records = {r["step"]: r for r in runs.read_metrics(out) if r.get("split") == "train"}
    assert [records[s]["skipped_steps"] for s in range(1, 6)] == [0, 1, 1, 2, 3]
    # no NaN or inf in the curves (and metrics.jsonl stays strict JSON)
    assert not {"loss", "grad_norm"} & (records[2].keys() | records[5].keys())
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 3))
    weights = {s: module_state(out, s) for s in (1, 2, 3, 5)}
    adam = {s: optimizer_tensors(out, s) for s in (1, 2, 3, 5)}
    # a skipped step leaves weights (router balance offsets included) and optimizer untouched
    assert same(weights[2], weights[1]) and same(adam[2], adam[1])
    assert same(weights[5], weights[3]) and same(adam[5], adam[3])
    assert not same(weights[3], weights[2]) and not same(adam[3], adam[2])  # step 3 trained
    assert any("balance_offsets" in k for k in weights[1])
