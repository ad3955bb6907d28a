"""Command-line tools run end to end (small sizes)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

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
        timeout=120,
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
    """tools/import_hf.py: the printed sections load as a recipe with the checkpoint's shape."""
    from focus_pretrain.config import load_config
    from focus_pretrain.convert import hf_model_config
    from tests.multiprocess.test_hf_import import make_hf_model

    _, path = make_hf_model("olmo2", tmp_path)
    tool = ROOT / "tools" / "import_hf.py"
    result = subprocess.run(
        [sys.executable, str(tool), str(path), "--groups", "8"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"# {path}: 19 tensors" in result.stderr  # 2 x 8 per layer + embedding, norm, head
    recipe = tmp_path / "retrofit.yaml"
    recipe.write_text(result.stdout)
    config = load_config(recipe, ["data.seq_length=64"])
    assert config.train.init_from_hf == str(path) and config.train.freeze == "retrofit"
    assert config.model.focus.num_groups == 8
    expected = hf_model_config(path)
    for field in ("family", "num_layers", "hidden_size", "num_query_groups", "rotary_base"):
        assert getattr(config.model, field) == getattr(expected, field), field
