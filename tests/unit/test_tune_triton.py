"""The triton tuning harness (``tools/tune_triton.py``) end to end on tiny shapes in Triton's
interpreter: every candidate timed and checked, the fastest written to a tile table that the
launches then read, the reference check and the length rows; and ``auto``'s training choice
following the table."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import ON_GPU, needs_triton

pytestmark = needs_triton


def test_tuning_harness_writes_a_table_the_launches_read(tmp_path, monkeypatch):
    from focus_pretrain.focus.triton_tiles import Tile, launch_tiles
    from tools.tune_triton import main

    table = tmp_path / "tiles.json"
    result = main(
        ["--device", "cpu", "--stages", "tune", "check", "lengths", "--seq", "40", "--check-seq",
         "36", "--lengths", "36", "--heads", "2", "--head-dim", "16", "--groups", "3",
         "--window", "6", "--dtype", "fp16", "--tiny", "--table", str(table), "--json",
         str(tmp_path / "tune.json")]
    )  # fmt: skip
    rows = result["tune"]["rows"]
    assert {r["kernel"] for r in rows} == {"fwd", "kv", "q", "kva"}
    assert all(r["ms"] > 0 and r["error"] < 1e-3 for r in rows)  # fp16 tiles agree
    entry = json.loads(table.read_text())["gpus"]["Triton interpreter (CPU)"]
    assert entry["measured_on"]["head_dim"] == 16 and entry["date"]
    monkeypatch.setenv("FOCUS_TRITON_TILES", str(table))  # a table of the user's own GPUs
    tiles = launch_tiles("half", 16, False, "Triton interpreter (CPU)")
    for key in ("fwd", "kv", "q"):
        assert tiles[key] == Tile.parse(result["tune"]["best"][key]["tile"])
    assert ("kva" in tiles) == ("kva" in result["tune"]["best"])
    for name, errors in result["check"].items():  # fp16 kernels against the fp32 reference
        assert max(errors["fast_gate"].values()) < 2e-2, name
    (row,) = result["lengths"]
    assert row["soft"]["ms"] > 0 and row["hard_gated"]["ideal"] > 1


def test_measured_fastest_training_backend_is_read_per_gpu():
    from focus_pretrain.focus.triton_tiles import fastest_training_backend, measured_table

    for gpu, entry in measured_table().items():
        for key, speeds in entry.get("training", {}).items():
            precision, size, mode = key.split("/")
            best = max(speeds, key=speeds.get)
            assert fastest_training_backend(gpu, precision, int(size), mode) == best
    assert fastest_training_backend("No Such GPU", "half", 128, "soft") is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_auto_trains_the_soft_gate_on_the_backend_the_table_measured_fastest():
    import focus_pretrain.focus.attention  # noqa: F401  (registers the backends)
    from focus_pretrain.focus.backends import AttentionRequest, select_backend
    from focus_pretrain.focus.triton_tiles import fastest_training_backend

    gpu = torch.cuda.get_device_name()
    want = fastest_training_backend(gpu, "half", 128, "soft")
    request = AttentionRequest("cuda", torch.bfloat16, 1, 4096, 16, 16, 128, "soft", 1, False,
                               128, False, True)  # fmt: skip
    chosen = select_backend("auto", request).name
    assert (chosen == "triton") == (want == "triton"), (gpu, want, chosen)
