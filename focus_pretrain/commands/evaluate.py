"""Evaluate a checkpoint: validation loss, loss by distance, retrieval probes, recall, and
the hard pattern's kept-pair fraction; prints a table and JSON (``--out`` writes it).

    python tools/evaluate.py --checkpoint runs/tiny
    python tools/evaluate.py --checkpoint runs/tiny --set model.focus.top_k=2
    python tools/evaluate.py --checkpoint runs/tiny --set 'probes.lengths=[512]' --out e.json
    python tools/evaluate.py --checkpoint runs/a --set 'data.sources=["other/shards"]'
    python tools/evaluate.py --checkpoint runs/a --set 'data.sources=["other.jsonl"]' \\
        --set data.tokenize_in_job=true                 (a small raw corpus, tokenised here)
    torchrun --nproc-per-node 2 tools/evaluate.py --checkpoint runs/long \\
        --set parallel.context_parallel_size=2          (context parallel: long probes)

``--set`` overrides the checkpoint's config (``data.sources`` evaluates another corpus with
the checkpoint's tokenizer; ``model.focus.*`` changes the inference pattern).
"""

from __future__ import annotations

import json
import math

from focus_pretrain.cli import output_file, tool_parser
from focus_pretrain.errors import exit_on_input_error


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("--checkpoint", required=True, help="a run or checkpoint directory")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE"
    )
    parser.add_argument("--out", type=output_file, help="write the result as JSON to this file")
    args = parser.parse_args()
    # heavy imports after the arguments: --help answers without loading PyTorch
    from focus_pretrain.parallel.launch import shutdown_distributed
    from focus_pretrain.train.evaluate import evaluate_checkpoint

    try:
        with exit_on_input_error(parser.prog):  # a bad override or checkpoint: one line, status 2
            result = evaluate_checkpoint(args.checkpoint, args.overrides, args.out)
        _report(result)
    finally:
        shutdown_distributed()


def _report(result: dict) -> None:
    """The metrics as a table and as JSON, from rank 0."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"checkpoint {result['checkpoint']}")
    for key, value in result["metrics"].items():
        shown = "-" if value is None or (isinstance(value, float) and math.isnan(value)) else value
        print(f"  {key:<34} {shown if isinstance(shown, str) else f'{shown:.4f}'}")
    by_position = {k: v for k, v in (result.get("loss_by_position") or {}).items() if v is not None}
    if by_position:
        print("  loss by position: " + ", ".join(f"{k} {v:.4f}" for k, v in by_position.items()))
    summary = {k: result[k] for k in ("checkpoint", "metrics", "loss_by_position")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
