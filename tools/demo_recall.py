"""Focus vs its window-only twin on the demo corpus's long-range recalls.

Trains the same recipe twice from the same seed, once with Focus and once with
``model.focus.window_only=true`` (every layer attends only inside the window, no router, all
other weights identical at init), and scores both on held-out demo documents: loss and argmax
accuracy on the recall lines' query tokens (the recalled key and value, which only a model that
reaches beyond the window can predict), each part alone, and the loss on all other tokens.
Prints a table and JSON.

    python tools/demo_recall.py --config configs/tiny.yaml
    python tools/demo_recall.py --config configs/tiny.yaml --set train.steps=100
"""

from __future__ import annotations

import json
import math

from focus_pretrain.cli import tool_parser
from focus_pretrain.config import load_config
from focus_pretrain.experiments import compare_with_window_twin


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--config", default="configs/tiny.yaml", help="a demo-corpus recipe")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    args = parser.parse_args()
    config = load_config(args.config, args.overrides)
    results = compare_with_window_twin(config)
    columns = ("recall_loss", "recall_acc", "key_loss", "value_loss", "other_loss")
    rows = [("model", *columns, "query tokens")]
    for name, scores in results.items():
        cells = [f"{scores[c]:.1%}" if c.endswith("acc") else f"{scores[c]:.3f}" for c in columns]
        rows.append((name, *cells, str(scores["recall_tokens"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    chance = math.log(config.data.demo_values)
    print(f"(a value guessed from the prior: {chance:.3f} nats)")
    print(json.dumps({"steps": config.train.steps, **results}))


if __name__ == "__main__":
    main()
