"""``launchers/slurm.sh`` requeues its job only when the run stopped on a signal (SLURM's
pre-timeout SIGTERM): run with stand-ins for ``srun`` (which writes the exit status the trainer
would write, ``FOCUS_EXIT_STATUS_FILE``) and ``scontrol`` (which records its calls) on the
PATH. The trainer's side (it writes that status) is checked by the end-to-end SIGTERM and
resume tests."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parents[2]
SCRIPT = ROOT / "launchers" / "slurm.sh"

FAKE_SRUN = """#!/bin/bash
# the trainer's exit status (nothing when FAKE_STATUS is empty), then FAKE_RC
[ -n "$FAKE_STATUS" ] && printf '%s\\n' "$FAKE_STATUS" > "$FOCUS_EXIT_STATUS_FILE"
echo "srun $*" >> "$CALLS"
exit "${FAKE_RC:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$CALLS"
[ "$1" = show ] && echo node-a
exit 0
"""


def _run(tmp_path: pathlib.Path, status: str, rc: int = 0) -> tuple[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CALLS": str(calls),
        "FAKE_STATUS": status,
        "FAKE_RC": str(rc),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_CPUS_PER_TASK": "4",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }
    env.pop("FOCUS_EXIT_STATUS_FILE", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "configs/tiny.yaml", "--set", "train.steps=5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert not (ROOT / ".focus-exit-4242").exists()  # the status file is cleaned up
    return proc.returncode, calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize(
    ("status", "rc", "requeued", "ok"),
    [
        ("stopped_by_signal 15 120", 0, True, True),  # the pre-timeout SIGTERM
        ("done 500", 0, False, True),  # training finished
        ("", 1, False, False),  # a crash: srun fails, no requeue
        ("", 0, False, False),  # no status written: an error, not a requeue
    ],
)
def test_requeue_only_after_a_stop_by_signal(tmp_path, status, rc, requeued, ok):
    code, calls = _run(tmp_path, status, rc)
    assert (code == 0) == ok
    assert calls[0] == "scontrol show hostnames node-[a-b]"
    launched = [c for c in calls if c.startswith("srun ")]
    assert len(launched) == 1 and "configs/tiny.yaml --set train.steps=5" in launched[0]
    assert ("scontrol requeue 4242" in calls) == requeued
