"""Command-line tools run end to end (small sizes)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).parents[2]


def test_pattern_density_tool(tmp_path):
    out = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "pattern_density.py"),
            "--seq",
            "512",
            "4096",
            "--groups",
            "4",
            "--top-k",
            "1",
            "2",
            "--window",
            "16",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    assert "| 4096 | 4 | 1 | 16 |" in result.stdout
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    top1 = next(r for r in rows if r["seq"] == 4096 and r["top_k"] == 1)
    # uniform top-1 routing over K=4 keeps about 1/4 of the far pairs plus the window
    assert 0.24 < top1["density"] < 0.30
    top2 = next(r for r in rows if r["seq"] == 4096 and r["top_k"] == 2)
    assert top2["density"] > top1["density"]  # 2-of-4 sets intersect with probability 5/6


def test_import_hf_tool_prints_a_loadable_retrofit_recipe(tmp_path):
    """tools/import_hf.py: the printed sections load as a recipe with the checkpoint's shape
    (Gemma-3: every architecture field set, RoPE scaling a nested section) and its own
    tokenizer; a checkpoint without one is refused with the fix, before any recipe is
    printed (a new tokenizer would be trained otherwise)."""
    import shutil

    from focus_pretrain.config import load_config
    from focus_pretrain.convert import hf_model_config
    from focus_pretrain.convert.hf_import import ARCHITECTURE_FIELDS
    from focus_pretrain.data import demo_documents
    from tests.helpers import make_hf_tokenizer
    from tests.multiprocess.test_hf_import import make_hf_model

    _, path = make_hf_model("gemma3", tmp_path)
    tool = ROOT / "tools" / "import_hf.py"
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    refused = subprocess.run([sys.executable, str(tool), str(bare)], capture_output=True, text=True)
    assert refused.returncode == 2 and not refused.stdout
    assert f"{bare} ships no tokenizer and data.tokenizer is not set" in refused.stderr
    make_hf_tokenizer(path, demo_documents(40, seed=3), vocab_size=300)
    result = subprocess.run(
        [sys.executable, str(tool), str(path), "--groups", "8"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"# {path}: 42 tensors" in result.stderr  # 4 x 10 per layer + embedding, norm
    recipe = tmp_path / "retrofit.yaml"
    recipe.write_text(result.stdout)
    with pytest.raises(ValueError, match=r"data\.sources must list at least one corpus"):
        load_config(recipe)  # the base leaves the corpus to the user: no silent demo data
    config = load_config(recipe, ['data.sources=["demo:10"]'])  # on configs/retrofit.yaml
    assert (
        config.train.lr
        == load_config(
            ROOT / "configs" / "retrofit.yaml", ['data.sources=["x"]', "data.seq_length=64"]
        ).train.lr
    )
    assert config.data.seq_length == 64  # the checkpoint's maximum, not the base's 1024
    assert config.run.output_dir == f"runs/retrofit-{path.name}"
    assert config.train.init_from_hf == str(path) and config.train.freeze == "retrofit"
    assert config.data.tokenizer == str(path)  # its tokenizer.json
    assert config.model.focus.num_groups == 8
    assert config.model.focus.sinks == 4  # a retrofit's default: the model's attention sinks
    sinks = subprocess.run(
        [sys.executable, str(tool), str(path), "--sinks", "0"], capture_output=True, text=True
    )
    assert sinks.returncode == 0 and "sinks: 0" in sinks.stdout, sinks.stderr[-2000:]
    # a retrofit's keys count in their predecessor's groups too (E7), the method's by a flag
    assert config.model.focus.key_groups == "own_and_previous"
    method = subprocess.run(
        [sys.executable, str(tool), str(path), "--key-groups", "own"],
        capture_output=True,
        text=True,
    )
    assert method.returncode == 0 and "key_groups: own\n" in method.stdout, method.stderr[-2000:]
    expected = hf_model_config(path)
    for field in ARCHITECTURE_FIELDS:
        assert getattr(config.model, field) == getattr(expected, field), field
    assert config.model.rope_scaling is not None


def test_bench_attention_smoke_on_cpu(tmp_path):
    """The benchmark runs end to end on CPU at small sizes (a smoke check, not figures)."""
    out, table = tmp_path / "bench.json", tmp_path / "bench.md"
    args = ["--device", "cpu", "--seq", "256", "640", "--groups", "4", "--top-k", "1", "2"]
    args += ["--heads", "4", "--heads-kv", "2", "--head-dim", "16", "--dtype", "fp32"]
    args += ["--window", "32", "--warmup", "1", "--repeats", "2"]
    args += ["--json", str(out), "--markdown", str(table)]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_attention.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert report["environment"]["torch"]
    rows = report["rows"]
    assert [(r["seq"], r["top_k"]) for r in rows] == [(256, 1), (256, 2), (640, 1), (640, 2)]
    for row in rows:
        assert set(row["backends"]) == ({"decomposed", "flex"} if row["top_k"] == 1 else {"flex"})
        assert row["dense_ms"]["sdpa"] > 0 and row["ideal_speedup"] > 1
        for b in row["backends"].values():
            assert b["max_abs_error_vs_reference"] < 1e-4  # checked before timing
            assert b["ms"] > 0 and b["overhead_fraction"] > 0
            assert abs(b["speedup"] - row["dense_ms"]["sdpa"] / b["ms"]) < 1e-9
    assert "| 640 | 4 | 2 | hard |" in table.read_text()
    assert "| decomposed |" in result.stdout


def test_bench_attention_times_soft_and_sparse_training(tmp_path):
    """``--train``: one soft row, then one sparse (hard_gated) row per top-k, each backend that
    trains it here checked against the reference (output and gradients) and timed against
    dense SDPA forward + backward, next to the pair-count ideal; then the same rows with the
    ``dot`` gate form (its soft pattern through ``sdpa`` too)."""
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--seq", "600", "--groups", "4", "--top-k", "1", "2", "--train"]
    args += ["--no-hard", "--heads", "4", "--heads-kv", "2", "--head-dim", "16", "--dtype"]
    args += ["fp32", "--window", "32", "--warmup", "0", "--repeats", "1", "--json", str(out)]
    args += [
        "--backends",
        "reference",
        "segments",
        "flex",
        "sdpa",
        "--gate-forms",
        "sigmoid",
        "dot",
    ]
    tool = str(ROOT / "tools" / "bench_attention.py")
    done = subprocess.run([sys.executable, tool, *args], capture_output=True, text=True,
                          check=True, timeout=600)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["top_k"]) for r in rows] == [
        ("soft-train", None), ("hard-train", 1), ("hard-train", 2),
        ("soft-train (dot)", None), ("hard-train (dot)", 1), ("hard-train (dot)", 2),
    ]  # fmt: skip
    assert [set(r["backends"]) for r in rows] == [
        {"reference"}, {"reference", "segments"}, {"reference"},
        {"reference", "sdpa"}, {"reference", "segments"}, {"reference"},
    ]  # fmt: skip
    assert "flex hard_gated top_k=1 training step skipped" in done.stdout  # no CPU backward
    assert (
        rows[0]["ideal_speedup"] == 1.0 and rows[1]["ideal_speedup"] > rows[2]["ideal_speedup"] > 1
    )
    assert rows[4]["ideal_speedup"] == rows[1]["ideal_speedup"]  # the same hard pattern
    for row in rows:
        for b in row["backends"].values():
            assert b["max_abs_error_vs_reference"] < 1e-4 and b["ms"] > 0
            assert b["check_s"] > 0 and b["first_call_s"] > 0  # where a slow run's time went
    assert "segments hard_gated top_k=1 seq=600: checked in" in done.stdout


def test_bench_attention_times_the_keys_rule(tmp_path):
    """``--key-groups own_and_previous``: every routed row computes the rule (checked against
    the reference), by the backends that compute it (decomposed and segments skipped), and
    its density counts a key in its predecessor's groups too (above the method's)."""
    tool = str(ROOT / "tools" / "bench_attention.py")
    args = ["--device", "cpu", "--seq", "320", "--groups", "4", "--top-k", "1", "--train"]
    args += ["--heads", "4", "--heads-kv", "2", "--head-dim", "16", "--dtype", "fp32"]
    args += ["--window", "32", "--warmup", "0", "--repeats", "1"]
    args += ["--backends", "reference", "decomposed", "segments", "flex"]
    rows = {}
    for rule in ("own", "own_and_previous"):
        out = tmp_path / f"{rule}.json"
        cmd = [sys.executable, tool, *args, "--key-groups", rule, "--json", str(out)]
        subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        rows[rule] = json.loads(out.read_text())["rows"]
    rule = rows["own_and_previous"]
    assert [(r["mode"], r["key_groups"]) for r in rule] == [
        ("hard (keys own_and_previous)", "own_and_previous"),
        ("soft-train (keys own_and_previous)", "own_and_previous"),
        ("hard-train (keys own_and_previous)", "own_and_previous"),
    ]
    assert [set(r["backends"]) for r in rule] == [
        {"reference", "flex"}, {"reference"}, {"reference"}
    ]  # fmt: skip
    assert set(rows["own"][0]["backends"]) == {"reference", "decomposed", "segments", "flex"}
    for own, keys in zip(rows["own"], rule, strict=True):
        if own["mode"] != "soft-train":
            assert keys["density"] > own["density"]  # the same routing, more pairs
        for b in keys["backends"].values():
            assert b["max_abs_error_vs_reference"] < 1e-4 and b["ms"] > 0


@pytest.mark.capture
def test_bench_attention_counts_and_captures(tmp_path):
    """``--graphs`` times calls captured whole (CUDA graphs on a GPU; ``aot_eager`` here) and
    every backend reports its launches and host syncs per call: none on the FlexAttention
    path (the CPU decomposed path pads segments by length read from the data, its own)."""
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--seq", "256", "--groups", "4", "--top-k", "1", "--graphs"]
    args += ["--heads", "4", "--heads-kv", "2", "--head-dim", "16", "--dtype", "fp32"]
    args += ["--window", "32", "--warmup", "1", "--repeats", "2", "--json", str(out)]
    tool = str(ROOT / "tools" / "bench_attention.py")
    subprocess.run([sys.executable, tool, *args], capture_output=True, check=True, timeout=600)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["captured"] and set(row["backends"]) == {"decomposed", "flex"}
    for backend in row["backends"].values():
        assert backend["max_abs_error_vs_reference"] < 1e-4 and backend["ms"] > 0
        assert backend["launches"] > 0
    assert row["backends"]["flex"]["host_syncs"] == 0


def run_bench_decode(
    tmp_path, cache: str, lengths: list[str], extra: tuple[str, ...] = ()
) -> tuple[list[dict], str]:
    """``tools/bench_decode.py`` at small sizes on one kind of cache: its rows and table."""
    args = ["--batch", "3", "--groups", "4", "--top-k", "2", "--window", "16", "--layers", "1"]
    args += ["--heads", "4", "--heads-kv", "2", "--head-dim", "16"]
    args += ["--vocab", "64", "--warmup", "1", "--steps", "3"]
    out, table = tmp_path / f"{cache}.json", tmp_path / f"{cache}.md"
    args += ["--caches", cache, "--seq", *lengths, "--json", str(out), "--markdown", str(table)]
    args += list(extra)
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_decode.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seq"], r["batch"]) for r in rows] == [(int(n), 3) for n in lengths]
    return rows, table.read_text()


@pytest.mark.hf
def test_bench_decode_smoke_on_cpu(tmp_path):
    """The decode benchmark runs end to end at small sizes on the dynamic cache: the sparse step
    agrees with the dense one and reads fewer keys than the context (a smoke check, not
    figures)."""
    rows, table = run_bench_decode(tmp_path, "dynamic", ["200", "700"], ("--generate", "3"))
    for row in rows:  # three sequences decoded together, each with its own prompt
        assert row["max_abs_diff_sparse_vs_dense"] < 1e-4
        assert 16 < row["keys_read_per_step"] < row["keys_dense_per_step"]
        assert min(row["dense_ms"], row["focus_dense_ms"], row["focus_sparse_ms"]) > 0
        assert "static_focus_ms" not in row
        assert row["generate_new_tokens"] == 3 and row["generate_dynamic_focus_s"] > 0
        assert row["generate_dynamic_dense_tokens_per_s"] > 0
        assert "generate_static_focus_s" not in row
    assert "| 700 | 3 |" in table and "| 700 | 3 | 3 |" in table  # the generate table


@pytest.mark.hf
def test_bench_decode_generate_gives_the_same_tokens_on_both_caches():
    """``generate()`` end to end on the dynamic and the static cache (eager on a CPU): Focus's
    greedy tokens agree, and every figure is there."""
    from focus_pretrain.bench.decode import DecodeBenchConfig, _models
    from focus_pretrain.bench.decode_generate import generate_row

    cfg = DecodeBenchConfig(seq=[300], batch=2, groups=4, top_k=1, window=16, layers=2)
    cfg.heads, cfg.heads_kv, cfg.head_dim, cfg.vocab, cfg.generate = 4, 2, 16, 64, 4
    model, plain = _models(cfg)
    prompt = torch.randint(0, cfg.vocab, (2, 300), generator=torch.Generator().manual_seed(3))
    row = generate_row(cfg, model, plain, prompt)
    assert row["generate_focus_static_equals_dynamic"] is True
    for cache in ("dynamic", "static"):
        for name in ("dense", "focus"):
            assert row[f"generate_{cache}_{name}_s"] > 0
        assert row[f"generate_{cache}_speedup"] > 0


@pytest.mark.capture
def test_bench_decode_static_rows_on_cpu(tmp_path):
    """The static cache's rows (compiled steps): the block-sparse step agrees with the dense
    Focus step, visits some of the key blocks and its eager step reads nothing on the host (a
    smoke check, not figures; once, not under other transformers: it compiles two models)."""
    (row,), table = run_bench_decode(tmp_path, "static", ["700"])
    assert row["max_abs_diff_static_vs_dense"] < 1e-4
    assert 0 < row["static_blocks_visited"] <= 1
    assert min(row["static_dense_ms"], row["static_focus_ms"], row["focus_dense_ms"]) > 0
    for name in ("static_dense_eager", "static_focus_eager"):
        assert row[name]["host_syncs"] == 0 and row[name]["launches"] > 0
    assert "focus_sparse_ms" not in row
    assert "| 700 | 3 |" in table
