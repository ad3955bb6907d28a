"""focus_pretrain.storage: durable writes (fsync before every rename), the run lock, output
directories replaced only when ours, ``latest`` validation, manifests, pruning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import zlib

import pytest

from focus_pretrain.errors import InputError
from focus_pretrain.storage import checkpoint_files as cf
from focus_pretrain.storage.files import (
    RunInUseError,
    RunLock,
    check_output_dir,
    is_locked,
    partial_dir,
    replace_dir,
    write_atomic,
)


def _folders(root, *steps):
    for step in steps:
        folder = root / cf.tag_for(step)
        folder.mkdir(parents=True)
        (folder / "weights.pt").write_bytes(os.urandom(64 + step))
        cf.write_manifest(folder, {})
    return root


# -- latest ---------------------------------------------------------------------------------


def test_a_fresh_directory_has_no_latest(tmp_path):
    assert cf.read_latest(tmp_path / "none") is None
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / ".tmp-step_00000002").mkdir()  # a killed first save: still fresh
    assert cf.read_latest(tmp_path / "ckpt") is None


@pytest.mark.parametrize(
    "pointer, message",
    [
        (None, "holds checkpoints but no latest file (checkpoints present: step_00000002, "),
        ("", "latest is empty (checkpoints present: step_00000002, step_00000004)"),
        ("  \n", "latest is empty"),
        ("step_00000009", "names step_00000009, which does not exist (checkpoints present:"),
        ("global_step4", "names 'global_step4', which is not a checkpoint tag"),
    ],
)
def test_a_missing_empty_or_dangling_latest_is_refused_naming_the_folders(
    tmp_path, pointer, message
):
    root = _folders(tmp_path, 2, 4)
    if pointer is not None:
        (root / "latest").write_text(pointer)
    with pytest.raises(cf.CheckpointStateError) as err:
        cf.read_latest(root)
    assert message in str(err.value)
    assert f"echo step_00000004 > {root / 'latest'}" in str(err.value)
    (root / "latest").write_text("step_00000002\n")
    assert cf.read_latest(root) == "step_00000002"


def test_a_latest_whose_checkpoints_are_all_gone_is_refused(tmp_path):
    (tmp_path / "latest").write_text("step_00000003")
    with pytest.raises(cf.CheckpointStateError, match=r"no checkpoint folder remains\): delete"):
        cf.read_latest(tmp_path)


# -- manifest and verification ----------------------------------------------------------------


def test_verification_finds_truncated_corrupt_and_missing_files(tmp_path):
    root = _folders(tmp_path, 2, 4, 6)
    four, six = root / "step_00000004", root / "step_00000006"
    manifest = json.loads((six / "checkpoint.json").read_text())["files"]
    data = (six / "weights.pt").read_bytes()
    assert manifest["weights.pt"] == {"size": len(data), "crc32": zlib.crc32(data)}
    assert cf.verify_checkpoint(six) == []
    corrupt = bytearray(data)
    corrupt[7] ^= 1
    (six / "weights.pt").write_bytes(bytes(corrupt))
    assert cf.verify_checkpoint(six) == [
        f"{six / 'weights.pt'} does not match its checksum (corrupt)"
    ]
    assert cf.verify_checkpoint(six, checksum_patterns=["*.yaml"]) == []  # sizes only
    (six / "weights.pt").write_bytes(data[:10])
    assert "is 10 bytes, written as" in cf.verify_checkpoint(six, checksum_patterns=[])[0]
    (four / "weights.pt").unlink()
    assert cf.verify_checkpoint(four) == [f"{four / 'weights.pt'} is missing"]
    # the refusal offers the newest earlier checkpoint that is whole (4 is not: 2)
    error = cf.damaged_checkpoint_error(root, "step_00000006", cf.verify_checkpoint(six))
    assert "the previous checkpoint step_00000002 is whole" in str(error)
    (root / "step_00000002" / "checkpoint.json").write_text("{not json")
    with pytest.raises(InputError, match=r"checkpoint\.json is unreadable"):
        cf.verify_checkpoint(root / "step_00000002")


def test_a_checkpoint_from_before_manifests_passes(tmp_path):
    (tmp_path / "step_00000001").mkdir()
    (tmp_path / "step_00000001" / "x.pt").write_bytes(b"abc")
    assert cf.verify_checkpoint(tmp_path / "step_00000001") == []


# -- pruning ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "keep_last, kept", [(1, [5, 7, 9]), (2, [3, 5, 7, 9]), (9, [1, 3, 5, 7, 9])]
)
def test_pruning_never_removes_the_new_checkpoint_or_a_newer_one(tmp_path, keep_last, kept):
    """After a rollback to 3 and a save at 5, the folders 7 and 9 of the abandoned branch
    stay; older ones go beyond ``keep_last`` (5 counts)."""
    root = _folders(tmp_path, 1, 3, 5, 7, 9)
    cf.prune(root, "step_00000005", keep_last)
    assert [cf.step_of(t) for t in cf.step_folders(root)] == kept
    assert not list(root.glob(".deleting-*"))


def test_a_deletion_leaves_no_half_deleted_step_folder(tmp_path, monkeypatch):
    """A prune renames the folder first: a crash inside the deletion leaves a leftover that
    is not a checkpoint (cleared by the next start), never a ``step_N`` missing files."""
    root = _folders(tmp_path, 1, 3)

    def crash(path, *args, **kwargs):
        raise KeyboardInterrupt  # stands for a kill in the middle of the deletion

    monkeypatch.setattr(cf.shutil, "rmtree", crash)
    with pytest.raises(KeyboardInterrupt):
        cf.prune(root, "step_00000003", 1)
    assert cf.step_folders(root) == ["step_00000003"]
    assert (root / ".deleting-step_00000001" / "weights.pt").is_file()
    monkeypatch.undo()
    (root / ".latest.tmp-host-1").write_text("step_00000003")
    (root / "notes.txt").write_text("the user's")  # not a name a save or prune writes
    (root / ".tmp-notes").mkdir()
    assert sorted(cf.remove_leftovers(root)) == [".deleting-step_00000001", ".latest.tmp-host-1"]
    assert sorted(p.name for p in root.iterdir()) == [".tmp-notes", "notes.txt", "step_00000003"]
    # a later prune over an earlier crash's leftover of the same folder
    _folders(root, 5)
    (root / ".deleting-step_00000003").mkdir()
    (root / ".deleting-step_00000003" / "half.pt").write_bytes(b"x")
    assert cf.prune(root, "step_00000005", 1) == ["step_00000003"]
    assert sorted(p.name for p in root.iterdir()) == [".tmp-notes", "notes.txt", "step_00000005"]


# -- durable writes -----------------------------------------------------------------------------


def _syscall_log(monkeypatch):
    """Record ``fsync`` (by path), ``rename`` and ``replace`` in the order they happen."""
    log = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def logged_fsync(fd):
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def logged(kind, call):
        def move(src, dst, *args, **kwargs):
            log.append((kind, str(src), str(dst)))
            return call(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(os, "fsync", logged_fsync)
    monkeypatch.setattr(os, "rename", logged("rename", rename))
    monkeypatch.setattr(os, "replace", logged("replace", replace))
    return log


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_write_atomic_fsyncs_the_file_before_the_rename_and_the_directory_after(
    tmp_path, monkeypatch
):
    log = _syscall_log(monkeypatch)
    write_atomic(tmp_path / "latest", "step_00000002")
    (kind_a, tmp_file), (kind_b, src, dst), (kind_c, directory) = log
    assert (kind_a, kind_b, kind_c) == ("fsync", "replace", "fsync")
    assert tmp_file == src and dst == str(tmp_path / "latest") and directory == str(tmp_path)
    assert (tmp_path / "latest").read_text() == "step_00000002"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "latest").stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name fds")
def test_a_checkpoint_commit_fsyncs_everything_before_each_rename(tmp_path, monkeypatch):
    """Rank 0's commit: every file and directory of the new checkpoint is fsynced before the
    folder's rename, the parent after it, and ``latest`` moves only then."""
    from focus_pretrain.checkpoint.save import Checkpointer
    from focus_pretrain.config import load_config

    root = tmp_path / "checkpoints"
    folder = root / ".tmp-step_00000004"
    (folder / "sub").mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(os.urandom(100))
    (folder / "sub" / "extra.bin").write_bytes(os.urandom(10))
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(os.urandom(30))
    saver = Checkpointer.__new__(Checkpointer)  # the commit needs no engine
    saver.root, saver.config, saver.keep_last, saver.tokenizer = (
        root,
        load_config(None),
        1,
        tokenizer,
    )
    log = _syscall_log(monkeypatch)
    saver._commit(
        4, {"mp_rank_00_model_states.pt": cf.file_record(folder / "mp_rank_00_model_states.pt")}
    )
    moves = [i for i, entry in enumerate(log) if entry[0] != "fsync"]
    folder_move = next(i for i in moves if log[i][2] == str(root / "step_00000004"))
    synced_before = {entry[1] for entry in log[:folder_move] if entry[0] == "fsync"}
    # rank 0's own files (the ranks fsync theirs as they write them), the folder, its subfolder
    assert {
        str(folder / name)
        for name in ("config.yaml", "tokenizer.model", "checkpoint.json", "sub/extra.bin")
    } | {str(folder), str(folder / "sub")} <= synced_before
    latest_move = next(i for i in moves if log[i][2] == str(root / "latest"))
    assert folder_move < latest_move
    assert ("fsync", str(root)) in log[folder_move:latest_move]
    assert cf.verify_checkpoint(root / "step_00000004") == []
    assert cf.tokenizer_copy(root / "step_00000004").read_bytes() == tokenizer.read_bytes()


# -- the run lock ---------------------------------------------------------------------------------


def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holder_blocks_nobody(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from focus_pretrain.storage.files import RunLock; "
            f"RunLock({str(tmp_path)!r}).acquire(); print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            RunInUseError, match=rf"in use by another run \(training: pid {holder.pid} "
        ):
            RunLock(tmp_path).acquire()
        assert f"pid {holder.pid}" in is_locked(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert is_locked(tmp_path) is None  # the kernel dropped the dead holder's lock
    with RunLock(tmp_path) as lock:
        assert lock.held and json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert not lock.held


def test_a_refused_run_leaves_no_directory_it_made_and_keeps_anything_written(tmp_path):
    """``release(discard_if_unused=True)``: the folders acquire made, holding only the lock
    file, go; a folder that existed, or one with anything else in it, stays."""
    made = tmp_path / "a" / "b" / "run"
    lock = RunLock(made).acquire()
    lock.release(discard_if_unused=True)
    assert not (tmp_path / "a").exists()  # every folder it made, and nothing above
    assert tmp_path.is_dir()
    written = tmp_path / "c" / "run"
    lock = RunLock(written).acquire()
    (written / "metrics.jsonl").write_text("{}\n")
    lock.release(discard_if_unused=True)
    assert sorted(p.name for p in written.iterdir()) == [".lock", "metrics.jsonl"]
    existing = tmp_path / "mine"
    existing.mkdir()
    lock = RunLock(existing).acquire()
    lock.release(discard_if_unused=True)
    assert existing.is_dir() and (existing / ".lock").is_file()  # not made by the lock
    lock = RunLock(tmp_path / "d").acquire()
    lock.release()  # a finished run's lock file stays
    assert (tmp_path / "d" / ".lock").is_file()


def test_a_discard_never_removes_a_folder_someone_else_made_or_a_link(tmp_path, monkeypatch):
    """Only the folders the lock's own ``mkdir`` made are removed: one another process makes
    between the check and the ``mkdir`` stays (empty or not); a dangling link where the run
    directory should be is refused, kept, and nothing is made behind it."""
    import pathlib

    real_mkdir = pathlib.Path.mkdir

    def user_makes_it_first(self, *args, **kwargs):
        if self == tmp_path / "theirs":
            real_mkdir(self)  # the user's folder, made just before ours
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", user_makes_it_first)
    lock = RunLock(tmp_path / "theirs" / "run").acquire()
    monkeypatch.setattr(pathlib.Path, "mkdir", real_mkdir)
    lock.release(discard_if_unused=True)
    assert (tmp_path / "theirs").is_dir()  # theirs: kept although empty
    assert not (tmp_path / "theirs" / "run").exists()  # ours: removed
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    with pytest.raises(InputError, match="cannot be a run directory"):
        RunLock(tmp_path / "link").acquire()
    assert (tmp_path / "link").is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_lock_won_on_an_unlinked_lock_file_is_taken_again_on_the_new_one(tmp_path, monkeypatch):
    """Removing the lock file (a refused run discarding its directory) never lets two runs
    hold the directory: a lock won on a file its holder unlinked meanwhile (opened before,
    locked after the holder's release) is dropped and taken on the file now at the path."""
    import fcntl

    from focus_pretrain.storage import files

    real_flock, calls = fcntl.flock, []

    def flock_after_the_holder_left(fd, op):
        calls.append(op)
        if len(calls) == 1:  # the holder discards the directory between our open and flock
            (tmp_path / "run" / ".lock").unlink()
            (tmp_path / "run").rmdir()
        return real_flock(fd, op)

    RunLock(tmp_path / "run").acquire().release()
    monkeypatch.setattr(files.fcntl, "flock", flock_after_the_holder_left)
    lock = RunLock(tmp_path / "run").acquire()
    monkeypatch.setattr(files.fcntl, "flock", real_flock)
    assert len(calls) == 2  # retried once, on the new file
    assert os.stat(lock.path).st_ino == os.fstat(lock._fd).st_ino
    with pytest.raises(RunInUseError):
        RunLock(tmp_path / "run").acquire()  # the lock at the path is held
    lock.release()


def test_a_directory_discarded_between_the_checks_and_the_open_is_no_traceback(
    tmp_path, monkeypatch
):
    """A refused run may remove its directory while another run, or an output check, is
    between finding it and opening its lock file: the lock is taken on a new file, and the
    check reports the directory free."""
    from focus_pretrain.storage import files

    real_open, opened = os.open, []

    def open_after_a_discard(path, flags, *mode):
        opened.append(path)
        if len(opened) == 1:  # the other run removed the directory just before
            (tmp_path / "run" / ".lock").unlink(missing_ok=True)
            (tmp_path / "run").rmdir()
        return real_open(path, flags, *mode)

    RunLock(tmp_path / "run").acquire().release()
    monkeypatch.setattr(files.os, "open", open_after_a_discard)
    lock = RunLock(tmp_path / "run").acquire()
    assert lock.held and len(opened) == 2
    lock.release()
    opened.clear()
    assert is_locked(tmp_path / "run") is None  # its file gone between is_file and open
    monkeypatch.setattr(files.os, "open", real_open)


# -- output directories -------------------------------------------------------------------------


def _owned(out):
    return set(json.loads((out / "mark.json").read_text())["files"])


def test_an_output_is_replaced_only_when_ours_and_never_over_an_input(tmp_path):
    check = lambda out, force=True, inputs=(): check_output_dir(  # noqa: E731
        out, force=force, marker="mark.json", what="export", owned=_owned, inputs=inputs
    )
    check(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    check(tmp_path / "empty", force=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file: choose a directory path"):
        check(tmp_path / "file")
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="exists and is not empty: choose a new directory, or"):
        check(user, force=False)
    with pytest.raises(InputError, match=r"replaces only an earlier export \(a directory with"):
        check(user)
    (user / "mark.json").write_text(json.dumps({"files": ["model.bin", "mark.json"]}))
    with pytest.raises(InputError, match=r"holds files the earlier export did not write \(notes"):
        check(user)
    (user / "notes.txt").unlink()
    (user / "model.bin").write_text("old")
    check(user)  # ours, holding only what it wrote
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    for out, relation in [(ckpt, "is"), (tmp_path / "run", "holds"), (ckpt / "x", "lies inside")]:
        with pytest.raises(InputError, match=f"export directory {out} {relation} the checkpoint"):
            check(out, inputs=[("the checkpoint", ckpt)])
    run_input = [("the run directory", tmp_path / "run", "may_hold_output")]
    check(tmp_path / "run" / "export", inputs=run_input)  # inside the run: allowed
    with pytest.raises(InputError, match="is the run directory"):
        check(tmp_path / "run", inputs=run_input)
    (user / "mark.json").write_text(json.dumps({"files": ["model.bin", "run"]}))
    with RunLock(user / "run"), pytest.raises(RunInUseError, match="run is in use"):
        check(user)  # a run training inside it


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_new_output_is_swapped_in_whole_and_a_failed_one_leaves_the_old(
    tmp_path, monkeypatch, exchange
):
    from focus_pretrain.storage import files

    if not exchange:
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), partial_dir(target) as work:
        (work / "half.txt").write_text("half")
        raise RuntimeError("failed while writing")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (target / "old.txt").read_text() == "old"
    with partial_dir(target) as work:
        (work / "new.txt").write_text("new")
        replace_dir(work, target)
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_leftovers_of_a_killed_export_are_removed_only_when_their_process_is_dead(tmp_path):
    import socket

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    prefix = f".out.partial-{socket.gethostname()}-"
    stale, live = tmp_path / f"{prefix}{dead.stdout.strip()}", tmp_path / f"{prefix}1"
    stale.mkdir()
    live.mkdir()  # pid 1 is alive: maybe another export writing right now
    with partial_dir(tmp_path / "out"):
        pass
    assert not stale.exists() and live.exists()


def test_retrofit_force_replaces_only_what_a_retrofit_wrote(tmp_path):
    """``focus-pretrain retrofit --force`` onto an earlier retrofit's output: the checks pass
    and only the entries a retrofit writes are replaced (the marker, the recipe)."""
    import argparse

    from focus_pretrain.commands import retrofit as tool

    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "out"
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "report.md").write_text("old report")
    (out / tool.MARKER).write_text("{}")
    args = argparse.Namespace(
        hf_dir=str(model),
        data=["demo:10"],
        out=out,
        force=True,
        resume=False,
        base=tool.__file__,
    )
    tool.check_inputs(args)
    recipe = tool.claim_output(args, "defaults: x\n")
    assert sorted(p.name for p in out.iterdir()) == [tool.MARKER, "recipe.yaml"]
    assert recipe.read_text() == "defaults: x\n"
    (out / "mine.txt").write_text("the user's")  # now something a retrofit does not write
    with pytest.raises(InputError, match=r"holds files the earlier retrofit output did not"):
        tool.check_inputs(args)
    assert (out / "mine.txt").read_text() == "the user's"


def test_an_export_replaces_an_earlier_export_of_either_kind_and_nothing_else(tmp_path):
    """``--force``: a full export may replace an adapter-only one and the other way round
    (both are this command's output); the files it did not write still stop it."""
    from focus_pretrain.convert.export_files import ADAPTER_MARKER, EXPORT_MARKER, check_export_dir

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "focus_adapter.safetensors").write_bytes(b"x")
    (adapter / ADAPTER_MARKER).write_text(
        json.dumps({"files": ["focus_adapter.safetensors", ADAPTER_MARKER]})
    )
    full = tmp_path / "full"
    full.mkdir()
    (full / "model.safetensors").write_bytes(b"x")
    (full / EXPORT_MARKER).write_text(json.dumps({"files": ["model.safetensors", EXPORT_MARKER]}))
    for marker in (EXPORT_MARKER, ADAPTER_MARKER):  # the full export's, the adapter's
        check_export_dir(adapter, True, marker=marker)
        check_export_dir(full, True, marker=marker)
    (adapter / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match=r"did not write \(notes\.txt\)"):
        check_export_dir(adapter, True, marker=EXPORT_MARKER)
    old = tmp_path / "old-adapter"  # an adapter of before the files list, by its base model
    old.mkdir()
    for name in ("focus_adapter.safetensors", "model.safetensors", "config.json"):
        (old / name).write_bytes(b"x")
    (old / ADAPTER_MARKER).write_text(json.dumps({"focus": {}}))
    with pytest.raises(InputError, match=r"did not write \(config\.json, model\.safetensors\)"):
        check_export_dir(old, True, marker=EXPORT_MARKER)  # the base model's files: not ours
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    refusal = "a directory with focus_export.json or focus_adapter.json"
    with pytest.raises(InputError, match=refusal):
        check_export_dir(user, True)
