"""Run ``pretrain`` inside a test worker (a real gloo process group already exists)."""

from __future__ import annotations

import os
import pathlib


def train(rank: int, world_size: int, overrides: list[str]) -> dict:
    from focus_pretrain.config import load_config
    from focus_pretrain.train.engine import pretrain

    recipe = pathlib.Path(__file__).parents[2] / "configs" / "tiny.yaml"
    os.environ.setdefault("LOCAL_RANK", str(rank))
    return pretrain(load_config(recipe, overrides))
