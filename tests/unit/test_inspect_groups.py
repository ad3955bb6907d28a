"""The group-interpretability tool (``focus_pretrain.analysis``, ``tools/inspect_groups.py``):
its statistics on constructed routing with known answers, against ``pattern_density`` and
``bincount`` on the routing captured from real tiny models (an HF export built here from the
shipped classes; one of our checkpoints trained for 2 steps, e2e), the whole tool with its
report and plots, and its refusals of bad input."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import pathlib
import shutil
import sys

import numpy as np
import pytest
import torch
from matplotlib.image import imread

from focus_pretrain.analysis import (
    GroupStats,
    RouterCapture,
    align_layers,
    best_matching,
    kept_pairs_by_distance,
    matched_agreement,
    normalized_mutual_information,
    random_density,
    random_pair_share,
    typical_tokens,
)
from focus_pretrain.analysis.groups import distance_bins
from focus_pretrain.analysis.load import load_for_inspection
from focus_pretrain.convert import hf_export
from focus_pretrain.data import Tokenizer, demo_documents, train_tokenizer
from focus_pretrain.focus import Routing, count_allowed_pairs, pattern_density
from tests.distributed import run_workers

ROOT = pathlib.Path(__file__).parents[2]


def _load_tool():
    return importlib.import_module("focus_pretrain.commands.inspect_groups")


tool = _load_tool()


def one_hot(groups: torch.Tensor, k: int) -> torch.Tensor:
    """``[b, s]`` group ids -> ``[b, s, K]`` near one-hot assignments (rows sum to 1)."""
    probs = torch.full((*groups.shape, k), 0.1 / k)
    probs.scatter_(-1, groups[..., None], 0.9 + 0.1 / k)
    return probs  # [b, s, K]


def brute_kept_by_distance(member: torch.Tensor, window: int) -> torch.Tensor:
    n = member.shape[1]
    i = torch.arange(n)
    distance = i[:, None] - i[None, :]  # [n, n]
    out = torch.zeros(n, dtype=torch.int64)
    for row in member:
        allowed = (distance >= 0) & ((distance <= window) | ((row[:, None] & row[None]) != 0))
        for d in range(n):
            out[d] += int(allowed.diagonal(-d).sum())
    return out


# --- the core on constructed routing --------------------------------------------------------


def test_known_shares_and_density_of_constructed_routing():
    k, window = 4, 3
    pattern = torch.tensor([0, 0, 1, 2])  # shares 1/2, 1/4, 1/4, 0
    groups = pattern.repeat(2, 10)  # [2, 40]
    probs = one_hot(groups, k)
    stats = GroupStats(k, window, 1, [5])
    stats.add([probs], torch.arange(80).reshape(2, 40))
    result = stats.result()
    (layer,) = result["layers"]
    assert layer["layer"] == 5
    assert layer["shares"] == [0.5, 0.25, 0.25, 0.0]
    assert layer["distance"]["independent_pair_share"] == 0.5**2 + 2 * 0.25**2
    np.testing.assert_allclose(layer["soft_shares"], probs.reshape(-1, k).double().mean(0))
    direct = pattern_density(Routing(probs).membership(1), window)
    assert layer["density_per_sample"] == direct.tolist()
    assert layer["density"] == pytest.approx(float(direct.mean()))
    assert 0 < layer["density"] < 1 and layer["ideal_speedup"] == pytest.approx(
        1 / layer["density"]
    )
    random = random_density([40, 40], k, 1, window)
    assert result["random"]["density_per_sample"] == random


def test_collapsed_routing_keeps_every_pair_and_is_perfectly_stable():
    """Every token in group 0 in every layer: share 1, density 1 (all causal pairs), every
    distance fully kept, NMI and agreement 1, every token keeps its group."""
    k, window = 4, 2
    probs = one_hot(torch.zeros(3, 50, dtype=torch.int64), k)
    stats = GroupStats(k, window, 1, [0, 1, 2])
    stats.add([probs, probs.clone(), probs.clone()], torch.randint(0, 5, (3, 50)))
    result = stats.result(min_count=1)
    for layer in result["layers"]:
        assert layer["shares"][0] == 1.0 and layer["max_share"] == 1.0
        assert layer["density"] == 1.0
        assert all(f == 1.0 for f in layer["distance"]["kept_fraction"])
        assert layer["distance"]["independent_pair_share"] == 1.0
    stability = result["stability"]
    assert stability["nmi"] == [[1.0] * 3] * 3
    assert stability["matched_agreement"] == [[1.0] * 3] * 3
    assert stability["tokens"]["keep_rate"] == 1.0


def test_renamed_groups_are_the_same_grouping_and_independent_layers_are_not():
    k, n = 4, 20000
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, k, (n,), generator=gen)
    renamed = torch.tensor([2, 0, 3, 1])[a]  # the same grouping, other names
    assert normalized_mutual_information(a, renamed, k) == pytest.approx(1.0)
    assert matched_agreement(a, renamed, k) == 1.0
    aligned, exact = align_layers(torch.stack([a, renamed]), k)
    assert exact and torch.equal(aligned[1], a)
    independent = torch.randint(0, k, (n,), generator=gen)
    assert normalized_mutual_information(a, independent, k) < 0.005
    assert abs(matched_agreement(a, independent, k) - 1 / k) < 0.03
    # half the tokens keep their group, half are re-drawn: in between
    mixed = torch.where(torch.rand(n, generator=gen) < 0.5, renamed, independent)
    assert 0.2 < normalized_mutual_information(a, mixed, k) < 0.8


def test_stability_report_on_identical_and_independent_layers():
    k = 4
    gen = torch.Generator().manual_seed(1)
    same = torch.randint(0, k, (4, 256), generator=gen)
    other = torch.randint(0, k, (4, 256), generator=gen)
    stats = GroupStats(k, 8, 1, [0, 1, 2])
    ids = torch.randint(0, 20, (4, 256), generator=gen)
    stats.add(
        [one_hot(same, k), one_hot(torch.tensor([1, 2, 3, 0])[same], k), one_hot(other, k)], ids
    )
    stability = stats.result()["stability"]
    assert stability["nmi"][0][1] == pytest.approx(1.0)
    assert stability["nmi"][0][2] < 0.02 and stability["nmi"][1][2] < 0.02
    tokens = stability["tokens"]
    # 0 -> 1 always kept, 1 -> 2 about chance (1/K, plus what the matching fits)
    assert 0.5 + 0.5 * 0.2 < tokens["keep_rate"] < 0.5 + 0.5 * 0.35
    assert tokens["chance"] == pytest.approx(0.25, abs=0.02)
    assert len(tokens["most_stable"]) == 8 and tokens["most_stable"][0]["count"] >= 5


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("window", [0, 5])
def test_kept_pairs_by_distance_is_exact(top_k, window):
    probs = torch.softmax(torch.randn(3, 90, 4) * 3, dim=-1)
    member = Routing(probs).membership(top_k)
    kept = kept_pairs_by_distance(member, window)
    assert torch.equal(kept, brute_kept_by_distance(member, window))
    assert int(kept.sum()) == int(count_allowed_pairs(member, window).sum())


def test_random_routing_keeps_one_in_k_pairs_at_every_distance_as_the_benchmarks_say():
    """Balanced random top-1 routing: ~1/K of the far pairs at every distance; the density at
    1,024 tokens, K = 8, window 128 is the 33.15% of docs/benchmarks.md."""
    assert random_pair_share(4, 1) == 0.25 and random_pair_share(4, 2) == pytest.approx(5 / 6)
    (density,) = random_density([1024], 8, 1, 128)
    assert density == pytest.approx(0.3315, abs=0.003)
    gen = torch.Generator().manual_seed(0)
    stats = GroupStats(8, 16, 1, [0])
    stats.add([torch.rand(4, 1024, 8, generator=gen)], torch.zeros(4, 1024, dtype=torch.int64))
    result = stats.result()
    assert result["distance_bins"] == [
        [17, 31],
        [32, 63],
        [64, 127],
        [128, 255],
        [256, 511],
        [512, 1023],
    ]
    for fraction in result["layers"][0]["distance"]["kept_fraction"]:
        assert abs(fraction - 1 / 8) < 0.02
    assert distance_bins(16, 16) == [] and distance_bins(0, 5) == [(1, 1), (2, 3), (4, 5)]


def test_best_matching_is_exact_up_to_eight_groups():
    table = np.array([[10.0, 9.0], [9.0, 0.0]])  # greedy (10 + 0) loses to 9 + 9
    match, exact = best_matching(table)
    assert exact and match.tolist() == [1, 0]
    rng = np.random.default_rng(0)
    table = rng.integers(0, 100, (6, 6)).astype(float)
    best = max(sum(table[i, p[i]] for i in range(6)) for p in itertools.permutations(range(6)))
    match, _ = best_matching(table)
    assert table[np.arange(6), match].sum() == best
    match, exact = best_matching(rng.integers(0, 100, (10, 10)).astype(float))
    assert not exact and sorted(match.tolist()) == list(range(10))  # greedy: still one-to-one


def test_typical_tokens_rank_by_share_of_occurrences():
    # token 7: always group 1 (10x); token 3: group 1 in 6 of 10; token 9: group 1 twice only
    ids = torch.tensor([7] * 10 + [3] * 10 + [9] * 2 + [4] * 20)
    groups = torch.tensor([1] * 10 + [1] * 6 + [0] * 4 + [1] * 2 + [0] * 20)
    out = typical_tokens(ids, groups, 2, min_count=5, decode=lambda i: f"t{i}")
    assert [t["id"] for t in out[1]] == [7, 3]  # 9 too rare, 4 never in group 1
    assert out[1][0] == {"id": 7, "text": "t7", "count": 10, "share": 1.0, "lift": 1 / (18 / 42)}
    assert [t["id"] for t in out[0]] == [4]  # 3 is in group 0 less often than group 0's share


def test_bad_routing_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        GroupStats(4, 8, 5, [0])
    with pytest.raises(ValueError, match="no Focus layer"):
        GroupStats(4, 8, 1, [])
    stats = GroupStats(4, 8, 1, [0, 1])
    with pytest.raises(ValueError, match="2"):
        stats.add([torch.rand(1, 10, 4)], torch.zeros(1, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="K=4"):
        stats.add([torch.rand(1, 10, 3)] * 2, torch.zeros(1, 10, dtype=torch.int64))
    with pytest.raises(ValueError, match="nothing to report"):
        stats.result()


# --- a real tiny model: an HF export built from the shipped classes ------------------------


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> pathlib.Path:
    """A tiny 3-layer Llama-style Focus export (random weights) with our tokenizer converted,
    written as ``export_hf`` writes one (remote code, auto_map, tokenizer.json)."""
    root = tmp_path_factory.mktemp("inspect")
    spm = train_tokenizer(demo_documents(120, seed=1), root / "spm", vocab_size=300)
    modeling = hf_export.load_modeling()
    config = modeling.FocusLlamaConfig(
        focus={"num_groups": 4, "window": 8, "top_k": 1},
        num_hidden_layers=3,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=320,
        max_position_embeddings=96,
    )
    config.architectures = ["FocusLlamaForCausalLM"]
    config.auto_map = {
        "AutoConfig": "configuration_focus.FocusLlamaConfig",
        "AutoModelForCausalLM": "modeling_focus.FocusLlamaForCausalLM",
    }
    torch.manual_seed(0)
    model = modeling.FocusLlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    out = root / "hf"
    model.save_pretrained(out)
    for name in hf_export.SHIPPED_MODELING_FILES:
        shutil.copyfile(hf_export.MODELING_DIR / name, out / name)
    hf_export._save_tokenizer(Tokenizer(spm), out)
    return out


def test_shares_and_density_of_a_real_model_equal_a_direct_computation(export, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = load_for_inspection(export)
    assert (model.kind, model.num_groups, model.window, model.top_k) == ("hf-export", 4, 8, 1)
    assert model.max_length == 96 and model.tokenizer is not None
    tokens = torch.randint(3, 300, (2, 80), generator=torch.Generator().manual_seed(0))
    capture = RouterCapture(model.module)
    assert capture.layers == [0, 1, 2]
    with capture:
        model.run(tokens)
        probs = capture.pop()  # per layer [2, 80, 4]
    stats = GroupStats(4, 8, 1, capture.layers)
    stats.add(probs, tokens)
    result = stats.result()
    for p, layer in zip(probs, result["layers"], strict=True):
        assert p.shape == (2, 80, 4)
        counts = torch.bincount(p.argmax(-1).flatten(), minlength=4).double()
        assert layer["shares"] == (counts / counts.sum()).tolist()
        assert 0.25 <= layer["max_share"] < 1  # a spread, not a collapse
        direct = pattern_density(Routing(p).membership(1), 8)
        assert layer["density_per_sample"] == direct.tolist()
    # the layers' probabilities are what each router computes from its own input
    assert not torch.allclose(probs[0], probs[1])


def test_a_model_without_routers_is_refused():
    modeling = hf_export.load_modeling()
    for focus in ({"window_only": True}, {"enabled": False}):
        config = modeling.FocusLlamaConfig(
            focus=focus,
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            vocab_size=50,
        )
        with pytest.raises(ValueError, match="no Focus router"):
            RouterCapture(modeling.FocusLlamaForCausalLM(config))


def _png_ok(path: pathlib.Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.01  # something drawn


def test_the_tool_on_a_tiny_export_writes_the_report_and_plots(export, tmp_path, capsys):
    tokenizer, words = Tokenizer(export), next(demo_documents(1, seed=5)).split(" ")
    cut = max(i for i in range(len(words)) if len(tokenizer.encode(" ".join(words[:i]))) <= 96)
    text = tmp_path / "sample.txt"
    text.write_text(" ".join(words[:cut]))
    ids = tokenizer.encode(text.read_text())
    assert 80 < len(ids) <= 96
    out = tmp_path / "report"
    tool.main(["--checkpoint", str(export), "--text", str(text), "--out", str(out)])
    captured = capsys.readouterr()
    assert f"report: {out / 'report.md'}" in captured.out
    assert "routing" in captured.err  # progress
    result = json.loads((out / "report.json").read_text())
    assert result["tokens"] == len(ids) and result["sample"]["ids"] == ids
    assert result["source"]["kind"] == "hf-export"
    # the numbers are those of the routing computed directly on the same tokens
    model = load_for_inspection(export)
    with RouterCapture(model.module) as capture:
        model.run(torch.tensor([ids]))
        probs = capture.pop()
    for p, layer in zip(probs, result["layers"], strict=True):
        counts = torch.bincount(p.argmax(-1).flatten(), minlength=4).double()
        np.testing.assert_allclose(layer["shares"], counts / counts.sum())
        direct = float(pattern_density(Routing(p).membership(1), 8)[0])
        assert layer["density"] == pytest.approx(direct, rel=1e-12)
    assert "".join(result["sample"]["text"]).strip() == text.read_text().strip()  # token texts
    report = (out / "report.md").read_text()
    for heading in (
        "## Group shares",
        "## Kept pairs",
        "## Distance profile",
        "## Typical tokens per group",
        "## Stability across layers",
    ):
        assert heading in report
    for name in ("shares", "distance", "stability", "tokens_layer0", "tokens_layer2"):
        _png_ok(out / f"{name}.png")
        assert f"({name}.png)" in report


def test_the_tool_on_a_corpus(export, tmp_path):
    out = tmp_path / "corpus"
    args = ["--checkpoint", str(export), "--corpus", "demo:5", "--samples", "5"]
    tool.main([*args, "--length", "64", "--batch-size", "2", "--quiet", "--out", str(out)])
    result = json.loads((out / "report.json").read_text())
    assert result["samples"] == 5 and result["lengths"] == [64] and result["tokens"] == 320
    assert len(result["layers"][0]["density_per_sample"]) == 5
    assert any(tokens for tokens in result["layers"][0]["typical_tokens"])


def _refusal(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        tool.main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_the_tool_refuses_bad_input_naming_the_problem_and_the_fix(export, tmp_path, capsys):
    out = ["--out", str(tmp_path / "out"), "--quiet"]
    err = _refusal(capsys, ["--checkpoint", str(tmp_path / "nope"), "--corpus", "demo:5", *out])
    assert "does not exist" in err and "run directory" in err and "config.json" in err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    err = _refusal(capsys, ["--checkpoint", str(export), "--text", str(empty), *out])
    assert "empty" in err and str(empty) in err
    long = tmp_path / "long.txt"
    long.write_text(" ".join(demo_documents(20, seed=2)))
    err = _refusal(capsys, ["--checkpoint", str(export), "--text", str(long), *out])
    assert "maximum length 96" in err and "--length 96" in err
    err = _refusal(
        capsys, ["--checkpoint", str(export), "--corpus", "demo:5", "--length", "97", *out]
    )
    assert "--length 97" in err and "--length 96 or less" in err
    err = _refusal(
        capsys, ["--checkpoint", str(export), "--corpus", "demo:1", "--samples", "99", *out]
    )
    assert "fewer than --samples 99" in err
    err = _refusal(capsys, ["--checkpoint", str(export), *out])
    assert "--text" in err and "--corpus" in err
    err = _refusal(capsys, ["--checkpoint", str(export), "--text", str(tmp_path / "x.txt"), *out])
    assert "x.txt does not exist" in err
    assert not (tmp_path / "out").exists()
    # cutting the long text to the model's length is the fix the message names
    tool.main(["--checkpoint", str(export), "--text", str(long), "--length", "96", *out])
    assert json.loads((tmp_path / "out" / "report.json").read_text())["tokens"] == 96


# --- one of our checkpoints (e2e: trains the small recipe for 2 steps) ----------------------


def ours_routing(rank: int, world_size: int, run_dir: str, tokens: torch.Tensor) -> dict:
    """In a worker (its own process group): load our checkpoint for inspection, capture the
    routing of ``tokens`` and compute the report's numbers from it."""
    model = load_for_inspection(run_dir)
    with RouterCapture(model.module) as capture:
        model.run(tokens)
        probs = capture.pop()
    stats = GroupStats(model.num_groups, model.window, model.top_k, capture.layers)
    stats.add(probs, tokens)
    settings = (model.kind, model.num_groups, model.window, model.top_k, model.max_length)
    return {"probs": probs, "result": stats.result(), "settings": settings}


@pytest.mark.e2e
def test_the_tool_on_one_of_our_checkpoints(tmp_path):
    from tests.e2e.runs import launch, overrides

    run = tmp_path / "run"
    trained = launch(overrides(run, str(tmp_path / "cache"), "train.steps=2"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    tokens = torch.randint(3, 300, (2, 100), generator=torch.Generator().manual_seed(0))
    (ours,) = run_workers("tests.unit.test_inspect_groups:ours_routing", 1, str(run), tokens)
    assert ours["settings"] == ("checkpoint", 4, 16, 1, 128)
    for p, layer in zip(ours["probs"], ours["result"]["layers"], strict=True):
        assert p.shape == (2, 100, 4)
        counts = torch.bincount(p.argmax(-1).flatten(), minlength=4).double()
        assert layer["shares"] == (counts / counts.sum()).tolist()
        assert layer["density_per_sample"] == pattern_density(Routing(p).membership(1), 16).tolist()
    out = tmp_path / "groups"
    from tests.e2e.runs import run as run_command

    done = run_command(
        [
            sys.executable,
            str(ROOT / "tools" / "inspect_groups.py"),
            "--checkpoint",
            str(run),
            "--corpus",
            "demo:30",
            "--samples",
            "3",
            "--length",
            "128",
            "--out",
            str(out),
        ]
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"report: {out / 'report.md'}" in done.stdout
    result = json.loads((out / "report.json").read_text())
    assert result["source"]["kind"] == "checkpoint" and result["settings"]["layers"] == [0, 1]
    assert math.isclose(sum(result["layers"][0]["shares"]), 1.0)
    for name in ("shares", "distance", "stability", "tokens_layer0", "tokens_layer1"):
        _png_ok(out / f"{name}.png")
