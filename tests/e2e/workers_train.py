"""Run ``pretrain`` inside a test worker (a real gloo process group already exists)."""

from __future__ import annotations

import os
import pathlib


def train(rank: int, world_size: int, overrides: list[str]) -> dict:
    from focus_pretrain.config import load_config
    from focus_pretrain.train import pretrain

    recipe = pathlib.Path(__file__).parents[2] / "configs" / "tiny.yaml"
    os.environ.setdefault("LOCAL_RANK", str(rank))
    return pretrain(load_config(recipe, overrides))


def checkpoint_logits(rank: int, world_size: int, ckpt: str, tokens, new_tokens: int) -> dict:
    """Our model from a training checkpoint: logits in the soft (train) and hard (eval)
    patterns, and greedy continuation by full recomputation (no KV cache)."""
    import torch

    from focus_pretrain.config import load_config
    from focus_pretrain.model import build_model
    from focus_pretrain.parallel import ParallelLayout

    config = load_config(pathlib.Path(ckpt) / "config.yaml", [])
    ParallelLayout.initialize(config.parallel, config.run.seed)
    model = build_model(config.model, sequence_parallel=config.parallel.sequence_parallel)
    state = torch.load(pathlib.Path(ckpt) / "mp_rank_00_model_states.pt", weights_only=False)
    model.load_state_dict(state["module"], strict=False)

    def run(x):
        positions = torch.arange(x.shape[1])[None].expand_as(x)
        with torch.no_grad():
            return model(x, positions, None)

    out = {}
    model.train()
    out["soft"] = run(tokens)
    model.eval()
    out["hard"] = run(tokens)
    sequence = tokens[:1]
    for _ in range(new_tokens):
        nxt = run(sequence)[:, -1].argmax(dim=-1, keepdim=True)
        sequence = torch.cat([sequence, nxt], dim=1)
    out["greedy"] = sequence
    return out


def sharded_checkpoint_logits(rank: int, world_size: int, ckpt: str, tokens):
    """Our TP=world_size model from its per-rank checkpoint shards; gathered eval logits."""
    import torch
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from focus_pretrain.config import load_config
    from focus_pretrain.model import build_model
    from focus_pretrain.parallel import ParallelLayout

    config = load_config(pathlib.Path(ckpt) / "config.yaml", [])
    ParallelLayout.initialize(config.parallel, config.run.seed)
    model = build_model(config.model, sequence_parallel=config.parallel.sequence_parallel).eval()
    path = pathlib.Path(ckpt) / f"mp_rank_{rank:02d}_model_states.pt"
    model.load_state_dict(torch.load(path, weights_only=False)["module"], strict=False)
    with torch.no_grad():
        logits = model(tokens, torch.arange(tokens.shape[1])[None].expand_as(tokens), None)
        return gather_from_tensor_model_parallel_region(logits).clone()
