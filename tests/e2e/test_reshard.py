"""Resharding (``train.load_universal``): a checkpoint resumes at another data-parallel size,
tensor-parallel size and ZeRO stage with the optimizer state kept, in real (gloo) processes.

Each test trains the small recipe (fp32) 5 steps straight in the source layout, checkpointing
at step 3, then resumes copies of that run stopped at step 3 (``latest`` rewound to it, the
later checkpoint and the metrics removed) in other layouts. The resumed run's step 4 (the
weights and the data position) and step 5 (the Adam moments too) must reproduce the straight
run's losses; a resume from the same universal checkpoint with the moments zeroed keeps step 4
and loses step 5. What a run measured is read from the ``metrics.jsonl`` and the checkpoints
it writes.
"""

from __future__ import annotations

import pathlib
import shutil
import sys

import pytest
import torch

from tests.distributed import run_workers
from tests.e2e import runs
from tests.e2e.runs import ROOT, events, overrides, train_losses

pytestmark = [pytest.mark.e2e, pytest.mark.multiprocess]

STRAIGHT = ["train.steps=5", "train.save_interval=3"]
RESUME = ["train.steps=5", "train.load_universal=true"]
STEP3 = "checkpoints/step_00000003"


def _train(run: pathlib.Path, cache: str, processes: int, *sets: str) -> None:
    run_workers("tests.e2e.workers_train:train", processes, overrides(run, cache, *sets))


def _stopped_at_step_3(source: pathlib.Path, to: pathlib.Path) -> pathlib.Path:
    """A copy of ``source`` as it was when its step-3 checkpoint was the latest."""
    shutil.copytree(source, to)
    (to / "metrics.jsonl").unlink()
    shutil.rmtree(to / "checkpoints" / "step_00000005")
    (to / "checkpoints" / "latest").write_text("step_00000003")
    return to


def _without_moments(source: pathlib.Path, to: pathlib.Path, resumed: pathlib.Path | None):
    """``source`` stopped at step 3 with its universal checkpoint (``resumed``'s, or converted
    by ``tools/reshard_checkpoint.py``), Adam moments zeroed (weights and step count kept)."""
    run = _stopped_at_step_3(source, to)
    universal = run / STEP3 / "universal"
    if resumed is not None:
        shutil.copytree(resumed / STEP3 / "universal", universal)
    else:
        tool = [sys.executable, str(ROOT / "tools" / "reshard_checkpoint.py"), str(run)]
        done = runs.run(tool)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip().endswith(f"universal checkpoint: {universal}")
    zeroed = 0
    for path in universal.glob("zero/*/exp_avg*.pt"):
        state = torch.load(path, weights_only=False)
        state["param"] = torch.zeros_like(state["param"])
        torch.save(state, path)
        zeroed += 1
    assert zeroed > 20
    return run


def _check_resumed(run: pathlib.Path, straight: dict[int, float], dp: int, tp: int) -> None:
    """Resumed at step 3 in the layout ``dp x tp``; steps 4 and 5 equal the straight run's to
    fp32 tolerance; the step-5 checkpoint carries step and consumed samples on."""
    start = events(run, "start")[-1]
    assert (start["step"], start["resumed"], start["dp"], start["tp"]) == (3, True, dp, tp)
    losses = train_losses(run)
    assert sorted(losses) == [4, 5]
    for step in (4, 5):
        assert losses[step] == pytest.approx(straight[step], rel=1e-6, abs=0), (step, losses)
    states = min((run / "checkpoints" / "step_00000005").glob("*mp_rank_00_model_states.pt"))
    client = torch.load(states, map_location="cpu", weights_only=False)
    assert (client["step"], client["consumed_samples"]) == (5, 5 * 4)
    assert (run / STEP3 / "universal" / "zero" / "optimizer_state.pt").is_file()


def _check_moments_matter(run: pathlib.Path, straight: dict[int, float]) -> None:
    """Zeroed moments: step 4 (same weights, same batch) unchanged, step 5 off."""
    losses = train_losses(run)
    assert losses[4] == pytest.approx(straight[4], rel=1e-6, abs=0)
    assert abs(losses[5] - straight[5]) > 1e-3, losses


def test_zero2_dp2_resumes_at_dp1_and_at_tp2_under_zero3(tmp_path, cache):
    """ZeRO-2 at DP=2 resumes at DP=1 (ZeRO-2), and at TP=2 x DP=1 under ZeRO-3 (tensor
    parallelism split from TP=1: the per-group QKV, the gated fc1 halves, row-parallel
    weights); a plain resume at DP=1 is refused, naming ``train.load_universal``."""
    source = tmp_path / "dp2"
    _train(source, cache, 2, *STRAIGHT, "parallel.zero_stage=2")
    straight = train_losses(source)

    plain = _stopped_at_step_3(source, tmp_path / "plain")
    with pytest.raises(Exception, match=r"train\.load_universal=true") as refused:
        _train(plain, cache, 1, "train.steps=5", "parallel.zero_stage=2")
    assert "data-parallel size: 2 in the checkpoint, 1 now" in str(refused.value)
    assert not (plain / "metrics.jsonl").exists()  # refused before training

    dp1 = _stopped_at_step_3(source, tmp_path / "dp1")
    _train(dp1, cache, 1, *RESUME, "parallel.zero_stage=2")
    _check_resumed(dp1, straight, dp=1, tp=1)

    tp2 = _stopped_at_step_3(source, tmp_path / "tp2-zero3")
    _train(tp2, cache, 2, *RESUME, "parallel.zero_stage=3", "parallel.tensor_parallel_size=2")
    _check_resumed(tp2, straight, dp=1, tp=2)

    dropped = _without_moments(source, tmp_path / "no-moments", resumed=None)
    _train(dropped, cache, 1, *RESUME, "parallel.zero_stage=2")
    _check_moments_matter(dropped, straight)


def test_zero3_tp2_dp2_resumes_at_tp1_dp2(tmp_path, cache):
    """ZeRO-3 at TP=2 x DP=2 (four processes; GQA: one KV group per tensor-parallel rank)
    resumes at TP=1 x DP=2 under ZeRO-3: DeepSpeed's converter merges the ZeRO-3 partitions of
    both tensor-parallel ranks by our shard kinds."""
    source = tmp_path / "tp2-dp2"
    _train(source, cache, 4, *STRAIGHT, "parallel.zero_stage=3", "parallel.tensor_parallel_size=2")
    straight = train_losses(source)

    tp1 = _stopped_at_step_3(source, tmp_path / "tp1-dp2")
    _train(tp1, cache, 2, *RESUME, "parallel.zero_stage=3")
    _check_resumed(tp1, straight, dp=2, tp=1)

    dropped = _without_moments(source, tmp_path / "no-moments", resumed=tp1)
    _train(dropped, cache, 2, *RESUME, "parallel.zero_stage=3")
    _check_moments_matter(dropped, straight)
