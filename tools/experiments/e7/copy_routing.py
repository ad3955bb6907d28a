"""E7: how a retrofit's routers place the pairs a long-range copy needs. On held-out samples
ended with copies (as ``copy_loss.py`` makes them), a query inside a copy at ``b + j`` predicts
the source's next token by attending to ``a + j + 1`` (the induction target: the token after
the previous occurrence of the query's own token) rather than ``a + j`` (the same token as the
query). Per layer of the export (its routers on its own hidden states, as in inference), for
the copy queries: how often the hard top-1 pattern puts the query in a group with the
induction target, with the same-token key, and with a far key drawn at random (chance); and
the share of the original's attention to the induction targets that hard top-k keeps (the
routers run on the hidden states of top-k inference, as in inference).

    python tools/experiments/e7/copy_routing.py RETROFIT_DIR --original HF_DIR
        [--spans 4 --span-tokens 32 --min-distance 256 --samples 8 --top-k 1 2 --json OUT]

RETROFIT_DIR: a ``focus-pretrain retrofit --out`` directory (``run/`` for the held-out text,
``export/`` for the routers); HF_DIR: the original model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from copy_loss import copy_arguments, held_out_copies
from needle_attention import load_models, router_probs

from focus_pretrain.focus.pattern import groups_intersect, membership_bitmask, pair_rule


def measure(args: argparse.Namespace) -> dict:
    root = Path(args.retrofit)
    original, focus_model = load_models(args.original, root / "export", "copy_routing")
    focus = focus_model.config.focus
    layers = len(original.model.layers)
    same = {name: np.zeros(layers) for name in ("induction", "same token", "random far")}
    attention = {k: np.zeros((layers, 2)) for k in args.top_k}  # [layer, (mass, kept)]
    rng = np.random.default_rng(0)
    queries = 0
    for held in held_out_copies(root / "run", args):
        ids, layout = held["sample"]["tokens"][None], held["layout"]  # ids [1, s]
        with torch.no_grad():
            rows = original(ids, output_attentions=True).attentions  # [1, H, s, s] each
        probs = {}  # top-k -> [s, K] per layer: the routers on the hidden states of that top-k
        for top_k in sorted({1, *args.top_k}):
            focus["top_k"] = top_k
            probs[top_k] = router_probs(focus_model, ids)
        pairs = [(b + j, a + j + 1, a + j) for a, b in layout
                 for j in range(args.span_tokens - 1)]  # fmt: skip
        q, target, token = (torch.tensor(x) for x in zip(*pairs, strict=True))
        far = torch.tensor([int(rng.integers(0, int(p) - focus["window"])) for p in q])
        queries += len(pairs)
        for layer in range(layers):
            group = probs[1][layer].argmax(dim=-1)  # [s]: top-1 group, top-1 inference
            for name, key in (("induction", target), ("same token", token), ("random far", far)):
                same[name][layer] += float((group[q] == group[key]).sum())
            mass = rows[layer][0][:, q, target].float()  # [H, n]: to the induction targets
            for top_k in args.top_k:
                kept = kept_pairs(probs[top_k][layer], top_k, focus, q, target).float()  # [n]
                attention[top_k][layer] += [float(mass.sum()), float((mass * kept).sum())]
    return summary(args, same, attention, queries)


def kept_pairs(probs: torch.Tensor, top_k: int, focus: dict, q: torch.Tensor,
               k: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``[n]`` bool: does hard top-k keep the pairs ``(q[i], k[i])`` (the package's pair rule
    and group membership)?"""
    member = membership_bitmask(probs.topk(top_k, dim=-1).indices)  # [s] int64
    causal, near = pair_rule(q, k, window=focus["window"], sinks=focus["sinks"])
    return causal & (near | groups_intersect(member[q], member[k]))


def summary(args, same: dict, attention: dict, queries: int) -> dict:
    per_layer = [
        {**{f"same_group_{name.replace(' ', '_')}": float(v[layer] / queries)
            for name, v in same.items()},
         **{f"induction_attention_kept_top{k}": float(a[layer, 1] / max(a[layer, 0], 1e-12))
            for k, a in attention.items()},
         "induction_attention": float(attention[args.top_k[0]][layer, 0] / queries)}
        for layer in range(len(same["induction"]))
    ]  # fmt: skip
    overall = {f"same_group_{name.replace(' ', '_')}": float(v.sum() / (queries * len(v)))
               for name, v in same.items()}  # fmt: skip
    for k, a in attention.items():  # weighted by the original's attention to the targets
        overall[f"induction_attention_kept_top{k}"] = float(a[:, 1].sum() / a[:, 0].sum())
    return {"retrofit": args.retrofit, "queries": queries, "overall": overall,
            "per_layer": per_layer}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("retrofit")
    parser.add_argument("--original", required=True)
    copy_arguments(parser)
    args = parser.parse_args()
    result = measure(args)
    print(json.dumps(result["overall"], indent=1))
    top = sorted(range(len(result["per_layer"])),
                 key=lambda i: -result["per_layer"][i]["induction_attention"])[:6]  # fmt: skip
    for i in top:
        print(i, {k: round(v, 3) for k, v in result["per_layer"][i].items()})
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
