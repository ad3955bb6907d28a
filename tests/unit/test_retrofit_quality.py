"""The retrofit's quality verdict: the hard model's loss gap to the original, and the line that
says when it is past the user's threshold (with what to change)."""

from __future__ import annotations

import pytest

from focus_pretrain.eval.retrofit_report import gap_line, hard_gap


def _evaluations(original: float, hard: float, beyond: float | None = 2.5) -> dict:
    return {
        "original (dense)": {"loss": original, "loss_beyond_window": 2.0, "kept_pairs": None},
        "retrofit, soft": {"loss": original + 0.01},
        "retrofit, hard": {"loss": hard, "loss_beyond_window": beyond, "kept_pairs": 0.2},
    }


def test_a_gap_above_the_threshold_is_called_out_with_the_levers():
    quality = hard_gap(_evaluations(2.135, 2.762), threshold=0.05)
    assert quality["gap"]["loss"] == pytest.approx(0.627)
    assert quality["gap"]["loss_beyond_window"] == pytest.approx(0.5)
    assert quality["gap"]["loss_far_evidence"] is None  # not measured: no far-evidence tokens
    assert quality["too_large"]
    line = gap_line(quality)
    assert line.startswith("the retrofit is not good enough: hard-mode loss vs the original: ")
    assert "validation +0.627, beyond the window +0.500 nats" in line
    assert "above --max-hard-gap 0.05" in line
    levers = ("--sinks 4", "--steps", "train.objective=distill", "model.focus.top_k=2", "--window",
              "model.focus.key_groups=own_and_previous")  # fmt: skip
    for lever in (*levers, "--groups"):
        assert lever in line


@pytest.mark.parametrize("hard, threshold", [(2.17, 0.05), (2.10, 0.0), (2.5, 0.5)])
def test_a_gap_within_the_threshold_says_so(hard, threshold):
    quality = hard_gap(_evaluations(2.135, hard, beyond=None), threshold=threshold)
    assert not quality["too_large"]
    line = gap_line(quality)
    assert line.endswith(f"(within --max-hard-gap {threshold:g})")
    assert "not good enough" not in line and "beyond the window" not in line


def _with_far(original: float, hard: float, far_original: float, far_hard: float) -> dict:
    evaluations = _evaluations(original, hard)
    evaluations["original (dense)"]["loss_far_evidence"] = far_original
    evaluations["retrofit, hard"]["loss_far_evidence"] = far_hard
    return evaluations


def test_a_far_evidence_gap_past_its_own_threshold_is_called_out():
    """E7's Python-docs row: +0.040 on all tokens (within 0.05) but +0.292 on far-evidence
    tokens: not good enough, naming --max-far-gap (and only it)."""
    quality = hard_gap(_with_far(2.454, 2.494, 2.106, 2.398), 0.05, far_threshold=0.1)
    assert quality["too_large"] and quality["past"] == ["--max-far-gap 0.1 (far evidence)"]
    line = gap_line(quality)
    assert "far evidence +0.292" in line and "above --max-far-gap 0.1 (far evidence);" in line
    assert "--max-hard-gap" not in line and "--sinks 4" in line
    both = hard_gap(_with_far(2.0, 2.2, 2.0, 2.5), 0.05, far_threshold=0.1)
    assert "above --max-hard-gap 0.05 and --max-far-gap 0.1 (far evidence)" in gap_line(both)


@pytest.mark.parametrize("far_hard, far_threshold", [(2.19, 0.1), (2.9, None), (2.4, 0.5)])
def test_a_far_evidence_gap_within_its_threshold_or_unchecked_passes(far_hard, far_threshold):
    quality = hard_gap(_with_far(2.0, 2.01, 2.1, far_hard), 0.05, far_threshold=far_threshold)
    assert not quality["too_large"] and quality["past"] == []
    line = gap_line(quality)
    limits = "--max-hard-gap 0.05" + (f", --max-far-gap {far_threshold:g}" if far_threshold else "")
    assert line.endswith(f"(within {limits})"), line


def test_the_levers_name_only_what_the_run_does_not_already_do():
    """A run at the method's settings gets every lever; one with the keys' rule, top-2 of 8,
    4 sinks and distillation is not told to do those again, and is told the next values."""
    from focus_pretrain.eval.retrofit_report import gap_levers
    from focus_pretrain.focus.config import FocusConfig

    plain = gap_levers(FocusConfig(num_groups=4, window=128, top_k=1, sinks=0), "lm")
    wanted = ("key_groups=own_and_previous", "model.focus.top_k=2", "--sinks 4", "--window 256",
              "train.objective=distill", "(--groups 8 --set model.focus.top_k=2)")  # fmt: skip
    for lever in wanted:
        assert lever in plain, lever
    tuned = FocusConfig(num_groups=8, window=64, top_k=2, sinks=4, key_groups="own_and_previous")
    levers = gap_levers(tuned, "distill")
    assert "model.focus.top_k=3" in levers and "--window 128" in levers
    for done in ("key_groups", "top_k=2", "--sinks", "objective=distill", "--groups"):
        assert done not in levers, done
    # top-K of K keeps every pair, and so does top-2 of 4 with the keys' rule: no top-k lever
    assert "top_k" not in gap_levers(FocusConfig(num_groups=3, top_k=2, sinks=4), "lm")
    rule_of_4 = FocusConfig(num_groups=4, top_k=1, sinks=4, key_groups="own_and_previous")
    assert "keep 2 groups" not in gap_levers(rule_of_4, "lm")
    assert "(--groups 8 --set model.focus.top_k=2)" in gap_levers(rule_of_4, "lm")
    quality = hard_gap(_evaluations(2.0, 2.5), threshold=0.05, levers=levers)
    assert gap_line(quality).endswith(f"to close it, {levers}")


def test_the_key_groups_flag_offers_every_rule_the_pattern_takes():
    """import-hf's and retrofit's --key-groups choices (spelled out in cli.py, which loads no
    torch) are the pattern's own rules."""
    from focus_pretrain.cli import KEY_GROUPS_CHOICES
    from focus_pretrain.convert.retrofit import RETROFIT_KEY_GROUPS
    from focus_pretrain.focus.pattern_settings import KEY_GROUPS

    assert KEY_GROUPS_CHOICES == KEY_GROUPS and RETROFIT_KEY_GROUPS in KEY_GROUPS


def test_the_needle_note_suggests_one_more_group_only_where_it_removes_pairs():
    """The report's retrieval note names the run's next top-k (top-3 after a top-2 run), and
    none where a key would then be in every group (top-2 of 4 with the keys' rule)."""
    from focus_pretrain.eval.retrofit_report import next_top_k, retrieval_note
    from focus_pretrain.focus.config import FocusConfig

    cases = [
        (FocusConfig(num_groups=8, top_k=1), 2),
        (FocusConfig(num_groups=8, top_k=2, key_groups="own_and_previous"), 3),
        (FocusConfig(num_groups=4, top_k=1, key_groups="own_and_previous"), None),
        (FocusConfig(num_groups=3, top_k=2), None),
    ]
    for focus, wider in cases:
        assert next_top_k(focus) == wider, focus
        note = retrieval_note("runs/r/export", 1024, focus)
        assert "`focus-pretrain ruler runs/r/export --tasks niah_single_1 --lengths 1024`" in note
        assert "`--focus enabled=false`" in note
        assert ("--focus top_k=" in note) == (wider is not None)
        if wider is not None:
            assert f"`--focus top_k={wider}`" in note
