"""Export a training run (its latest checkpoint) or a checkpoint to a HuggingFace directory.

    python tools/convert_to_hf.py runs/tiny exports/tiny
    python tools/convert_to_hf.py runs/gpt2-retrofit exports/gpt2-routers --adapter-only

The full export loads with ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``
(offline too; trust_remote_code runs the shipped modeling_focus.py and its companions, whose
sha256 focus_export.json records); ``--adapter-only`` writes just the routers, attachable to
the original HF model with ``focus_pretrain.convert.attach_focus_adapter(model, OUT)``.

Nothing is lost: every input is checked before OUT is touched; the export is written next to
OUT and swapped in whole (a failed export leaves an earlier one intact); --force replaces only
an earlier export (its focus_export.json or focus_adapter.json) holding nothing else, and OUT
may never be, hold or lie inside the checkpoint, the run's checkpoints, a retrofit's original
weights or the tokenizer. The tokenizer shipped is the copy the checkpoint holds, else the
run's data.tokenizer or the one in its data.cache_dir (relative to the current directory); not
found is refused: --tokenizer names one, --no-tokenizer exports without.
"""

from __future__ import annotations

import argparse
import re

from focus_pretrain.cli import tool_parser
from focus_pretrain.errors import exit_on_input_error

_SHARD_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]B)\s*", re.IGNORECASE)


def shard_size(text: str) -> str:
    """An argument type: a safetensors shard size as transformers takes it (``2GB``,
    ``500MB``, ``1.5GB``; units KB, MB, GB, TB), above zero."""
    match = _SHARD_SIZE.fullmatch(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a shard size: give a positive number with a unit KB, MB, GB or "
            "TB, e.g. 2GB or 500MB"
        )
    return text.strip()


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("checkpoint", help="a run directory or a checkpoints/step_N directory")
    parser.add_argument("out_dir", help="where the HF directory goes")
    parser.add_argument("--adapter-only", action="store_true", help="export only the routers")
    parser.add_argument(
        "--max-shard-size", type=shard_size, default="2GB", help="safetensors shard size"
    )
    parser.add_argument("--force", action="store_true", help="replace an earlier export at OUT_DIR")
    parser.add_argument("--tokenizer", help="ship this tokenizer (.model or HF tokenizer dir)")
    parser.add_argument(
        "--no-tokenizer", action="store_true", help="export without tokenizer files"
    )
    args = parser.parse_args()
    if args.tokenizer and args.no_tokenizer:
        parser.error("give --tokenizer or --no-tokenizer, not both")
    from focus_pretrain.convert import export_hf, export_router_adapter  # heavy: after --help

    with exit_on_input_error(parser.prog):  # bad input: one line and status 2
        if args.adapter_only:
            out = export_router_adapter(args.checkpoint, args.out_dir, overwrite=args.force)
        else:
            out = export_hf(
                args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size,
                overwrite=args.force, tokenizer=args.tokenizer,
                with_tokenizer=not args.no_tokenizer,
            )  # fmt: skip
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
