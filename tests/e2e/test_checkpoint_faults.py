"""Fault injection: a run killed at each phase of a save, a damaged or dangling ``latest``, a
rollback, two runs on one directory. After each: which files exist, that no checkpoint a user
could resume from was lost, and that the next start either resumes the newest whole checkpoint
(to the same losses as an uninterrupted run) or refuses in one line, touching nothing.

The scenarios run in one worker process (``checkpoint_faults.py``); the output-directory cases
(``--force`` onto user files, onto the run, onto a file) run the commands in this process.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from focus_pretrain.errors import InputError
from tests.distributed import run_workers
from tests.e2e.checkpoint_faults import CKPT, DAMAGES, PHASES, observed

pytestmark = pytest.mark.e2e

S2, S3, S4, S6 = (CKPT.format(n) for n in (2, 3, 4, 6))


@pytest.fixture(scope="module")
def faults(tmp_path_factory, cache) -> dict:
    base = tmp_path_factory.mktemp("faults")
    return run_workers("tests.e2e.checkpoint_faults:run_all", 1, str(base), cache)[0]


# What is on disk right after the kill of step 4's save (saves every 2 steps, keep 1), and the
# checkpoint the restart resumes: never a lost or half-written checkpoint in charge.
AFTER_KILL = {
    "shards": ([".tmp-" + S4, S2], S2, 2),  # half-written: ignored, deleted on restart
    "folder:before": ([".tmp-" + S4, S2], S2, 2),  # complete but not renamed: same
    "folder:after": ([S2, S4], S2, 2),  # renamed, `latest` not moved: 2 is still in charge
    "latest:before": ([S2, S4], S2, 2),
    "latest:after": ([S2, S4], S4, 4),  # `latest` moved: 4 resumes, 2 is pruned later
    "prune:after": ([".deleting-" + S2, S4], S4, 4),  # never a half-deleted step_N folder
}


@pytest.mark.parametrize("phase", PHASES)
def test_a_kill_at_each_phase_of_a_save_leaves_a_whole_checkpoint(faults, phase):
    result = observed(faults, f"kill:{phase}")
    entries, latest, resumed = AFTER_KILL[phase]
    assert result["after_kill"]["entries"] == sorted([*entries, "latest"])
    assert result["after_kill"]["latest"] == latest
    assert result["resumed_at"] == resumed
    # the restart cleared what the kill left and ends as an uninterrupted run does
    assert result["after_restart"]["entries"] == sorted([S6, "latest"])
    assert result["after_restart"]["latest"] == S6
    assert result["losses"][6] == faults["reference"]["losses"][6]  # exact resume
    assert result["steps_logged"][-(6 - resumed) :] == list(range(resumed + 1, 7))


EXPECTED_REFUSAL = {
    "dangling": f"latest names {CKPT.format(9)}, which does not exist",
    "empty": "latest is empty",
    "no-latest": "holds checkpoints but no latest file",
    "not-a-tag": "names 'global_step4', which is not a checkpoint tag",
    "corrupt": "mp_rank_00_model_states.pt does not match its checksum (corrupt)",
    "truncated": "optim_states.pt is ",
    "missing-file": "mp_rank_00_model_states.pt is missing",
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_or_dangling_latest_is_refused_and_nothing_is_touched(faults, damage):
    result = observed(faults, f"damaged:{damage}")
    message = result["message"]
    assert message is not None, "the run started over a damaged checkpoint directory"
    assert EXPECTED_REFUSAL[damage] in message and "\n" not in message
    assert result["after"] == result["before"]  # not a byte changed, nothing deleted
    if damage in ("corrupt", "truncated", "missing-file"):  # the previous whole one, offered
        assert f"the previous checkpoint {S2} is whole" in message
        assert f"echo {S2} > " in message
    else:  # the folders present are named, with the fix
        assert f"checkpoints present: {S2}, {S4}" in message
        assert f"echo {S4} > " in message
    # following the offered fix resumes from step 2, to an uninterrupted run's loss
    assert result["resumed_after_fix"] == 2
    assert result["losses"][6] == faults["reference"]["losses"][6]


def test_pruning_after_a_rollback_keeps_the_new_and_every_newer_checkpoint(faults):
    result = observed(faults, "rollback")
    assert result["starts"][-2:] == [2, 3]
    assert result["after_3"]["latest"] == S3
    assert result["after_3"]["entries"] == sorted([S3, S4, S6, "latest"])  # 2 pruned only
    assert result["after_4"]["latest"] == S4
    assert result["after_4"]["entries"] == sorted([S4, S6, "latest"])
    assert result["step4_replaced"]  # the rolled-back branch's step 4 was written anew
    assert result["first"]["step"] == 3 and result["second"]["step"] == 4


def test_a_second_run_on_a_directory_in_use_is_refused_and_deletes_nothing(faults):
    result = observed(faults, "two-runs")
    assert "is in use by another run (training: pid " in result["message"]
    assert result["after"] == result["before"] and result["live_save_kept"]
    assert result["after_release"]["latest"] == S4


# -- --force and output directories -----------------------------------------------------------


def _run_cli(argv, capfd) -> tuple[int, str]:
    from focus_pretrain.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capfd.readouterr().err.strip()


def _tree(path: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_export_force_never_deletes_what_it_did_not_write(faults, tmp_path, capfd):
    from focus_pretrain.convert import export_hf

    run = pathlib.Path(faults["reference"]["run"])
    before = _tree(run / "checkpoints")
    # onto the run itself, its checkpoints, a file, a directory of user files: refused
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("my notes")
    (tmp_path / "file").write_text("a file")
    cases = {
        str(run): "holds the checkpoint",
        str(run / "checkpoints"): "checkpoints holds the checkpoint",
        str(run / "checkpoints" / "x"): "lies inside the checkpoints directory",
        str(tmp_path / "file"): "is a file",
        str(user): "replaces only an earlier export (a directory with focus_export.json or "
        "focus_adapter.json)",
    }
    for target, message in cases.items():
        code, err = _run_cli(["export", str(run), target, "--force"], capfd)
        assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert _tree(run / "checkpoints") == before
    assert (user / "notes.txt").read_text() == "my notes"
    assert (tmp_path / "file").read_text() == "a file"
    # an earlier export is replaced whole; a file the user added to it stops --force
    out = export_hf(run, tmp_path / "hf")
    record = json.loads((out / "focus_export.json").read_text())
    assert set(record["files"]) == {p.name for p in out.iterdir()}
    assert set(record["remote_code_sha256"]) >= {"modeling_focus.py", "configuration_focus.py"}
    (out / "README.md").write_text("my model card")
    with pytest.raises(InputError, match=r"holds files the earlier export did not write \(README"):
        export_hf(run, out, overwrite=True)
    (out / "README.md").unlink()
    first = _tree(out)
    export_hf(run, out, overwrite=True)
    assert _tree(out).keys() == first.keys()


def test_a_failed_export_leaves_the_earlier_one_whole(faults, tmp_path, monkeypatch):
    from focus_pretrain.convert import export_hf, hf_export

    run = pathlib.Path(faults["reference"]["run"])
    out = export_hf(run, tmp_path / "hf")
    before = _tree(out)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hf_export, "_save_tokenizer", fail)
    with pytest.raises(OSError, match="disk full"):
        export_hf(run, out, overwrite=True)
    assert _tree(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no partial left beside it
