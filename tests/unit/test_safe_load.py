"""Checkpoint files are read without running pickled code (``focus_pretrain.storage.safe_load``):
a file whose unpickling would call something (here: create a marker file through pathlib) is
refused, naming the file and the globals, and the marker is not created; with
``FOCUS_TRUST_CHECKPOINTS=1`` it loads and the marker appears (the refusal was real). Third-party
``torch.load(weights_only=False)`` calls are refused the same way inside
``weights_only_loading()``, which restores the environment afterwards. (Every layout's real
checkpoint files: ``tests/e2e/test_train.py``.)"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from focus_pretrain.errors import InputError
from focus_pretrain.storage.safe_load import (
    FORCE_ENV,
    TRUST_ENV,
    UnsafeCheckpointError,
    install_in_worker,
    load_checkpoint_file,
    unsafe_globals,
    weights_only_loading,
)

NO_FORCE_ENV = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"


class _TouchOnLoad:
    """Unpickling it calls ``pathlib.Path(marker).touch()``: what a hostile file could do."""

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _hostile(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """A checkpoint-like file (tensors and a hostile object) and the marker it would create."""
    marker, path = tmp_path / "marker", tmp_path / "hostile.pt"
    torch.save({"module": {"w": torch.arange(3.0)}, "extra": _TouchOnLoad(marker)}, path)
    return path, marker


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (TRUST_ENV, FORCE_ENV, NO_FORCE_ENV):
        monkeypatch.delenv(name, raising=False)


def test_a_file_that_would_run_code_is_refused_unless_trusted(tmp_path, monkeypatch):
    path, marker = _hostile(tmp_path)
    assert "builtins.getattr" in unsafe_globals(path)
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_checkpoint_file(path)
    message = str(refused.value)
    assert isinstance(refused.value, InputError) and "\n" not in message  # one line, status 2
    assert str(path) in message and f"{TRUST_ENV}=1" in message
    for name in ("builtins.getattr", "pathlib.Path", "pathlib.PosixPath"):
        assert name in message
    assert not marker.exists()
    monkeypatch.setenv(TRUST_ENV, "1")
    assert torch.equal(load_checkpoint_file(path)["module"]["w"], torch.arange(3.0))
    assert marker.exists()  # trusted: the pickled call ran


def test_third_party_loads_are_refused_inside_weights_only_loading(tmp_path, monkeypatch):
    """``torch.load(f, weights_only=False)`` (as DeepSpeed calls it) refuses the file inside;
    the environment is as before afterwards, on success and on error, and a
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` set outside is cleared inside (torch refuses both)."""
    path, marker = _hostile(tmp_path)
    monkeypatch.setenv(NO_FORCE_ENV, "1")
    globals_before = set(torch.serialization.get_safe_globals())
    refusal = pytest.raises(UnsafeCheckpointError, match=r"builtins\.getattr")
    with refusal as refused, weights_only_loading(tmp_path):
        assert os.environ[FORCE_ENV] == "1" and NO_FORCE_ENV not in os.environ
        torch.load(path, weights_only=False)
    assert str(path) in str(refused.value)  # the file torch.load was reading
    assert not marker.exists()
    assert FORCE_ENV not in os.environ and os.environ[NO_FORCE_ENV] == "1"
    assert set(torch.serialization.get_safe_globals()) == globals_before

    monkeypatch.setenv(FORCE_ENV, "yes")
    with pytest.raises(KeyError), weights_only_loading():
        raise KeyError("not a loading error")
    assert os.environ[FORCE_ENV] == "yes" and os.environ[NO_FORCE_ENV] == "1"

    monkeypatch.delenv(FORCE_ENV)
    monkeypatch.delenv(NO_FORCE_ENV)
    monkeypatch.setenv(TRUST_ENV, "1")
    with weights_only_loading():
        assert FORCE_ENV not in os.environ
        torch.load(path, weights_only=False)
    assert marker.exists()


def test_the_allowlist_loads_what_deepspeed_and_older_checkpoints_hold(tmp_path):
    """What ZeRO optimizer files hold besides tensors (stage enum, loss scalers, fragment
    addresses) and the numpy RNG state of checkpoints saved before it was stored as a list."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    rng = np.random.RandomState(7).get_state()
    saved = {
        "zero_stage": ZeroStageEnum.gradients,
        "loss_scaler": LossScaler(1),
        "fp16_scaler": DynamicLossScaler(2**16, 1000, 1, 2, False),
        "param_slice_mappings": {"w": fragment_address(numel=6, start=12)},
        "rng": {"numpy": rng},
    }
    torch.save(saved, tmp_path / "states.pt")
    named = torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "states.pt")
    assert len([name for name in named if name.startswith("deepspeed.")]) == 4  # not by default
    assert unsafe_globals(tmp_path / "states.pt") == []
    loaded = load_checkpoint_file(tmp_path / "states.pt")
    assert loaded["zero_stage"] is ZeroStageEnum.gradients
    assert vars(loaded["fp16_scaler"]) == vars(saved["fp16_scaler"])
    assert loaded["param_slice_mappings"]["w"] == fragment_address(numel=6, start=12)
    state = np.random.RandomState()
    state.set_state(loaded["rng"]["numpy"])
    assert state.randint(1 << 30) == np.random.RandomState(7).randint(1 << 30)


def test_pool_workers_not_forked_load_weights_only_with_install_in_worker(tmp_path):
    """A worker spawned (not forked) inherits no allowlist: the initializer sets it up."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path, marker = _hostile(tmp_path)
    torch.save({"zero_stage": ZeroStageEnum.weights}, tmp_path / "zero.pt")
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=install_in_worker) as pool:
        assert pool.submit(_load, tmp_path / "zero.pt").result() == {"zero_stage": 3}
        with pytest.raises(Exception, match="GLOBAL getattr"):
            pool.submit(_load, path).result()
    assert not marker.exists()


def _load(path):
    return torch.load(path, weights_only=False)  # as DeepSpeed's converter calls it
