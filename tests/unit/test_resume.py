"""Resume safety: the recipe a checkpoint was trained with against the one now given."""

from __future__ import annotations

import pytest

from focus_pretrain.config import load_config, save_config
from focus_pretrain.train.resume import check_resume, guarded, recipe_changes

RECIPE = "configs/tiny.yaml"


def _config(*sets: str):
    return load_config(RECIPE, list(sets))


def test_model_and_data_order_keys_are_guarded():
    saved = _config()
    changed = _config(
        "model.hidden_size=256",
        "model.focus.num_groups=8",
        'data.sources=["demo:100"]',
        "run.seed=7",
        "train.global_batch_size=32",
        "train.freeze=retrofit",
    )
    keys = [k for k, _, _ in recipe_changes(saved, changed)]
    assert keys == [
        "data.sources",
        "model.focus.num_groups",
        "model.hidden_size",
        "run.seed",
        "train.freeze",
        "train.global_batch_size",
    ]
    (change,) = recipe_changes(saved, _config("model.focus.num_groups=8"))
    assert change == ("model.focus.num_groups", 4, 8)


def test_what_a_resume_may_change():
    """Learning rate, schedule, more steps, cadences, backends, caches: not guarded."""
    free = _config(
        "train.lr=1e-2",
        "train.steps=2000",
        "train.log_interval=7",
        "train.save_interval=5",
        "model.focus.backend=reference",
        "model.focus.inference_backend=decomposed",
        "model.focus.check_finite=false",
        "model.recompute=selective",
        "data.cache_dir=/elsewhere",
        "data.workers=4",
        "run.output_dir=/other",
    )
    assert recipe_changes(_config(), free) == []
    assert guarded("model.rotary_base") and guarded("data.seq_length")
    assert not guarded("train.lr") and not guarded("parallel.zero_stage")


def test_check_resume_refuses_naming_keys_and_values(tmp_path):
    save_config(_config(), tmp_path / "config.yaml")
    with pytest.raises(ValueError) as err:
        check_resume(tmp_path, _config("model.focus.window=32", "run.seed=9"))
    message = str(err.value)
    assert "model.focus.window: 16 in the checkpoint, 32 now" in message
    assert "run.seed: 1234 in the checkpoint, 9 now" in message
    assert "train.allow_changes=true" in message
    allowed = check_resume(tmp_path, _config("model.focus.window=32", "train.allow_changes=true"))
    assert allowed == [("model.focus.window", 16, 32)]
    assert check_resume(tmp_path, _config("train.lr=1e-2")) == []


def test_nothing_to_compare_and_unreadable_recipes(tmp_path):
    assert check_resume(None, _config()) == []
    assert check_resume(tmp_path, _config()) == []  # a checkpoint without config.yaml
    (tmp_path / "config.yaml").write_text("model:\n  no_such_key: 1\n")
    with pytest.raises(ValueError, match="cannot compare the recipe"):
        check_resume(tmp_path, _config())
    (change,) = check_resume(tmp_path, _config("train.allow_changes=true"))
    assert change[0] == "<checkpoint recipe>"


@pytest.mark.parametrize(
    "text",
    [
        "# the user's notes\nfoo: 1\n",
        "run: {}\nmodel: {}\n",  # a partial recipe
        "defaults: tiny.yaml\nrun: {}\nmodel: {}\ndata: {}\ntrain: {}\n",  # a user's recipe
        "run: 1\nmodel: {}\ndata: {}\ntrain: {}\n",
        "not: [valid",
        "",
    ],
)
def test_a_config_yaml_this_program_did_not_write_is_refused_and_kept(tmp_path, text):
    """A run replaces ``run.output_dir/config.yaml`` with its resolved recipe: a file there
    that is not one (the user's) is refused, before anything is written, and kept."""
    from focus_pretrain.errors import InputError
    from focus_pretrain.train.resume import check_run_config

    path = tmp_path / "config.yaml"
    path.write_text(text)
    refusal = r"is not a recipe this program wrote \(a run writes .*\): move the file"
    with pytest.raises(InputError, match=refusal):
        check_run_config(path)
    assert path.read_text() == text
    (tmp_path / "dir.yaml").mkdir()
    with pytest.raises(InputError, match="is not a recipe this program wrote"):
        check_run_config(tmp_path / "dir.yaml")


def test_the_runs_own_config_yaml_is_accepted(tmp_path):
    """What a run wrote (the resolved recipe, every section) is taken over; so is an older
    run's with fewer sections, and no file at all."""
    from focus_pretrain.train.resume import check_run_config

    path = save_config(_config(), tmp_path / "config.yaml")
    check_run_config(path)
    path.write_text("run: {}\nmodel: {}\ndata: {}\ntrain: {}\n")
    check_run_config(path)
    check_run_config(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("resumed", "step", "steps", "expected"),
    [
        (None, 0, 10, None),  # a fresh run
        (3, 3, 10, None),  # a resume with steps to go
        (6, 6, 6, "at step 6, at train.steps=6: nothing to train"),
        (6, 6, 2, "at step 6, past train.steps=2: nothing to train"),
    ],
)
def test_a_resume_with_nothing_to_train_says_so(capsys, resumed, step, steps, expected):
    from types import SimpleNamespace

    from focus_pretrain.train.announce import _announce_nothing_to_train

    trainer = SimpleNamespace(
        resumed_step=resumed, step=step, config=SimpleNamespace(train=SimpleNamespace(steps=steps))
    )
    _announce_nothing_to_train(trainer)
    out = capsys.readouterr().out
    if expected is None:
        assert out == ""
    else:
        assert expected in out and f"set train.steps above {step}" in out
