"""Check a local HuggingFace checkpoint and print the recipe sections that retrofit it.

    python tools/import_hf.py checkpoints/gpt2
    python tools/import_hf.py checkpoints/gpt2 --groups 4 --window 128 > configs/my-retrofit.yaml

Reads config.json, maps every tensor through our key maps (shapes checked, no model built),
and prints YAML: ``defaults: retrofit.yaml`` (the retrofit training knobs: the shipped recipe
of that name, unless one sits next to the recipe), the ``run`` name and directory, the
``model`` section with the checkpoint's architecture and a Focus section,
``data.tokenizer`` (the checkpoint's ``tokenizer.json`` or ``tokenizer.model``; refused with the
fix when it ships neither) and ``train.init_from_hf``. ``focus-pretrain retrofit`` does all of a
retrofit in one command (these sections on the shipped ``retrofit``, training, export, report).
"""

from __future__ import annotations

import sys

import yaml

from focus_pretrain.cli import (
    KEY_GROUPS_CHOICES,
    KEY_GROUPS_HELP,
    SINKS_HELP,
    at_least,
    tool_parser,
)
from focus_pretrain.errors import as_input_error, exit_on_input_error

BASE = "retrofit.yaml"  # the training knobs: next to the recipe, else the shipped recipe


def main() -> None:
    parser = tool_parser(__doc__)
    parser.add_argument("hf_dir", help="a local HuggingFace model directory")
    parser.add_argument("--groups", type=at_least(1), default=4, help="Focus groups K")
    parser.add_argument("--window", type=at_least(0), default=128, help="Focus local window")
    parser.add_argument("--sinks", type=at_least(0), help=SINKS_HELP)
    parser.add_argument("--key-groups", choices=KEY_GROUPS_CHOICES, help=KEY_GROUPS_HELP)
    args = parser.parse_args()
    from focus_pretrain.convert.retrofit import retrofit_sections  # heavy: after --help
    from focus_pretrain.focus.config import FocusConfig

    with exit_on_input_error(parser.prog):  # what the checkpoint lacks: one line, status 2
        FocusConfig(num_groups=args.groups, window=args.window)  # its rules (at most 64 groups)
        recipe, summary = as_input_error(
            lambda: retrofit_sections(
                args.hf_dir,
                groups=args.groups,
                window=args.window,
                sinks=args.sinks,
                key_groups=args.key_groups,
            )
        )
    print(
        f"# {args.hf_dir}: {summary['tensors']} tensors, {summary['parameters']:,} parameters",
        file=sys.stderr,
    )
    print("# set data.sources to your corpus (local files or directories, a hub dataset)")
    print(yaml.safe_dump({"defaults": BASE, **recipe}, sort_keys=False), end="")


if __name__ == "__main__":
    main()
