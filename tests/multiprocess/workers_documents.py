"""Workers for the packed-document model tests (one gloo process; megatron-core on the CPU)."""

from __future__ import annotations

import itertools

import torch

from focus_pretrain.focus.pattern import document_starts
from focus_pretrain.model.packing import document_params
from tests.multiprocess.workers_model import _build, _init


def packed_and_alone(rank: int, world_size: int, cases: list) -> list[dict]:
    """For each ``(model_kwargs, focus_kwargs, lengths, reset)``: per-token losses and every
    gradient of one packed sequence of documents of ``lengths``, and of the documents run one
    by one (gradients summed), in training (soft gate) and per-token losses in eval (hard)."""
    _init(world_size)
    results = []
    for model_kwargs, focus_kwargs, lengths, reset in cases:
        config, model = _build(world_size, model_kwargs, focus_kwargs)
        gen = torch.Generator().manual_seed(5)
        s = sum(lengths)
        tokens = torch.randint(0, config.vocab_size, (1, s), generator=gen)
        labels = torch.randint(0, config.vocab_size, (1, s), generator=gen)
        ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]  # [1, s]
        starts = document_starts(ids)
        within = torch.arange(s)[None] - starts  # [1, s] positions inside each document
        positions = within if reset else torch.arange(s)[None]
        params = document_params(starts, within if reset else None, s)
        spans = torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
        out = {}
        for mode in ("train", "eval"):
            model.train(mode == "train")
            model.zero_grad(set_to_none=True)
            packed = model(tokens, positions, None, labels=labels, packed_seq_params=params)
            alone = []
            for a, e in itertools.pairwise(spans):
                alone.append(model(tokens[:, a:e], torch.arange(e - a)[None], None,
                                   labels=labels[:, a:e]))  # fmt: skip
            alone = torch.cat(alone, dim=1)  # [1, s]
            out[mode] = dict(packed=packed.detach(), alone=alone.detach())
            if mode == "train":
                grads = []
                for loss in (packed.sum(), alone.sum()):
                    grads.append(
                        {n: g for n, g in zip(
                            [n for n, p in model.named_parameters() if p.requires_grad],
                            torch.autograd.grad(
                                loss,
                                [p for p in model.parameters() if p.requires_grad],
                                retain_graph=True,
                                allow_unused=True,
                            ),
                            strict=True,
                        ) if g is not None}
                    )  # fmt: skip
                out["grads"] = grads
        results.append(out)
    return results
