"""The RULER command's own logic (``focus_pretrain.eval.ruler``): which tasks run offline,
which lengths an export can take, and the per-task, per-length summary of lm-eval's scores.
The whole path on an export (lm-eval's generator and scoring) is
``tests/e2e/test_export.py::test_ruler_needles_through_lm_evals_generator_offline``."""

from __future__ import annotations

import json
import os

import pytest

from focus_pretrain.errors import InputError
from focus_pretrain.eval import ruler
from focus_pretrain.eval.ruler import _summary, check_lengths, markdown_table, split_tasks


def test_offline_the_tasks_that_download_are_skipped_with_what_they_download():
    runnable, skipped = split_tasks(["niah_single_1", "niah_single_2", "ruler_qa_squad"], False)
    assert runnable == ["niah_single_1"]
    assert (
        "Paul Graham essays" in skipped["niah_single_2"] and "--online" in skipped["niah_single_2"]
    )
    assert "SQuAD" in skipped["ruler_qa_squad"]
    runnable, skipped = split_tasks(["niah_single_2", "niah_multikey_2"], True)
    assert runnable == ["niah_single_2", "niah_multikey_2"] and skipped == {}


def test_an_unknown_task_is_refused_with_the_choices():
    with pytest.raises(InputError, match=r"unknown RULER task\(s\) niah_single_9; choose from"):
        split_tasks(["niah_single_1", "niah_single_9"], False)


NEEDLES = ["niah_single_1"]


@pytest.mark.parametrize("config, length, tasks, max_new, problem", [
    ({"n_positions": 1024}, 2048, NEEDLES, None, "learned positions: n_positions=1024"),
    ({"n_positions": 1024}, 1000, NEEDLES, None, "use lengths up to 960"),  # answer prefix
    ({"n_positions": 1024}, 900, ["ruler_vt"], 128, "98 more for --max-new-tokens"),  # vt: 30
    ({"max_position_embeddings": 4096}, 200, NEEDLES, None, "leaves no room for a RULER prompt"),
])  # fmt: skip
def test_lengths_an_export_cannot_take_are_refused(tmp_path, config, length, tasks, max_new,
                                                   problem):  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert check_lengths(tmp_path, [512], tasks, max_new) == []
    with pytest.raises(InputError, match=problem):
        check_lengths(tmp_path, [512, length], tasks, max_new)


def test_no_length_or_a_broken_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="no length to test"):
        check_lengths(tmp_path, [], NEEDLES, None)
    with pytest.raises(InputError, match=r"config\.json is not valid JSON"):
        check_lengths(tmp_path, [512], NEEDLES, None)
    with pytest.raises(InputError, match="samples is 0: give at least 1"):
        ruler.run_ruler(tmp_path, NEEDLES, [512], samples=0)
    with pytest.raises(InputError, match=r"missing does not exist: give a directory written by"):
        ruler.run_ruler(tmp_path / "missing", NEEDLES, [512])


def test_past_a_rotary_models_context_is_allowed_with_a_warning(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    assert check_lengths(tmp_path, [1024, 2048], NEEDLES, None) == []
    (warning,) = check_lengths(tmp_path, [1024, 4096], NEEDLES, None)
    assert "4096 is past the model's max_position_embeddings=2048" in warning


def test_offline_settings_are_restored(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with ruler._offline_hub():
        assert os.environ["HF_HUB_OFFLINE"] == os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "HF_DATASETS_OFFLINE" not in os.environ


def test_the_commands_copies_of_light_constants_agree():
    """Constants the tools copy so that their --help imports nothing heavy."""
    from focus_pretrain.bench.config import DTYPE_NAMES
    from focus_pretrain.bench.report import DTYPES
    from focus_pretrain.commands import ruler as tool

    assert tuple(tool.DEFAULT_TASKS) == ruler.DEFAULT_TASKS
    assert set(DTYPE_NAMES) == set(DTYPES)


def test_the_summary_averages_lm_evals_scores_per_task_and_length():
    records = [
        {"task": "a", "length": 512, "prompt_tokens": 300, "score": 1.0},
        {"task": "a", "length": 512, "prompt_tokens": 320, "score": 0.5},
        {"task": "a", "length": 1024, "prompt_tokens": 800, "score": 0.0},
        {"task": "b", "length": 512, "prompt_tokens": 310, "score": 0.25},
        {"task": "b", "length": 1024, "prompt_tokens": 790, "score": 0.75},
        {"task": "b", "length": 1024, "prompt_tokens": 805, "score": 1.0},
    ]
    summary = _summary(records, ["a", "b"])
    assert summary["scores"] == {"a": {"512": 0.75, "1024": 0.0}, "b": {"512": 0.25, "1024": 0.875}}
    assert summary["samples"] == {"a": {"512": 2, "1024": 1}, "b": {"512": 1, "1024": 2}}
    assert summary["prompt_tokens"]["a"]["512"] == [300, 320]
    assert summary["prompt_tokens"]["b"]["1024"] == [790, 805]
    table = markdown_table({"lengths": [512, 1024], **summary, "skipped": {"c": "downloads"}})
    assert "| b | 0.250 (n=1) | 0.875 (n=2) |" in table
    assert "| c | skipped: downloads |" in table
