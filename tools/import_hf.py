"""Check a local HuggingFace checkpoint and print the recipe sections that retrofit it.

    python tools/import_hf.py checkpoints/gpt2
    python tools/import_hf.py checkpoints/gpt2 --groups 4 --window 128 > configs/my-retrofit.yaml

Reads config.json, maps every tensor through our key maps (shapes checked, no model built),
and prints YAML: the ``model`` section with the checkpoint's architecture and a Focus section,
``data.tokenizer`` (the checkpoint's ``tokenizer.json`` or ``tokenizer.model``; refused with the
fix when it ships neither) and ``train.init_from_hf``.
"""

from __future__ import annotations

import dataclasses
import sys

import yaml

from focus_pretrain.cli import tool_parser
from focus_pretrain.convert import check_tokenizer_matches, hf_model_config, import_hf
from focus_pretrain.convert.hf_import import ARCHITECTURE_FIELDS, checkpoint_tokenizer
from focus_pretrain.errors import as_input_error, exit_on_input_error


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("hf_dir", help="a local HuggingFace model directory")
    parser.add_argument("--groups", type=int, default=4, help="Focus groups K")
    parser.add_argument("--window", type=int, default=128, help="Focus local window")
    args = parser.parse_args()
    with exit_on_input_error("import_hf"):  # what the checkpoint lacks: one line, status 2
        config = as_input_error(lambda: hf_model_config(args.hf_dir))
        state = as_input_error(lambda: import_hf(args.hf_dir, config, tp_rank=0))
    params = sum(t.numel() for t in state.values())
    print(f"# {args.hf_dir}: {len(state)} tensors, {params:,} parameters", file=sys.stderr)
    model = {
        name: getattr(config, name)
        for name in ("family", *ARCHITECTURE_FIELDS[1:], "max_seq_length")
        if getattr(config, name) is not None
    }
    if config.rope_scaling is not None:  # a dataclass: plain YAML, unset fields left out
        scaling = dataclasses.asdict(config.rope_scaling)
        model["rope_scaling"] = {k: v for k, v in scaling.items() if v is not None}
    model["focus"] = {"num_groups": args.groups, "window": args.window}
    recipe = {"model": model, "train": {"init_from_hf": args.hf_dir, "freeze": "retrofit"}}
    tokenizer = checkpoint_tokenizer(args.hf_dir)
    if tokenizer is None:  # a retrofit needs the model's own tokenizer: say so now, not later
        with exit_on_input_error("import_hf"):
            as_input_error(lambda: check_tokenizer_matches(args.hf_dir, None))
    recipe["data"] = {"tokenizer": tokenizer}
    print(yaml.safe_dump(recipe, sort_keys=False), end="")


if __name__ == "__main__":
    main()
