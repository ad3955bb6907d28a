"""Convert a training checkpoint to DeepSpeed's universal form, ahead of a resharded resume.

    python tools/reshard_checkpoint.py runs/x                             # what `latest` names
    python tools/reshard_checkpoint.py runs/x/checkpoints/step_00001000 --workers 16

The result goes to ``step_N/universal``; a run resuming ``run.output_dir`` at another parallel
layout (data-parallel size, tensor-parallel size, ZeRO stage 1-3) with
``--set train.load_universal=true`` loads it. The run converts by itself (rank 0, the other
ranks waiting) when this was not done: the tool is for a large checkpoint, converted on a CPU
node with many workers before the GPUs are allocated.
"""

from __future__ import annotations

from focus_pretrain.checkpoint.reshard import convert_to_universal
from focus_pretrain.cli import at_least, tool_parser
from focus_pretrain.convert import resolve_checkpoint
from focus_pretrain.errors import exit_on_input_error


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("checkpoint", help="a run directory or a checkpoints/step_N directory")
    parser.add_argument(
        "--workers",
        type=at_least(1),
        default=None,
        help="processes extracting ZeRO fragments (default: 1 under 1 GiB, else up to 8)",
    )
    args = parser.parse_args()
    with exit_on_input_error(parser.prog):  # a missing checkpoint: one line, status 2
        out = convert_to_universal(resolve_checkpoint(args.checkpoint), args.workers)
    print(f"universal checkpoint: {out}")


if __name__ == "__main__":
    main()
