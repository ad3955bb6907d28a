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
