"""The ``focus-pretrain`` command: one entry point for every job, as subcommands.

    focus-pretrain train --config tiny                         # a shipped recipe, by name
    focus-pretrain export runs/tiny exports/tiny
    focus-pretrain recipes                                     # the shipped recipes
    focus-pretrain COMMAND --help                              # the command's options

Each subcommand is a module of :mod:`focus_pretrain.commands` whose ``main()`` runs with
``focus-pretrain COMMAND`` as its program name (``launchers/pretrain.py`` and the ``tools/``
scripts of a source checkout are thin wrappers around the same ``main``), so it works from a
wheel as well as from an editable install. Bad input ends every command with one line,
``focus-pretrain COMMAND: error: MESSAGE``, and status 2: argparse's own errors
(:class:`ToolParser`) and the commands' :class:`~focus_pretrain.errors.InputError` alike; a
crash keeps its traceback.

This module imports nothing heavy: ``focus-pretrain --help`` answers without loading PyTorch.
:class:`HelpFormatter` is the scripts' help format: their whole docstring, and every option with
its default; :func:`at_least`, :func:`number_in`, :func:`device` and :func:`output_file` are
argument types that refuse a bad count, number, device or output path while the arguments are
parsed.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import math
import sys
from dataclasses import dataclass
from pathlib import Path

DESCRIPTION = "Pretrain and retrofit long-context language models with Focus attention."
_program: str | None = None  # "focus-pretrain COMMAND" while a subcommand's script runs


@dataclass(frozen=True)
class Command:
    """A subcommand: its module in :mod:`focus_pretrain.commands` and one line of help."""

    module: str
    summary: str


COMMANDS = {
    "train": Command("pretrain", "train a recipe: pretraining, retrofits, resume"),
    "retrofit": Command(
        "retrofit", "retrofit a HuggingFace model in one command: train, export, report"
    ),
    "import-hf": Command(
        "import_hf", "check a local HuggingFace model and print its retrofit recipe"
    ),
    "export": Command(
        "convert_to_hf", "export a run or checkpoint to HuggingFace (or the adapter)"
    ),
    "evaluate": Command("evaluate", "validation loss and loss by distance of a run"),
    "generate": Command("generate", "generate text with an export"),
    "ruler": Command("ruler", "RULER needle-in-a-haystack scores of an export (lm-eval)"),
    "inspect": Command("inspect_groups", "group balance and sizes of a checkpoint"),
    "preprocess": Command(
        "preprocess_data", "tokenise a corpus into shards (and train a tokenizer)"
    ),
    "bench": Command("bench_attention", "time the attention backends against dense"),
    "recipes": Command("recipes", "list the shipped recipes (--config NAME takes one)"),
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


class ToolParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE (see PROG
    --help)``, and status 2 (argparse prints its whole usage first); ``--help`` is unchanged."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def tool_parser(doc: str | None, **kwargs) -> argparse.ArgumentParser:
    """The argument parser of a script whose docstring is ``doc``: the whole docstring as its
    description, defaults shown (:class:`HelpFormatter`), one-line errors (:class:`ToolParser`)."""
    if _program is not None:  # run as `focus-pretrain COMMAND`: name the command
        kwargs.setdefault("prog", _program)
    return ToolParser(description=doc, formatter_class=HelpFormatter, **kwargs)


# import-hf's and retrofit's --key-groups (default: convert.retrofit.RETROFIT_KEY_GROUPS); the
# choices are focus.pattern_settings.KEY_GROUPS, spelled out so that --help loads no torch
KEY_GROUPS_CHOICES = ("own", "own_and_previous")
KEY_GROUPS_HELP = (
    "the groups a key counts in beyond the window: own_and_previous (default: its own and the "
    "token's before it, which E7 measured to keep more of a pretrained model's quality; the "
    "reference and flex backends compute it) or own (the method's symmetric rule; every backend)"
)
# import-hf's and retrofit's --sinks (default: focus_pretrain.convert.retrofit.RETROFIT_SINKS)
SINKS_HELP = (
    "attention sinks: the first N tokens stay visible to every query (default 4: a pretrained "
    "model's hard pattern needs them, docs/experiments.md E7)"
)


def at_least(low: int):
    """An argument type: an integer ``>= low`` (e.g. ``type=at_least(1)`` for a count)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"  # argparse names the type in some messages
    return parse


def number_in(low: float, high: float = math.inf, *, low_open: bool = False):
    """An argument type: a finite number in ``[low, high]`` (``(low, high]`` with
    ``low_open``), e.g. ``number_in(0, 1, low_open=True)`` for a probability mass."""
    if high == math.inf:
        interval = f"> {low:g}" if low_open else f">= {low:g}"
    else:
        interval = f"in {'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        inside = (low < value if low_open else low <= value) and value <= high
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"must be a number {interval}, got {text}")
        return value

    parse.__name__ = f"number {interval}"
    return parse


def device(text: str) -> str:
    """An argument type: a PyTorch device this machine has (``cpu``, ``cuda``, ``cuda:1``...);
    imports PyTorch when the arguments are parsed (never for ``--help``)."""
    import torch  # heavy: only once a command is going to run

    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda, cuda:N)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text}: no CUDA device here; use cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            count = torch.cuda.device_count()
            raise argparse.ArgumentTypeError(f"{text}: this machine has {count} CUDA device(s)")
    return text


def output_file(text: str) -> str:
    """An argument type: a file the command will write (its missing parent directories are
    created then); refused when it is a directory or below a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: give a file name")
    blocked = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise argparse.ArgumentTypeError(
            f"{text} cannot be written: {blocked} is a file, not a directory"
        )
    return text


def _overview() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name:<{width}}  {command.summary}" for name, command in COMMANDS.items()]
    return "commands:\n" + "\n".join(lines)


def _top_parser() -> argparse.ArgumentParser:
    from focus_pretrain import __version__

    parser = ToolParser(
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
        close = difflib.get_close_matches(name.lower(), COMMANDS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        parser.error(f"unknown command {name!r}; {hint}choose from {', '.join(COMMANDS)}")
    global _program
    _program = f"focus-pretrain {name}"
    sys.argv = [_program, *rest]
    importlib.import_module(f"focus_pretrain.commands.{command.module}").main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
