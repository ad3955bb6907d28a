"""The declared dependencies are installed, importable, used, and in the supported version
ranges."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import os
import pathlib
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

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


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [dep for deps in project["optional-dependencies"].values() for dep in deps]
    return {Requirement(dep).name: Requirement(dep) for dep in [*project["dependencies"], *extras]}


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_every_dependency_has_an_upper_bound_but_torch():
    """An upstream release outside the tested range cannot reach a user's install (torch
    excepted: GPU users pick their build; docs/dependencies.md)."""
    for name, requirement in _requirements().items():
        if name != "torch":
            assert any(s.operator in ("<", "<=", "==") for s in requirement.specifier), name


def test_the_lock_pins_every_dependency_inside_its_declared_range():
    pins = _lock()
    for name, requirement in _requirements().items():
        if name in ("torch", "flash-attn"):  # the user's build; optional GPU kernels
            assert canonicalize_name(name) not in pins
            continue
        assert requirement.specifier.contains(pins[canonicalize_name(name)]), name
    assert not [n for n in pins if n.startswith(("torch", "triton", "nvidia-"))]


@pytest.mark.skipif(os.environ.get("FOCUS_LOCK") == "", reason="set up without the lock (LOCK=)")
def test_the_installed_versions_are_the_locked_ones():
    """`make setup` installs from requirements/lock.txt (the suite runs on what CI tested)."""
    pins = _lock()
    installed = {name: metadata.version(name) for name in pins}  # the copy imports find
    differ = {n: (installed[n], v) for n, v in pins.items() if installed[n] != v}
    assert not differ, f"installed != locked: {differ} (make setup installs from the lock)"


def test_the_declared_transformers_range_is_the_exports_tested_range():
    """pyproject.toml and the shipped modeling code (which records the range in each export)
    name the same range, and the installed transformers is inside it."""
    from focus_pretrain.convert.hf_export import _shipped_configuration

    tested = _shipped_configuration().TESTED_TRANSFORMERS
    assert _requirements()["transformers"].specifier == SpecifierSet(tested)
    assert SpecifierSet(tested).contains(metadata.version("transformers"))


@pytest.mark.torch
def test_the_torch_imported_is_a_supported_one():
    """The torch the tests import is inside pyproject's range, and under tools/torch_compat.py
    it is the overlay's version (FOCUS_EXPECT_TORCH), not the locked one shadowing it."""
    import torch
    from packaging.version import Version

    imported = Version(torch.__version__).base_version
    assert _requirements()["torch"].specifier.contains(imported), imported
    expected = os.environ.get("FOCUS_EXPECT_TORCH")
    if expected:
        assert Version(imported) == Version(expected), (imported, expected)
