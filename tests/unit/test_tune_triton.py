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
         str(tmp_path / "tune.json"), "--rivals", "reference"]
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
    records = json.loads(table.read_text())["gpus"]["Triton interpreter (CPU)"]["training"]
    for mode in ("soft", "hard_gated"):  # the ranking auto trains by, per mode and length
        speeds = records[f"half/64/{mode}@36"]
        assert set(speeds) == {"triton", "reference"}
        assert speeds["triton"] == row[mode]["speedup"]
        assert speeds["reference"] == row[mode]["rivals"]["reference"]["speedup"]


def test_measured_fastest_training_backend_is_read_per_gpu():
    from focus_pretrain.focus.triton_tiles import fastest_training_backend, measured_table

    for gpu, entry in measured_table().items():
        for key, speeds in entry.get("training", {}).items():
            precision, size, mode = key.split("/")
            if "@" in key or len(speeds) < 2:  # per length: the test below
                continue
            best = max(speeds, key=speeds.get)
            assert fastest_training_backend(gpu, precision, int(size), mode) == best
    assert fastest_training_backend("No Such GPU", "half", 128, "soft") is None


RANKING = {  # speedups over dense per mode and length: the winner changes with the length
    "half/128/soft": {"triton": 0.4, "flex": 0.01},
    "half/128/hard_gated@8192": {"triton": 0.25, "flex": 0.5},
    "half/128/hard_gated@65536": {"triton": 1.9, "flex": 0.9},
    "half/128/hard_gated@262144": {"triton": 3.0},  # one backend: not a ranking
}


def simulated_gpu(monkeypatch, tmp_path, training: dict) -> None:
    """This process as if it held a CUDA GPU named ``Test GPU`` whose table entry (a table of
    the user's own, ``FOCUS_TRITON_TILES``) has the ``training`` records given."""
    from focus_pretrain.focus import triton_tiles

    table = tmp_path / f"tiles-{len(list(tmp_path.iterdir()))}.json"  # read once per path
    table.write_text(json.dumps({"gpus": {"Test GPU": {"tiles": {}, "training": training}}}))
    monkeypatch.setenv("FOCUS_TRITON_TILES", str(table))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(triton_tiles, "_gpu_name", lambda index: "Test GPU")


@pytest.mark.parametrize(
    "mode,seq,want",
    [
        ("soft", 4096, "triton"),
        ("soft", 65536, "triton"),
        ("hard_gated", 4096, "flex"),
        ("hard_gated", 16384, "flex"),
        ("hard_gated", 32768, "triton"),
        ("hard_gated", 1 << 20, "triton"),
    ],
)
def test_auto_trains_on_the_backend_the_table_ranks_fastest_at_the_nearest_length(
    monkeypatch, tmp_path, mode, seq, want
):
    """On CPU with the GPU simulated: ``auto``'s training choice is the table's, at the measured
    length nearest the request's (by ratio), records of one backend not counted."""
    import focus_pretrain.focus.attention  # noqa: F401  (registers the backends)
    from focus_pretrain.focus.backends import AttentionRequest, select_backend
    from focus_pretrain.focus.triton_tiles import fastest_training_backend

    simulated_gpu(monkeypatch, tmp_path, RANKING)
    assert fastest_training_backend("Test GPU", "half", 128, mode, seq) == want
    request = AttentionRequest("cuda", torch.bfloat16, 1, seq, 16, 16, 128, mode, 1, False,
                               128, False, True)  # fmt: skip
    assert select_backend("auto", request).name == want
    inference = AttentionRequest("cuda", torch.bfloat16, 1, seq, 16, 16, 128, mode, 1, False,
                                 128, False, False)  # fmt: skip
    assert select_backend("auto", inference).name != "triton"  # training only
    simulated_gpu(monkeypatch, tmp_path, {})  # nothing measured: never triton by itself
    assert select_backend("auto", request).name != "triton"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_auto_trains_the_soft_gate_on_the_backend_the_table_measured_fastest():
    import focus_pretrain.focus.attention  # noqa: F401  (registers the backends)
    from focus_pretrain.focus.backends import AttentionRequest, select_backend
    from focus_pretrain.focus.triton_tiles import fastest_training_backend

    gpu = torch.cuda.get_device_name()
    want = fastest_training_backend(gpu, "half", 128, "soft", 4096)
    request = AttentionRequest("cuda", torch.bfloat16, 1, 4096, 16, 16, 128, "soft", 1, False,
                               128, False, True)  # fmt: skip
    chosen = select_backend("auto", request).name
    assert (chosen == "triton") == (want == "triton"), (gpu, want, chosen)
