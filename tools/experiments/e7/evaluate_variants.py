"""The routers a retrofit trained, evaluated with other inference settings (no training): the
hard pattern with and without attention sinks, top-2, the soft pattern, and the random-routing
control at equal density ("shuffled": each router's output permuted along the sequence, each
sample and layer its own permutation, so every group keeps its trained size in every sample but
no token keeps its own group). Writes RETROFIT_OUT/variants.json ({variant: metrics}); skips
what is there already; names after the directory run those variants only (the top-3 ones,
for K >= 3 routers, the window-256 ones and the key rules, "keys own" / "keys own and
previous", run only when named).

    python tools/experiments/e7/evaluate_variants.py runs/retrofit-smollm2
    python tools/experiments/e7/evaluate_variants.py runs/retrofit-smollm2 "hard, sinks 4, top-2"
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from pathlib import Path

VARIANTS = {  # name -> evaluate overrides of the trained checkpoint
    "hard, sinks 0": ["model.focus.inference_mode=hard", "model.focus.sinks=0"],
    "hard, sinks 4": ["model.focus.inference_mode=hard", "model.focus.sinks=4"],
    "hard, sinks 4, top-2": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=2"
    ],
    "soft, sinks 4": ["model.focus.inference_mode=soft", "model.focus.sinks=4"],
    "hard, sinks 4, shuffled routing": ["model.focus.inference_mode=hard", "model.focus.sinks=4"],
    "hard, sinks 4, top-2, shuffled routing": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=2"
    ],
    "hard, sinks 4, shuffled routing, seed 2": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4"
    ],
    "hard, sinks 4, shuffled routing, seed 3": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4"
    ],
    "hard, sinks 4, top-3": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=3"
    ],
    "hard, sinks 4, top-3, shuffled routing": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=3"
    ],
    # a wider window at inference (the routers unchanged): "beyond the window" and "far
    # evidence" then mean beyond 256 tokens, so these compare with the dense model's loss on
    # those positions ("original (dense), window 256"; summarize.py pairs them by the name)
    "original (dense), window 256": ["model.focus.enabled=false", "model.focus.window=256"],
    "hard, sinks 4, window 256": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.window=256"
    ],
    "hard, sinks 4, top-2, window 256": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=2",
        "model.focus.window=256",
    ],
    # which groups a key counts as in (model.focus.key_groups), whatever the routers were
    # trained with: the symmetric rule of the method, or a key also in its predecessor's groups
    "hard, sinks 4, keys own": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.key_groups=own"
    ],
    "hard, sinks 4, top-2, keys own": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=2",
        "model.focus.key_groups=own",
    ],
    "hard, sinks 4, keys own and previous": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4",
        "model.focus.key_groups=own_and_previous",
    ],
    "hard, sinks 4, top-2, keys own and previous": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=2",
        "model.focus.key_groups=own_and_previous",
    ],
}  # fmt: skip
WIDE = {name for name in VARIANTS if name.endswith("window 256")}
KEY_RULES = {name for name in VARIANTS if ", keys " in name}
ON_REQUEST = {"hard, sinks 4, top-3", "hard, sinks 4, top-3, shuffled routing", *WIDE, *KEY_RULES}
SHUFFLE_SEED = 1234  # + N - 1 for a variant named "..., seed N"


@contextlib.contextmanager
def shuffled_routing(seed: int):
    """While entered, every ``FocusRouter``'s routing ``[b, s, K]`` is permuted along ``s``
    (a global forward hook, so it runs before the density meter's own hook and the attention
    reads the same routing)."""
    import torch

    from focus_pretrain.focus import FocusRouter, Routing

    generator = torch.Generator().manual_seed(seed)

    def permute(module, args, routing):
        if not isinstance(module, FocusRouter):
            return None
        probs = routing.probs  # [b, s, K]
        b, s, k = probs.shape
        order = torch.stack([torch.randperm(s, generator=generator) for _ in range(b)])  # [b, s]
        order = order.to(probs.device)[..., None].expand(b, s, k)  # [b, s, K]
        return Routing(probs.gather(1, order))

    handle = torch.nn.modules.module.register_module_forward_hook(permute)
    try:
        yield
    finally:
        handle.remove()


def main() -> None:
    from focus_pretrain.train.evaluate import evaluate_checkpoint

    out, only = Path(sys.argv[1]), sys.argv[2:]  # only: the names of the variants to run
    unknown = sorted(set(only) - set(VARIANTS))
    if unknown:
        sys.exit(f"evaluate_variants.py: unknown variants {unknown}; choose from {list(VARIANTS)}")
    target = out / "variants.json"
    done = json.loads(target.read_text()) if target.is_file() else {}
    wanted = only or [name for name in VARIANTS if name not in ON_REQUEST]
    for name, overrides in VARIANTS.items():
        if name in done or name not in wanted:
            continue
        numbered = re.search(r", seed (\d+)$", name)
        seed = SHUFFLE_SEED + (int(numbered[1]) - 1 if numbered else 0)
        shuffle = shuffled_routing(seed) if "shuffled" in name else contextlib.nullcontext()
        with shuffle:
            result = evaluate_checkpoint(out / "run", overrides, out / "eval" / f"{name}.json")
        done[name] = result["metrics"]
        print(f"{name}: loss {result['metrics']['loss']:.4f}", flush=True)
        target.write_text(json.dumps(done, indent=1))


if __name__ == "__main__":
    main()
