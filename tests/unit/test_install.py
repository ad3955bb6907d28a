"""The declared dependencies are installed, importable, and in the supported version ranges."""

from __future__ import annotations

import importlib
import importlib.metadata as metadata

import pytest

import focus_pretrain


@pytest.mark.parametrize(
    "module",
    [
        "megatron.core",
        "deepspeed",
        "datasets",
        "sentencepiece",
        "tensorboard",
        "transformers",
        "safetensors",
        "yaml",
        "pydantic",
    ],
)
def test_dependency_imports(module):
    importlib.import_module(module)


@pytest.mark.parametrize("dist, prefix", [("megatron-core", "0.16."), ("deepspeed", "0.19.")])
def test_pinned_versions(dist, prefix):
    assert metadata.version(dist).startswith(prefix)


def test_package_metadata():
    assert metadata.version("focus-pretrain") == focus_pretrain.__version__
    from focus_pretrain.focus import FocusRouter, focus_attention  # the public surface

    assert callable(focus_attention) and callable(FocusRouter)
