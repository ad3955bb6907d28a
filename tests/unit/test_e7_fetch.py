"""E7's fetch scripts (tools/experiments/e7/) never replace what is already there: an existing
output stops them before any download, and the GGUF converter checks its input, then refuses
an existing output directory, before loading anything."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

E7 = Path(__file__).parents[2] / "tools" / "experiments" / "e7"


def _tool(name: str, file: str):
    """The E7 tool ``file`` imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, E7 / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(args: list, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {"PATH": str(tmp_path / "no-tools"), "PY": sys.executable}  # no apt-get, pip, unzip
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    "script, existing",
    [("fetch_corpora.sh", "corpora/jargon"), ("fetch_models.sh", "hf")],
)
def test_an_existing_output_stops_the_fetch_before_anything_is_fetched(tmp_path, script, existing):
    users = tmp_path / existing
    users.mkdir(parents=True)
    (users / "notes.txt").write_text("the user's")
    done = _run(["/bin/bash", str(E7 / script), str(tmp_path)], tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"{users} exists: move it away or give another DEST" in done.stderr
    assert (users / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [existing.split("/")[0]]


def test_the_converter_checks_its_input_then_refuses_an_existing_output(tmp_path):
    tool = [sys.executable, str(E7 / "gguf_to_hf.py")]
    out = tmp_path / "hf"
    missing = _run([*tool, tmp_path / "none.gguf", out], tmp_path)
    assert missing.returncode == 2 and "none.gguf does not exist" in missing.stderr
    assert not out.exists()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    refused = _run([*tool, gguf, out], tmp_path)
    assert refused.returncode == 2 and f"{out} exists: give a new directory" in refused.stderr
    assert (out / "notes.txt").read_text() == "the user's"


def test_the_summary_gives_each_variant_its_gap_to_the_original(tmp_path):
    """summarize.py: every variant of a run (the report's and evaluate_variants.py's) against
    the run's own original, per metric."""
    summarize = _tool("e7_summarize", "summarize.py")

    def metrics(loss, kept=None):
        found = {"loss": loss, "loss_beyond_window": loss + 0.5, "loss_far_evidence": loss - 1}
        return found if kept is None else {**found, "kept_pairs": kept}

    run = tmp_path / "smollm2-lm-soft"
    run.mkdir()
    report = {"original (dense)": metrics(3.0), "retrofit, hard": metrics(3.6, 0.7)}
    (run / "report.json").write_text(json.dumps({"evaluations": report}))
    variants = {
        "hard, sinks 4": metrics(3.03, 0.71),
        "original (dense), window 256": metrics(2.9),  # the positions beyond 256: another set
        "hard, sinks 4, window 256": metrics(2.95, 0.8),
    }
    (run / "variants.json").write_text(json.dumps(variants))
    rows = {r["variant"]: r for r in summarize.rows(tmp_path)}
    assert set(rows) == {"retrofit, hard", "hard, sinks 4", "hard, sinks 4, window 256"}
    wide = rows.pop("hard, sinks 4, window 256")  # against the dense model at window 256
    assert wide["original"] == 2.9 and wide["gap loss"] == pytest.approx(0.05)
    assert rows["retrofit, hard"]["gap loss"] == pytest.approx(0.6)
    assert rows["hard, sinks 4"]["gap loss_far_evidence"] == pytest.approx(0.03)
    assert rows["hard, sinks 4"]["kept_pairs"] == 0.71 and rows["hard, sinks 4"]["run"] == run.name
    for seed, loss in [(2, 3.05), (3, 3.07)]:  # the same row, other seeds: mean and spread
        again = tmp_path / f"{run.name}-seed{seed}"
        again.mkdir()
        evaluations = {"original (dense)": metrics(3.0), "retrofit, hard": metrics(loss, 0.7)}
        (again / "report.json").write_text(json.dumps({"evaluations": evaluations}))
    unreported = tmp_path / f"{run.name}-seed4"  # evaluated, but its report step failed
    (unreported / "eval").mkdir(parents=True)
    for stem, loss in [("original", 3.0), ("soft", 3.01), ("hard", 3.08)]:
        (unreported / "eval" / f"{stem}.json").write_text(json.dumps({"metrics": metrics(loss)}))
    (tmp_path / "cache").mkdir()  # neither: not a run
    table = summarize.rows(tmp_path)
    assert {r["run"] for r in table} == {run.name, *(f"{run.name}-seed{n}" for n in (2, 3, 4))}
    rows = {(r["run"], r["variant"]): r for r in table}
    assert rows[unreported.name, "retrofit, hard"]["gap loss"] == pytest.approx(0.08)
    (unreported / "eval" / "hard.json").unlink()
    (seeds,) = summarize.over_seeds(summarize.rows(tmp_path))  # "hard, sinks 4": one seed only
    assert seeds["run"] == run.name and seeds["variant"] == "retrofit, hard"
    assert seeds["seeds"] == 3 and seeds["gap loss"] == pytest.approx(0.24)
    assert seeds["sd loss"] == pytest.approx(0.3119, abs=1e-4)  # sample sd of .6, .05, .07


def test_the_corpus_fetch_removes_only_its_own_staging_directory(tmp_path):
    """fetch_corpora.sh's EXIT trap deletes the mktemp directory it made (here after a failed
    download), nothing else: the destination and what sits beside the stage are untouched."""
    import shutil

    tools = tmp_path / "tools"
    tools.mkdir()
    for name in ("mktemp", "dirname", "rm", "basename", "cut", "mkdir"):
        (tools / name).symlink_to(shutil.which(name))
    apt = tools / "apt-get"  # downloads something into the stage, then fails
    apt.write_text("#!/bin/bash\necho partial > partial.deb\nexit 1\n")
    apt.chmod(0o755)
    scratch, dest = tmp_path / "tmp", tmp_path / "dest"
    scratch.mkdir()
    (scratch / "users.txt").write_text("the user's")
    (dest / "corpora" / "other").mkdir(parents=True)
    env = {"PATH": str(tools), "PY": sys.executable, "TMPDIR": str(scratch)}
    done = subprocess.run(["/bin/bash", str(E7 / "fetch_corpora.sh"), str(dest)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert sorted(p.name for p in scratch.iterdir()) == ["users.txt"]  # the stage is gone
    assert [p.name for p in (dest / "corpora").iterdir()] == ["other"]


def test_the_needle_table_names_how_each_result_inferred(tmp_path):
    """ruler_table.py: a row per ``focus-pretrain ruler --json`` result, named by how the export
    inferred (dense, the window alone, hard top-k with sinks and the keys' rule), each score at
    its task and length; other JSON files are left out."""
    table = _tool("e7_ruler_table", "ruler_table.py")
    focus = {"enabled": True, "window_only": False, "window": 128, "num_groups": 8,
             "top_k": 1, "inference_mode": "hard", "sinks": 4}  # fmt: skip
    results = {
        "a.dense": ({**focus, "enabled": False}, {"niah_single_1": {"1024": 0.95}}),
        "a.window": ({**focus, "window_only": True}, {"niah_single_1": {"1024": 0.1}}),
        "a.top2": ({**focus, "top_k": 2}, {"niah_single_1": {"1024": 0.35, "2048": 0.2}}),
        "b.top1": ({**focus, "key_groups": "own_and_previous"}, {"niah_single_1": {"1024": 0.4}}),
    }
    for name, (settings, scores) in results.items():
        samples = {t: dict.fromkeys(by, 20) for t, by in scores.items()}
        result = {"focus": settings, "scores": scores, "samples": samples, "records": []}
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    (tmp_path / "other.json").write_text(json.dumps({"loss": 1.0}))
    rows = table.rows(tmp_path)
    assert [r["run"] for r in rows] == ["a.dense", "a.top2", "a.window", "b.top1"]
    assert [r["settings"] for r in rows] == [
        "dense (the original)", "hard top-2 of 8, sinks 4", "window 128 only, sinks 4",
        "hard top-1 of 8, sinks 4, keys own and previous",
    ]  # fmt: skip
    lines = table.markdown(rows).splitlines()
    assert lines[0] == "| run | inferred with | niah_single_1 @ 1024 | niah_single_1 @ 2048 |"
    assert lines[2].endswith("| 0.95 (n=20) | - |")
    assert lines[3].endswith("| 0.35 (n=20) | 0.20 (n=20) |")


@pytest.mark.parametrize("top_k,window,sinks", [(1, 5, 0), (2, 3, 2), (1, 0, 4), (3, 7, 1)])
def test_the_needle_analysis_keeps_the_keys_the_hard_pattern_keeps(top_k, window, sinks):
    """needle_attention.py's keys of the last query against a loop over the spec: the window
    (``i - j <= window``), the first ``sinks`` tokens, or a shared group among each token's
    ``top_k`` most probable; a layer without a router keeps its window and sinks."""
    import torch

    needle = _tool("e7_needle", "needle_attention.py")
    torch.manual_seed(top_k * 100 + window)
    s, groups = 40, 6
    probs = torch.softmax(torch.randn(s, groups) * 2, dim=-1)  # [s, K]
    focus = {"window": window, "sinks": sinks}
    kept = needle.kept_keys(probs, top_k, focus, s)
    top = [set(probs[j].topk(top_k).indices.tolist()) for j in range(s)]
    last = s - 1
    for j in range(s):
        near = last - j <= window or j < sinks
        assert bool(kept[j]) == (near or bool(top[j] & top[last])), j
    far = torch.tensor([last - j > window and j >= sinks for j in range(s)])
    assert 0 < int(kept[far].sum()) < int(far.sum())  # far keys kept by a group, and cut
    alone = needle.kept_keys(None, top_k, focus, s)
    assert alone.tolist() == [last - j <= window or j < sinks for j in range(s)]


@pytest.mark.parametrize("top_k,window,sinks", [(1, 4, 0), (2, 3, 2)])
def test_copy_routing_kept_pairs_follow_the_spec(top_k, window, sinks):
    """copy_routing.py's kept pairs against a loop over the spec: causal, and the window
    (``q - k <= window``), the first ``sinks`` tokens, or a shared group among each token's
    ``top_k`` most probable."""
    import torch

    routing = _tool("e7_copy_routing", "copy_routing.py")
    torch.manual_seed(top_k * 10 + window)
    s, groups = 30, 5
    probs = torch.softmax(torch.randn(s, groups) * 2, dim=-1)  # [s, K]
    q, k = torch.meshgrid(torch.arange(s), torch.arange(s), indexing="ij")
    q, k = q.flatten(), k.flatten()  # every pair
    kept = routing.kept_pairs(probs, top_k, {"window": window, "sinks": sinks}, q, k)
    top = [set(probs[j].topk(top_k).indices.tolist()) for j in range(s)]
    for i, j, got in zip(q.tolist(), k.tolist(), kept.tolist(), strict=True):
        want = j <= i and (i - j <= window or j < sinks or bool(top[i] & top[j]))
        assert got == want, (i, j)
    far = (q - k > window) & (k >= sinks)
    assert 0 < int(kept[far].sum()) < int(far.sum())


@pytest.mark.parametrize("key_groups", ["predecessor", "both"])
def test_the_needle_analysis_what_if_key_groups(key_groups):
    """needle_attention.py's what-if: a key in its predecessor's groups (or its own and its
    predecessor's), the query in its own, against a loop."""
    import torch

    needle = _tool("e7_needle_kg", "needle_attention.py")
    torch.manual_seed(7)
    s, groups, window, sinks = 40, 6, 3, 1
    probs = torch.softmax(torch.randn(s, groups) * 2, dim=-1)  # [s, K]
    kept = needle.kept_keys(probs, 1, {"window": window, "sinks": sinks}, s, key_groups)
    group = probs.argmax(dim=-1).tolist()
    last = s - 1
    for j in range(s):
        previous = group[max(j - 1, 0)]
        shares = previous == group[last] if key_groups == "predecessor" else (
            previous == group[last] or group[j] == group[last])  # fmt: skip
        assert bool(kept[j]) == (last - j <= window or j < sinks or shares), j
    own = needle.kept_keys(probs, 1, {"window": window, "sinks": sinks}, s)
    assert not torch.equal(kept, own)
    from focus_pretrain.focus.pattern_settings import KEY_GROUPS

    assert set(needle.EXPORT_KEY_GROUPS) == set(KEY_GROUPS)  # every export's rule has its what-if
