"""Why a retrofit misses RULER's needles: where the original model's attention goes from the
query that writes the answer, and which of those keys the export's hard pattern keeps.

For the first ``--samples`` samples of RULER's ``niah_single_1`` (lm-evaluation-harness's
generator with lm-eval's seeds: the samples ``focus-pretrain ruler`` scores), the prompt is the
sample's input and answer prefix; its last token is the query whose output gives the answer's
first token. Per layer and head: the original's attention from that query to the needle's value
tokens (``--original``: the plain HF model, eager attention), and whether the export's hard
pattern at each ``--top-k`` keeps those keys (the window, the sinks, or a shared group; the
routers run on the Focus model's own hidden states, as in inference). Reported per top-k: the
share of the original's needle attention the pattern keeps (weighted by that attention, over
layers, heads and samples), the same share for all keys beyond the window (what the pattern
keeps of the query's far attention in general), and the share of beyond-window keys kept
(unweighted: the density); per layer, the needle attention and its kept share.

    python tools/experiments/e7/needle_attention.py --original MODELS/hf/smollm2-135m-instruct \\
        --export RUN/export --length 1024 --samples 20 --top-k 1 2 --json needle.json
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from focus_pretrain.focus.pattern import groups_intersect, membership_bitmask, pair_rule


def ruler_samples(export: Path, length: int, count: int) -> list[dict]:
    """The first ``count`` ``niah_single_1`` samples at ``length``, generated as
    ``lm_eval.simple_evaluate`` does (its default seeds, the export's tokenizer), offline."""
    import numpy as np

    from focus_pretrain.eval.ruler import _no_downloads, _offline_hub

    with _offline_hub(), _no_downloads():
        from lm_eval.tasks.ruler.niah_utils import niah_single_1

        random.seed(0), np.random.seed(1234), torch.manual_seed(1234)  # simple_evaluate's
        data = niah_single_1(max_seq_lengths=[length], tokenizer=str(export))["test"]
    return [data[i] for i in range(count)]


def needle_tokens(tokenizer, text: str, value: str) -> tuple[list[int], list[int]]:
    """``(token ids of text, indices of the tokens that spell the needle's value)``."""
    start = text.index(value)
    encoded = tokenizer(text, return_offsets_mapping=True)
    spans = encoded["offset_mapping"]
    needle = [i for i, (a, b) in enumerate(spans) if a < start + len(value) and b > start]
    return encoded["input_ids"], needle


def router_probs(model, ids: torch.Tensor) -> list[torch.Tensor | None]:
    """Each layer's router output ``[s, K]`` on ``ids`` (``None``: a layer without one)."""
    layers = [layer.self_attn for layer in model.model.layers]
    probs: list[torch.Tensor | None] = [None] * len(layers)
    hooks = []
    for index, attention in enumerate(layers):
        router = getattr(attention, "router", None)
        if router is not None:
            keep = lambda module, inputs, out, i=index: probs.__setitem__(i, out[0])  # noqa: E731
            hooks.append(router.register_forward_hook(keep))
    with torch.no_grad():
        model(ids)
    for hook in hooks:
        hook.remove()
    return probs


KEY_GROUPS = ("own", "predecessor", "both")
EXPORT_KEY_GROUPS = {"own": "own", "own_and_previous": "both"}  # an export's rule, here


def kept_keys(
    probs: torch.Tensor | None, top_k: int, focus: dict, length: int, key_groups: str = "own"
) -> torch.Tensor:
    """``[length]`` bool: the keys the last query attends under the hard pattern (the
    package's pair rule and group membership; a layer without a router keeps its window and
    sinks). ``key_groups`` (a what-if, not the method): a key is in its ``own`` groups (the
    spec), its ``predecessor``'s (the token before it; the first token its own), or ``both``;
    the query is always in its own."""
    positions = torch.arange(length)
    causal, near = pair_rule(positions[-1], positions, window=focus["window"], sinks=focus["sinks"])
    if probs is None:
        return causal & near
    member = membership_bitmask(probs.topk(top_k, dim=-1).indices)  # [s] int64
    previous = torch.cat([member[:1], member[:-1]])  # [s]: each token's predecessor's groups
    keys = {"own": member, "predecessor": previous, "both": member | previous}[key_groups]
    return causal & (near | groups_intersect(keys, member[-1]))


def load_models(original: Path, export: Path, tool: str):
    """The original (eager attention: its attention weights) and the export, every layer of
    which must have a router; the export infers any top-k (an export may name a top-1-only
    kernel)."""
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(original, attn_implementation="eager")
    focus_model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True)
    focus_model.config.focus["inference_backend"] = "auto"
    if any(getattr(layer.self_attn, "router", None) is None for layer in focus_model.model.layers):
        raise SystemExit(
            f"{tool}: {export} has layers without a router (a family's own sliding-window "
            "layers, or a window-only or dense export): this analysis covers exports whose "
            "every layer is routed"
        )
    return dense, focus_model


def measure(args: argparse.Namespace) -> dict:
    from focus_pretrain.convert.export_dir import export_tokenizer

    tokenizer = export_tokenizer(args.export)
    original, focus_model = load_models(args.original, args.export, "needle_attention")
    focus = focus_model.config.focus
    if args.key_groups is None:  # the export's own rule
        args.key_groups = EXPORT_KEY_GROUPS[focus.get("key_groups", "own")]
    totals = {k: {"needle": 0.0, "needle_kept": 0.0, "far": 0.0, "far_kept": 0.0,
                  "far_keys": 0, "far_keys_kept": 0} for k in args.top_k}  # fmt: skip
    layers = len(original.model.layers)
    per_layer = {k: [[0.0, 0.0] for _ in range(layers)] for k in args.top_k}
    for sample in ruler_samples(args.export, args.length, args.samples):
        text = f"{sample['input']} {sample['gen_prefix']}"
        ids, needle = needle_tokens(tokenizer, text, sample["outputs"][0])
        ids = torch.tensor([ids])  # [1, s]
        with torch.no_grad():
            attentions = original(ids, output_attentions=True).attentions  # [1, H, s, s] each
        rows = [a[0, :, -1].float() for a in attentions]  # [H, s]: the last query's attention
        far = torch.arange(ids.shape[1]) < ids.shape[1] - 1 - focus["window"]  # [s]
        far[: focus["sinks"]] = False
        for top_k in args.top_k:
            focus_model.config.focus["top_k"] = top_k
            for layer, probs in enumerate(router_probs(focus_model, ids)):
                kept = kept_keys(probs, top_k, focus, ids.shape[1], args.key_groups).float()
                row, total = rows[layer], totals[top_k]
                needle_mass = row[:, needle].sum().item()  # summed over heads
                needle_kept = (row[:, needle] * kept[needle]).sum().item()
                total["needle"] += needle_mass
                total["needle_kept"] += needle_kept
                total["far"] += row[:, far].sum().item()
                total["far_kept"] += (row[:, far] * kept[far]).sum().item()
                total["far_keys"] += int(far.sum())
                total["far_keys_kept"] += int((kept.bool() & far).sum())
                per_layer[top_k][layer][0] += needle_mass / row.shape[0] / args.samples
                per_layer[top_k][layer][1] += needle_kept / row.shape[0] / args.samples
    return summary(args, totals, per_layer)


def summary(args: argparse.Namespace, totals: dict, per_layer: dict) -> dict:
    result = {"export": str(args.export), "length": args.length, "samples": args.samples,
              "key_groups": args.key_groups}  # fmt: skip
    for top_k, total in totals.items():
        result[f"top-{top_k}"] = {
            "needle_attention_kept": total["needle_kept"] / total["needle"],
            "far_attention_kept": total["far_kept"] / total["far"],
            "far_keys_kept": total["far_keys_kept"] / total["far_keys"],
            "per_layer": [
                {"needle_attention": m, "needle_attention_kept": k} for m, k in per_layer[top_k]
            ],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", type=Path, required=True, help="the plain HF model")
    parser.add_argument("--export", type=Path, required=True, help="its retrofit's export")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--top-k", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--key-groups", choices=KEY_GROUPS, default=None,
        help="what-if: the groups a key is in (own: the method; predecessor: the token "
        "before it's; both); default: the export's own (focus.key_groups own_and_previous "
        "is both)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = measure(args)
    print("| top-k | needle attention kept | far attention kept | far keys kept |")
    print("|---|---:|---:|---:|")
    for top_k in args.top_k:
        row = result[f"top-{top_k}"]
        print(f"| {top_k} | {row['needle_attention_kept']:.1%} | {row['far_attention_kept']:.1%} "
              f"| {row['far_keys_kept']:.1%} |")  # fmt: skip
    print("layer, needle attention (mean over heads), kept at each top-k:")
    for layer in range(len(result[f"top-{args.top_k[0]}"]["per_layer"])):
        cells = [result[f"top-{k}"]["per_layer"][layer] for k in args.top_k]
        kept = " ".join(f"{c['needle_attention_kept']:.3f}" for c in cells)
        print(f"{layer:3d} {cells[0]['needle_attention']:.3f} {kept}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
