"""The declared dependencies are installed, importable, used, and in the supported version
ranges."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import pathlib
import re
import tomllib

import pytest

import focus_pretrain

ROOT = pathlib.Path(__file__).parents[2]
# distribution name -> the module our code imports
MODULE_OF = {"megatron-core": "megatron.core", "pyyaml": "yaml"}
USED_THROUGH = {"tensorboard": "torch.utils.tensorboard"}  # the writer torch ships needs it


def _declared() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]]


@pytest.mark.parametrize("dist", _declared())
def test_dependency_imports(dist):
    importlib.import_module(MODULE_OF.get(dist, dist))


def test_every_declared_dependency_is_used():
    """A dependency nothing imports is dropped from pyproject.toml rather than carried."""
    sources = "\n".join(p.read_text() for p in (ROOT / "focus_pretrain").rglob("*.py"))
    for dist in _declared():
        module = USED_THROUGH.get(dist, MODULE_OF.get(dist, dist).split(".")[0])
        assert re.search(rf"^\s*(import|from) {re.escape(module)}\b", sources, flags=re.M), dist


@pytest.mark.parametrize("dist, prefix", [("megatron-core", "0.16."), ("deepspeed", "0.19.")])
def test_pinned_versions(dist, prefix):
    assert metadata.version(dist).startswith(prefix)


def test_package_metadata():
    assert metadata.version("focus-pretrain") == focus_pretrain.__version__
    from focus_pretrain.focus import FocusRouter, focus_attention  # the public surface

    assert callable(focus_attention) and callable(FocusRouter)
