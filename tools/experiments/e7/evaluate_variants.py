"""The routers a retrofit trained, evaluated with other inference settings (no training): the
hard pattern with and without attention sinks, top-2, a wider window. Writes
RETROFIT_OUT/variants.json ({variant: metrics}); skips what is there already.

    python tools/experiments/e7/evaluate_variants.py runs/retrofit-smollm2
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VARIANTS = {  # name -> evaluate overrides of the trained checkpoint
    "hard, sinks 0": ["model.focus.inference_mode=hard", "model.focus.sinks=0"],
    "hard, sinks 4": ["model.focus.inference_mode=hard", "model.focus.sinks=4"],
    "hard, sinks 4, top-2": [
        "model.focus.inference_mode=hard", "model.focus.sinks=4", "model.focus.top_k=2"
    ],
    "soft, sinks 4": ["model.focus.inference_mode=soft", "model.focus.sinks=4"],
}  # fmt: skip


def main() -> None:
    from focus_pretrain.train.evaluate import evaluate_checkpoint

    out = Path(sys.argv[1])
    target = out / "variants.json"
    done = json.loads(target.read_text()) if target.is_file() else {}
    for name, overrides in VARIANTS.items():
        if name in done:
            continue
        result = evaluate_checkpoint(out / "run", overrides, out / "eval" / f"{name}.json")
        done[name] = result["metrics"]
        print(f"{name}: loss {result['metrics']['loss']:.4f}", flush=True)
        target.write_text(json.dumps(done, indent=1))


if __name__ == "__main__":
    main()
