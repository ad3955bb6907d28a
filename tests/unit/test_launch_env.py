"""Rank discovery: launcher variables win, srun tasks map SLURM's, a bare process is rank 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from focus_pretrain.parallel.launch import launch_environment


def test_launcher_variables_are_kept():
    assert launch_environment({"RANK": "3", "WORLD_SIZE": "8", "SLURM_PROCID": "5"}) == {}


def test_srun_tasks_take_their_rank_from_slurm():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "8",
        "MASTER_ADDR": "node-001",
        "MASTER_PORT": "23456",
    }
    assert launch_environment(env) == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "MASTER_PORT": "23456",
    }


def test_srun_without_master_addr_is_a_clear_error():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        launch_environment(env)


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "32"},
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"},
    ],
)
def test_a_single_process_is_rank_zero(env):
    """Plain ``python``, also inside an sbatch script before srun (no job step yet)."""
    got = launch_environment(env)
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"]) == ("0", "1", "0")
    assert got["MASTER_ADDR"] == "127.0.0.1" and 0 < int(got["MASTER_PORT"]) < 65536


def test_process_group_timeout_comes_from_the_recipe():
    """``parallel.timeout_minutes`` is the default group's collective timeout (a lone process;
    in a subprocess, since it initialises ``torch.distributed``)."""
    from focus_pretrain.config import load_config

    code = (
        "import os, torch, torch.distributed as dist\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0')\n"
        "from focus_pretrain.parallel.launch import init_distributed\n"
        "init_distributed(float(os.environ['MINUTES']))\n"
        "pg = dist.distributed_c10d._get_default_group()\n"
        "print('timeout', pg._get_backend(torch.device('cpu')).options._timeout)\n"
    )
    minutes = load_config("configs/tiny.yaml", ["parallel.timeout_minutes=7"]).parallel
    env = {**os.environ, "MINUTES": str(minutes.timeout_minutes)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "timeout 0:07:00" in out.stdout
    with pytest.raises(ValueError, match=r"parallel\.timeout_minutes"):
        load_config("configs/tiny.yaml", ["parallel.timeout_minutes=0"])
