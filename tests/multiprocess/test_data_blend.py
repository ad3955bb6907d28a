"""Weighted blends: Megatron's blend (which needs a process group) draws in proportion."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from tests.distributed import run_workers

pytestmark = pytest.mark.multiprocess


def blend_shares(rank: int, world_size: int, root: str) -> float:
    """Share of the first corpus among 800 train samples of a 3:1 blend."""
    from focus_pretrain.data import Tokenizer
    from focus_pretrain.data.datasets import DataConfig, build_datasets, prepare_data

    config = DataConfig(
        sources=[f"{root}/north.jsonl", f"{root}/south.jsonl"],
        weights=[3.0, 1.0],
        vocab_size=280,  # two-word corpora: few merges exist
        seq_length=32,
        cache_dir=f"{root}/cache",
    )
    tokenizer_path, prefixes = prepare_data(config)
    tok = Tokenizer(tokenizer_path)
    train, _ = build_datasets(config, tok, prefixes, train_samples=800, valid_samples=8)
    kinds = []
    for i in range(800):
        words = set(tok.decode(train[i]["tokens"].tolist()).split())
        north, south = bool(words & {"alpha", "gamma"}), bool(words & {"beta", "delta"})
        assert north != south, words  # each sample comes from one corpus
        kinds.append(north)
    return float(np.mean(kinds))


def test_weighted_blend_draws_in_proportion(tmp_path: pathlib.Path):
    rng = np.random.default_rng(0)
    for name, words in (("north", ["alpha", "gamma"]), ("south", ["beta", "delta"])):
        rows = [{"text": " ".join(rng.choice(words, 40))} for _ in range(300)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (share,) = run_workers("tests.multiprocess.test_data_blend:blend_shares", 1, str(tmp_path))
    assert abs(share - 0.75) < 0.04
