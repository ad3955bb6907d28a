"""Export a training run (its latest checkpoint) or a checkpoint to a HuggingFace directory.

    python tools/convert_to_hf.py runs/tiny exports/tiny
    python tools/convert_to_hf.py runs/gpt2-retrofit exports/gpt2-routers --adapter-only

The full export loads with ``AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)``
(offline too); ``--adapter-only`` writes just the routers, attachable to the original HF model
with ``focus_pretrain.convert.attach_focus_adapter(model, OUT)``.
"""

from __future__ import annotations

from focus_pretrain.cli import tool_parser
from focus_pretrain.errors import exit_on_input_error


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("checkpoint", help="a run directory or a checkpoints/step_N directory")
    parser.add_argument("out_dir", help="where the HF directory goes")
    parser.add_argument("--adapter-only", action="store_true", help="export only the routers")
    parser.add_argument("--max-shard-size", default="2GB", help="safetensors shard size")
    parser.add_argument(
        "--force", action="store_true", help="replace OUT_DIR when it exists and is not empty"
    )
    args = parser.parse_args()
    from focus_pretrain.convert import export_hf, export_router_adapter  # heavy: after --help

    with exit_on_input_error("convert_to_hf"):  # bad input: one line and status 2
        if args.adapter_only:
            out = export_router_adapter(args.checkpoint, args.out_dir, overwrite=args.force)
        else:
            out = export_hf(
                args.checkpoint, args.out_dir, max_shard_size=args.max_shard_size,
                overwrite=args.force,
            )  # fmt: skip
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
