"""E7: does a retrofit keep long-range copies? The loss on the copied tokens of held-out
samples ended with copies as ``data.copy_spans`` makes them (:mod:`focus_pretrain.data.copies`;
each copy's first token left out: nothing predicts it) for the original (the Focus layers
bypassed), and for the retrofit's routers inferred soft and hard top-k, against the loss on
the samples' other tokens. The samples are the run's validation split (text no run trained
on) with the same copies for every run and setting, so a run trained without copies is
measured on the same samples as one trained with them.

    python tools/experiments/e7/copy_loss.py RUN_DIR [--spans 4 --span-tokens 32
        --min-distance 256 --samples 8 --top-k 1 2 --json OUT.json]

RUN_DIR: a ``focus-pretrain retrofit --out`` directory (its ``run/`` checkpoint) or a run
directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

COPY_SEED = 0  # the copies' draw: the same for every run measured


def copy_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which copies the held-out samples end with, and how many."""
    parser.add_argument("--spans", type=int, default=4)
    parser.add_argument("--span-tokens", type=int, default=32)
    parser.add_argument("--min-distance", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", type=Path)


def held_out_copies(run: Path, args: argparse.Namespace) -> list[dict]:
    """The first ``args.samples`` validation samples of ``run`` (a checkpoint or run
    directory), each ended with the copies ``args`` ask for (the same draw for every run):
    ``{"sample", "layout"}`` (the sample's fields; ``[(source start, copy start)]``)."""
    from focus_pretrain.checkpoint.read import checkpoint_config, resolve_checkpoint
    from focus_pretrain.data.coordinate import prepare_data_in_job
    from focus_pretrain.data.copies import copy_layout, with_copies
    from focus_pretrain.data.datasets import build_datasets, tokenizer_path_for
    from focus_pretrain.data.tokenizer import Tokenizer

    config = checkpoint_config(resolve_checkpoint(run))
    if config.data.document_mask or config.data.reset_position_ids or config.data.eod_mask_loss:
        raise SystemExit(
            f"copy_loss: {run} trained with document masking, position resets or the EOD loss "
            "mask; the held-out copies here keep the text's document fields, so it measures "
            "runs without them"
        )
    tokenizer = Tokenizer(tokenizer_path_for(config.data, config.run.seed))
    _, prefixes = prepare_data_in_job(config.data, config.run.seed)
    _, valid = build_datasets(config.data, tokenizer, prefixes, 1, args.samples, config.run.seed)
    s, first = config.data.seq_length, int(config.data.bos_every_sample)
    draw = (args.spans, args.span_tokens, args.min_distance)
    out = []
    for i in range(args.samples):
        layout = copy_layout(s + 1, *draw, np.random.default_rng((COPY_SEED, i)), max(1, first))
        out.append({"sample": with_copies(valid[i], layout, args.span_tokens), "layout": layout})
    return out


def losses(
    model, samples: list[dict], copied: torch.Tensor, text: torch.Tensor
) -> dict[str, float]:
    """Mean per-token loss of ``model`` on the ``copied`` and on the ``text`` weighted labels
    (``[s]`` bool each)."""
    sums = {"copies": [0.0, 0], "text": [0.0, 0]}
    with torch.no_grad():
        for sample in samples:
            per_token = model(
                sample["tokens"][None], sample["position_ids"][None], None,
                labels=sample["labels"][None],
            )[0].float()  # fmt: skip
            weighted = sample["loss_mask"] > 0
            for name, where in (("copies", copied & weighted), ("text", text & weighted)):
                sums[name][0] += float(per_token[where].sum())
                sums[name][1] += int(where.sum())
    return {name: total / max(count, 1) for name, (total, count) in sums.items()}


def main() -> None:
    from focus_pretrain.checkpoint.model import load_checkpoint_model
    from focus_pretrain.data.copies import copied_labels
    from focus_pretrain.model.attention import dense_attention

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run")
    copy_arguments(parser)
    args = parser.parse_args()
    run = Path(args.run) / "run" if (Path(args.run) / "run").is_dir() else Path(args.run)
    settings = {"soft": ["model.focus.inference_mode=soft"]}
    for k in args.top_k:
        settings[f"hard top-{k}"] = ["model.focus.inference_mode=hard", f"model.focus.top_k={k}"]
    copies = {"spans": args.spans, "span_tokens": args.span_tokens,
              "min_distance": args.min_distance}  # fmt: skip
    result: dict = {"run": str(run), "copies": copies, "samples": args.samples}
    samples = [held["sample"] for held in held_out_copies(run, args)]
    for name, overrides in settings.items():
        loaded = load_checkpoint_model(run, overrides, need_tokenizer=True)
        loaded.model.eval()
        if "original (dense)" not in result:  # the original: the Focus layers bypassed
            shape = (loaded.config.data.seq_length, args.spans, args.span_tokens)
            copied = copied_labels(*shape)
            text = ~copied_labels(*shape, with_first=True)  # no copy's first token either
            with dense_attention(loaded.model):
                result["original (dense)"] = losses(loaded.model, samples, copied, text)
            print(f"original (dense): {result['original (dense)']}", flush=True)
        result[name] = losses(loaded.model, samples, copied, text)
        print(f"{name}: {result[name]}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
