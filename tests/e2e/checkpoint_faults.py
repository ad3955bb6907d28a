"""The fault-injection scenarios of ``test_checkpoint_faults.py``, run in one worker process (the
real trainer, in-process, a few steps each: a launch costs ~0.3 s here instead of ~15 s as a
new process).

A kill is a :class:`Killed` (a ``BaseException``, which no code of ours catches) raised from a
wrapped filesystem call at the chosen point of a save: the product's code stops exactly there,
leaving the disk as a SIGKILL would (``tests/e2e/test_train.py`` also kills a real process
with SIGKILL mid-save). Each scenario returns what was on disk after the fault and after the
next start, for the test to assert.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import traceback

import torch

from focus_pretrain.config import load_config
from focus_pretrain.errors import InputError
from focus_pretrain.storage.files import RunLock
from focus_pretrain.train import pretrain
from tests.e2e.runs import RECIPE, events, overrides, train_losses, train_steps_logged

CKPT = "step_{:08d}"


class Killed(BaseException):
    """The process dies here (nothing of ours catches a BaseException)."""


def train(out: pathlib.Path, cache: str, steps: int, keep_last: int = 1) -> dict:
    """The small recipe to ``steps`` in ``out`` (resuming what is there), saving every 2."""
    sets = overrides(out, cache, f"train.steps={steps}", "train.save_interval=2")
    return pretrain(load_config(RECIPE, [*sets, f"train.keep_last={keep_last}"]))


def on_disk(out: pathlib.Path) -> dict:
    """The checkpoints directory's entries (DeepSpeed's recovery scripts aside), what
    ``latest`` says, and each file's bytes (to prove nothing changed)."""
    root = out / "checkpoints"
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith("zero_to_"))
    latest = (root / "latest").read_text() if (root / "latest").is_file() else None
    files = {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }
    return {"entries": names, "latest": latest, "files": files}


@contextlib.contextmanager
def killed_at(phase: str, step: int):
    """Raise :class:`Killed` at ``phase`` of the save of ``step``:

    * ``shards``: after DeepSpeed's first file of the checkpoint is written;
    * ``folder:before`` / ``folder:after``: the rename of the complete temporary folder to
      ``step_N``;
    * ``latest:before`` / ``latest:after``: the rename moving ``latest`` to it;
    * ``prune:after``: once the older checkpoint was renamed for deletion, before it is gone.
    """
    tag = CKPT.format(step)
    save, rename, replace = torch.save, os.rename, os.replace

    def torch_save(obj, f, *args, **kwargs):
        save(obj, f, *args, **kwargs)
        if phase == "shards" and f".tmp-{tag}" in str(f):
            raise Killed(phase)

    def os_rename(src, dst, *args, **kwargs):
        src_name, dst_name = pathlib.Path(src).name, pathlib.Path(dst).name
        hit = (phase.startswith("folder") and (src_name, dst_name) == (f".tmp-{tag}", tag)) or (
            phase.startswith("prune") and dst_name.startswith(".deleting-step_")
        )
        if hit and phase.endswith(":before"):
            raise Killed(phase)
        rename(src, dst, *args, **kwargs)
        if hit:
            raise Killed(phase)

    def os_replace(src, dst, *args, **kwargs):
        hit = phase.startswith("latest") and pathlib.Path(dst).name == "latest"
        hit = hit and pathlib.Path(src).read_text() == tag
        if hit and phase.endswith(":before"):
            raise Killed(phase)
        replace(src, dst, *args, **kwargs)
        if hit:
            raise Killed(phase)

    torch.save, os.rename, os.replace = torch_save, os_rename, os_replace
    try:
        yield
    finally:
        torch.save, os.rename, os.replace = save, rename, replace


def kill_during_save(base: pathlib.Path, cache: str, phase: str) -> dict:
    """Train to 6 with a save every 2 (keep 1), killed at ``phase`` of step 4's save, then
    started again: what was on disk after the kill, and after the restart."""
    out = base / phase.replace(":", "-")
    try:
        with killed_at(phase, 4):
            train(out, cache, 6)
    except Killed:
        pass
    else:
        raise AssertionError(f"the fault {phase} was never reached")
    after_kill = on_disk(out)
    train(out, cache, 6)
    return {
        "after_kill": after_kill,
        "resumed_at": events(out, "start")[-1]["step"],
        "after_restart": on_disk(out),
        "losses": train_losses(out),
        "steps_logged": train_steps_logged(out),
    }


def refused(out: pathlib.Path, cache: str, steps: int = 6) -> dict:
    """Start the run in ``out`` expecting a refusal: the message, and the disk before and
    after (must be equal)."""
    before = on_disk(out)
    try:
        train(out, cache, steps)
    except InputError as err:
        return {"message": str(err), "before": before, "after": on_disk(out)}
    return {"message": None, "before": before, "after": on_disk(out)}


def damaged_latest(base: pathlib.Path, cache: str, damage: str) -> dict:
    """Two checkpoints (2, 4); ``latest`` (4) then damaged as ``damage`` says: the refusal;
    then the fix the refusal offers (``latest`` -> step 2) and the start that follows."""
    out = base / f"damaged-{damage}"
    train(out, cache, 4, keep_last=2)
    root, folder = out / "checkpoints", out / "checkpoints" / CKPT.format(4)
    if damage == "corrupt":
        path = folder / "mp_rank_00_model_states.pt"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x5A  # one byte in the middle of the weights
        path.write_bytes(bytes(data))
    elif damage == "truncated":
        path = next(folder.glob("*optim_states.pt"))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "missing-file":
        (folder / "mp_rank_00_model_states.pt").unlink()
    else:  # the pointer itself
        pointer = root / "latest"
        {
            "dangling": lambda: pointer.write_text(CKPT.format(9)),
            "empty": lambda: pointer.write_text(""),
            "no-latest": pointer.unlink,
            "not-a-tag": lambda: pointer.write_text("global_step4"),
        }[damage]()
    result = refused(out, cache)
    (root / "latest").write_text(CKPT.format(2))  # what the refusal offers
    train(out, cache, 6, keep_last=2)
    result["resumed_after_fix"] = events(out, "start")[-1]["step"]
    result["losses"] = train_losses(out)
    return result


def rollback(base: pathlib.Path, cache: str) -> dict:
    """Checkpoints 2, 4, 6; ``latest`` rolled back to 2; trained on to 3 with keep_last 1
    (pruning must keep 4 and 6: newer), then to 4 (which replaces the old step 4)."""
    out = base / "rollback"
    train(out, cache, 6, keep_last=3)
    root = out / "checkpoints"
    old_step4 = (root / CKPT.format(4) / "checkpoint.json").read_bytes()
    (root / "latest").write_text(CKPT.format(2))
    result = {"first": train(out, cache, 3), "after_3": on_disk(out)}
    result["second"] = train(out, cache, 4)
    result["after_4"] = on_disk(out)
    result["step4_replaced"] = (root / CKPT.format(4) / "checkpoint.json").read_bytes() != old_step4
    result["starts"] = [e["step"] for e in events(out, "start")]
    return result


def two_runs(base: pathlib.Path, cache: str) -> dict:
    """A live run holds the directory (its lock) and is saving (``.tmp-step_00000099``); a
    second run there is refused and deletes nothing."""
    out = base / "two-runs"
    train(out, cache, 2)
    live = out / "checkpoints" / ".tmp-step_00000099"
    live.mkdir()
    (live / "mp_rank_00_model_states.pt").write_bytes(b"being written")
    with RunLock(out).acquire():  # another process holding it: the same to flock
        result = refused(out, cache)
    result["live_save_kept"] = (live / "mp_rank_00_model_states.pt").is_file()
    train(out, cache, 4)  # once the other run is gone, this one may train
    result["after_release"] = on_disk(out)
    return result


PHASES = ("shards", "folder:before", "folder:after", "latest:before", "latest:after", "prune:after")
DAMAGES = ("dangling", "empty", "no-latest", "not-a-tag", "corrupt", "truncated", "missing-file")


def run_all(rank: int, world_size: int, base: str, cache: str) -> dict:
    """Every scenario, and an uninterrupted reference run: ``{name: observations}``."""
    base = pathlib.Path(base)
    reference = base / "reference"
    train(reference, cache, 6)
    results: dict = {"reference": {"losses": train_losses(reference), "run": str(reference)}}
    scenarios = {f"kill:{phase}": (kill_during_save, phase) for phase in PHASES}
    scenarios.update({f"damaged:{d}": (damaged_latest, d) for d in DAMAGES})
    scenarios.update({"rollback": (rollback,), "two-runs": (two_runs,)})
    for name, (scenario, *args) in scenarios.items():
        try:
            results[name] = scenario(base, cache, *args)
        except Exception:  # that scenario's test fails with it; the others still run
            results[name] = {"error": traceback.format_exc()}
    return results


def observed(results: dict, name: str) -> dict:
    """Scenario ``name``'s observations; its traceback as the failure if it raised."""
    result = results[name]
    if "error" in result:
        raise AssertionError(f"scenario {name} raised:\n{result['error']}")
    return result
