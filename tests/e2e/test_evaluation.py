"""Long-context evaluation end to end: validation writes the probe and loss-by-distance
scores; ``tools/evaluate.py`` reproduces them from the checkpoint, in one process and under
context parallelism, measures the kept-pair fraction per top-k, and refuses bad input; the
experiment runner's table holds what each run's ``metrics.jsonl`` says."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

from focus_pretrain.experiments import ExperimentSpec, run_experiment
from focus_pretrain.experiments.runner import mean_std
from focus_pretrain.train import read_metrics
from tests.e2e import runs

pytestmark = pytest.mark.e2e
ROOT = pathlib.Path(__file__).parents[2]
EVALUATE = str(ROOT / "tools" / "evaluate.py")
PROBES = ["probes.lengths=[128]", "probes.kinds=[passkey]", "probes.count=2", "train.recall_docs=0"]
PROBE_KEYS = ("passkey_acc", "passkey_loss", "passkey_L128_d50_loss", "passkey_far_acc")


def _evaluate(run: pathlib.Path, out: pathlib.Path, *sets: str, torchrun: bool = False):
    command = [sys.executable, EVALUATE]
    if torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc-per-node", "2", EVALUATE]
    command += ["--checkpoint", str(run), "--out", str(out)]
    for item in sets:
        command += ["--set", item]
    return runs.run(command)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("eval-run")
    sets = runs.overrides(out, str(out / "cache"), "train.steps=3", "train.eval_interval=3")
    result = runs.launch([*sets, "train.eval_iters=2", *PROBES])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_validation_records_probe_and_distance_scores(trained):
    (valid,) = [r for r in read_metrics(trained) if r.get("split") == "valid"]
    for key in (*PROBE_KEYS, "loss_beyond_window", "loss_far_evidence", "far_evidence_share"):
        assert key in valid, key
    assert 0 <= valid["passkey_acc"] <= 1 and valid["passkey_loss"] > 0
    assert 0 < valid["far_evidence_share"] < valid["beyond_window_share"] <= 1
    assert math.isfinite(valid["loss_far_evidence"]) and math.isfinite(valid["loss"])


def test_evaluate_reproduces_validation_in_one_process_and_under_context_parallelism(
    trained, tmp_path
):
    (valid,) = [r for r in read_metrics(trained) if r.get("split") == "valid"]
    one = _evaluate(trained, tmp_path / "one.json", *PROBES)
    assert one.returncode == 0, one.stderr[-3000:]
    result = json.loads((tmp_path / "one.json").read_text())
    single = result["metrics"]
    by_position = result["loss_by_position"]  # window 16, 128 tokens: buckets doubling
    assert list(by_position) == ["0-16", "16-32", "32-64", "64-128"]
    assert min(by_position.values()) < single["loss"] < max(by_position.values())
    for key in (*PROBE_KEYS, "loss", "loss_beyond_window", "loss_far_evidence"):
        # the same model on the same probe sequences and the same validation batches
        assert single[key] == pytest.approx(valid[key], rel=1e-5, abs=1e-6), key
    cp = _evaluate(
        trained, tmp_path / "cp.json", *PROBES, "parallel.context_parallel_size=2", torchrun=True
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    sharded = json.loads((tmp_path / "cp.json").read_text())["metrics"]
    for key in (*PROBE_KEYS, "loss", "loss_far_evidence"):
        assert sharded[key] == pytest.approx(single[key], rel=1e-4, abs=1e-5), key
    assert "kept_pairs" in single and "kept_pairs" not in sharded  # routers see shards


def test_kept_pairs_grow_with_top_k_and_bad_input_is_refused(trained, tmp_path):
    kept = []
    for top_k in (1, 2):
        result = _evaluate(trained, tmp_path / f"k{top_k}.json", f"model.focus.top_k={top_k}")
        assert result.returncode == 0, result.stderr[-3000:]
        kept.append(json.loads((tmp_path / f"k{top_k}.json").read_text())["metrics"]["kept_pairs"])
    assert 0 < kept[0] < kept[1] <= 1, kept
    missing = _evaluate(tmp_path / "nothing", tmp_path / "x.json")
    assert missing.returncode != 0 and "neither a checkpoint" in missing.stderr
    too_long = _evaluate(trained, tmp_path / "x.json", "probes.lengths=[4096]")
    assert too_long.returncode != 0
    assert "beyond model.max_seq_length (128)" in too_long.stderr
    deeper = _evaluate(trained, tmp_path / "x.json", "model.num_layers=3")
    assert deeper.returncode == 2 and not (tmp_path / "x.json").exists()
    assert "--set model.num_layers=3 (the checkpoint's: 2) changes the model's weights" in (
        deeper.stderr
    )
    # the window alone (the floor of a Focus model): the routers' weights are left out
    floor = _evaluate(trained, tmp_path / "w.json", "model.focus.window_only=true")
    assert floor.returncode == 0, floor.stderr[-3000:]
    window_only = json.loads((tmp_path / "w.json").read_text())["metrics"]
    assert "kept_pairs" not in window_only or window_only["kept_pairs"] < kept[0]


def test_experiment_table_holds_each_runs_measurements(tmp_path):
    base = runs.overrides(tmp_path, str(tmp_path / "cache"), "train.steps=2")
    spec = ExperimentSpec(
        name="smoke",
        recipe=runs.RECIPE,
        seeds=[1, 2],
        overrides=[s for s in base if not s.startswith("run.")]
        + ["train.eval_interval=2", "train.eval_iters=1", "train.recall_docs=0"],
        variants={"focus": [], "dense": ["model.focus.enabled=false"]},
        report=["valid.loss", "train.loss", "wall_s"],
    )
    summary = run_experiment(spec, tmp_path / "exp", jobs=1)
    for variant in ("focus", "dense"):
        measured = []
        for seed in (1, 2):
            (valid,) = [
                r
                for r in read_metrics(tmp_path / "exp" / variant / f"seed{seed}")
                if r.get("split") == "valid"
            ]
            measured.append(valid["loss"])
        assert summary["values"][variant]["valid.loss"] == measured
        mean, std, n = mean_std(measured)
        assert n == 2 and f"{mean:.4g} ± {std:.4g}" in summary["table"]
    saved = json.loads((tmp_path / "exp" / "results.json").read_text())
    assert saved["values"] == summary["values"]
    assert (tmp_path / "exp" / "results.md").read_text().strip() == summary["table"]


def test_our_export_reimports_as_its_family_for_a_retrofit(trained, tmp_path):
    """E4 retrofits an exported dense model: the export (``model_type: focus_llama``) reads as
    a Llama checkpoint whose architecture is the run's, with the run's own tokenizer file."""
    from focus_pretrain.config import load_config
    from focus_pretrain.convert import check_tokenizer_matches, export_hf, hf_model_config
    from focus_pretrain.convert.hf_import import read_hf_config
    from focus_pretrain.data.datasets import tokenizer_path_for

    out = export_hf(trained, tmp_path / "hf")
    assert read_hf_config(out)["model_type"] == "llama"
    config = load_config(trained / "config.yaml", [])
    imported = hf_model_config(out, focus=config.model.focus)
    for field in ("family", "num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        assert getattr(imported, field) == getattr(config.model, field), field
    check_tokenizer_matches(out, tokenizer_path_for(config.data, config.run.seed))
