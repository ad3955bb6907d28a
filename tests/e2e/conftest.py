"""Runs the end-to-end tests share (each trained once per session): the data cache, the small
recipe in one process, and the recipe in each parallel layout."""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import pytest

from tests.distributed import run_workers
from tests.e2e.runs import overrides

# name -> (processes, overrides) of the small recipe's 3-step runs in parallel layouts
LAYOUTS = {
    "tp2": (2, ["parallel.tensor_parallel_size=2"]),
    "dp2": (2, ["parallel.zero_stage=2"]),
    "dp2-zero3": (2, ["parallel.zero_stage=3"]),
    "dp2-offload": (2, ["parallel.zero_stage=2", "parallel.cpu_offload=true"]),
    "cp2-ring-zero3": (
        2,
        ["parallel.context_parallel_size=2", "parallel.cp_mode=ring", "parallel.zero_stage=3"],
    ),
    "tp2-sp-cp2-ring": (  # the layout of configs/7b-1m.yaml: sequence parallel, CP ring
        4,
        [
            "parallel.tensor_parallel_size=2",
            "parallel.sequence_parallel=true",
            "parallel.context_parallel_size=2",
            "parallel.cp_mode=ring",
        ],
    ),
    "tp2-zero3": (2, ["parallel.tensor_parallel_size=2", "parallel.zero_stage=3"]),
}


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> str:
    """One data cache (tokenizer and token files of the small recipe) for the session."""
    return str(tmp_path_factory.mktemp("data-cache"))


@pytest.fixture(scope="session")
def one_process(tmp_path_factory, cache) -> tuple[dict, pathlib.Path]:
    """The small recipe for 3 steps (fp32) in one process: the result every parallel layout
    must reproduce, and its run directory."""
    out = tmp_path_factory.mktemp("one") / "run"
    sets = overrides(out, cache, "train.steps=3")
    (result,) = run_workers("tests.e2e.workers_train:train", 1, sets)
    return result, out


@pytest.fixture(scope="session")
def layout_run(tmp_path_factory, cache) -> Callable[[str], tuple[list[dict], pathlib.Path]]:
    """``layout_run(name)``: every rank's result and the run directory of the small recipe
    trained 3 steps in layout ``name`` of :data:`LAYOUTS` (trained on first request)."""
    done: dict[str, tuple[list[dict], pathlib.Path]] = {}
    failed: dict[str, Exception] = {}  # a layout that failed is not run again (a hang: twice)

    def get(name: str) -> tuple[list[dict], pathlib.Path]:
        if name in failed:
            raise RuntimeError(f"layout {name} failed earlier in this session") from failed[name]
        if name not in done:
            processes, extra = LAYOUTS[name]
            out = tmp_path_factory.mktemp(name) / "run"
            sets = overrides(out, cache, "train.steps=3", *extra)
            try:
                done[name] = (run_workers("tests.e2e.workers_train:train", processes, sets), out)
            except Exception as error:
                failed[name] = error
                raise
        return done[name]

    return get
