"""Shared pytest configuration: deterministic seeds and a bounded thread count.

Without CUDA, Triton (when installed) runs in its interpreter: ``TRITON_INTERPRET=1`` must be
set before Triton is first imported, so it is set here, for this process and its workers. The
``triton`` attention backend's kernels are then tested on CPU tensors
(``tests/unit/test_soft_triton.py``)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from hypothesis import settings

if "triton" not in sys.modules and not torch.cuda.is_available():  # torch does not import it
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist (make test runs -n 2): the cores are shared among the workers, so each worker's
# torch, and the processes its tests start (launchers, ranks), get their share of threads
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
THREADS = max(1, min(2, (CORES or 2) // WORKERS))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.register_profile("thorough", max_examples=400, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(1234)
    torch.set_num_threads(THREADS)
    yield


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` first (stable otherwise): with parallel workers the longest
    start at once and the rest fill in around them, instead of one running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
