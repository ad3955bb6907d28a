"""The ``focus-pretrain`` command: one entry point for every job, as subcommands.

    focus-pretrain train --config configs/tiny.yaml            # launchers/pretrain.py
    focus-pretrain export runs/tiny exports/tiny               # tools/convert_to_hf.py
    focus-pretrain COMMAND --help                              # the command's options

Each subcommand runs the script it names (the launchers and ``tools/*.py`` keep working on their
own) with ``focus-pretrain COMMAND`` as its program name, so its usage, errors and exit codes
are the script's. The scripts live in the source checkout next to the package: ``make setup``
installs it editable (``pip install -e .``), which is what the command needs.

This module imports nothing heavy: ``focus-pretrain --help`` answers without loading PyTorch.
:class:`HelpFormatter` is the scripts' help format: their whole docstring, and every option with
its default.
"""

from __future__ import annotations

import argparse
import copy
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the source checkout (an editable install's root)
DESCRIPTION = "Pretrain and retrofit long-context language models with Focus attention."
_program: str | None = None  # "focus-pretrain COMMAND" while a subcommand's script runs


@dataclass(frozen=True)
class Command:
    """A subcommand: the script it runs (relative to :data:`ROOT`) and one line of help."""

    script: str
    summary: str


COMMANDS = {
    "train": Command("launchers/pretrain.py", "train a recipe: pretraining, retrofits, resume"),
    "retrofit": Command(
        "tools/retrofit.py", "retrofit a HuggingFace model in one command: train, export, report"
    ),
    "import-hf": Command(
        "tools/import_hf.py", "check a local HuggingFace model and print its retrofit recipe"
    ),
    "export": Command(
        "tools/convert_to_hf.py", "export a run or checkpoint to HuggingFace (or the adapter)"
    ),
    "evaluate": Command("tools/evaluate.py", "validation loss and loss by distance of a run"),
    "generate": Command("tools/generate.py", "generate text with an export"),
    "ruler": Command("tools/ruler.py", "RULER needle-in-a-haystack scores of an export (lm-eval)"),
    "inspect": Command("tools/inspect_groups.py", "group balance and sizes of a checkpoint"),
    "preprocess": Command(
        "tools/preprocess_data.py", "tokenise a corpus into shards (and train a tokenizer)"
    ),
    "bench": Command("tools/bench_attention.py", "time the attention backends against dense"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps a description's line breaks (a script's whole docstring) and shows every option's
    default, also of options without a help text."""

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and action.option_strings and self._has_default(action):
            action = copy.copy(action)  # an option without help text still shows its default
            action.help = "default: %(default)s"
        return super()._format_action(action)

    @staticmethod
    def _has_default(action: argparse.Action) -> bool:
        return not any(action.default is v for v in (None, False, argparse.SUPPRESS))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shows_default = self._has_default(action) and (
            action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        )
        if shows_default and "default" not in text:
            text = f"{text} (default: %(default)s)".strip()
        return text


def tool_parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The argument parser of a script whose docstring is ``doc``: the whole docstring as its
    description, defaults shown (:class:`HelpFormatter`)."""
    if _program is not None:  # runpy sets argv[0] to the script's path: name the command
        kwargs.setdefault("prog", _program)
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter, **kwargs)


def _overview() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def _top_parser() -> argparse.ArgumentParser:
    from focus_pretrain import __version__

    parser = argparse.ArgumentParser(
        prog="focus-pretrain",
        description=DESCRIPTION,
        epilog=_overview() + "\n\n`focus-pretrain COMMAND --help` lists a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="focus-pretrain [-h] [--version] COMMAND [ARGS ...]",
    )
    parser.add_argument("--version", action="version", version=f"focus-pretrain {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``focus-pretrain`` with ``argv`` (default: the process's arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _top_parser()
    if not argv or argv[0] in ("-h", "--help", "--version"):
        parser.parse_args(argv or ["--help"])  # exits
    if argv[0].startswith("-"):
        parser.error(f"unknown option {argv[0]!r}; give a command first")
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        parser.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    script = ROOT / command.script
    if not script.is_file():
        parser.error(
            f"{script} is missing: `focus-pretrain {name}` runs the scripts of the source "
            "checkout; install it editable (make setup, or pip install -e .)"
        )
    global _program
    _program = f"focus-pretrain {name}"
    sys.argv = [_program, *rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
