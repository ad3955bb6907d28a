"""The package works installed from a wheel, outside the source checkout (a cluster image, a
`pip install` from a git URL): every subcommand is a module of the package and the recipes ship
inside it, so `focus-pretrain train --config tiny` needs no checkout."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def test_the_wheel_runs_every_command_outside_the_checkout(tmp_path):
    """Build the wheel, install it (without dependencies) into a fresh virtual environment whose
    dependencies come from the locked one (a path, not its editable install), then run from a
    directory outside the checkout: the package imported is the wheel's, a shipped recipe plans
    by name, and subcommands answer."""
    wheels, env, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "work"
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT], tmp_path)
    (wheel,) = wheels.glob("focus_pretrain-*.whl")
    venv.create(env, with_pip=False)
    python = env / "bin" / "python"
    site = _run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path
    )
    locked = sysconfig.get_paths()["purelib"]  # torch, megatron-core...: a plain path entry
    (Path(site.stdout.strip()) / "locked-dependencies.pth").write_text(locked + "\n")
    _run([*pip, "--python", python, "install", "-q", "--no-deps", wheel], tmp_path)
    work.mkdir()
    where = _run([python, "-c", "import focus_pretrain; print(focus_pretrain.__file__)"], work)
    assert where.stdout.startswith(str(env)), where.stdout  # not the checkout's
    command = env / "bin" / "focus-pretrain"
    plan = _run([command, "train", "--config", "tiny", "--dry-run"], work)
    assert json.loads(plan.stdout.strip().splitlines()[-1])["fits"] is True
    recipes = _run([command, "recipes"], work).stdout
    assert "tiny " in recipes and "retrofit " in recipes and str(env) in recipes
    usage = _run([command, "retrofit", "--help"], work).stdout
    assert usage.startswith("usage: focus-pretrain retrofit") and "--max-hard-gap" in usage
