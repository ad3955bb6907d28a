"""The ``focus-pretrain`` command: its help answers without loading PyTorch and without
warnings, each subcommand runs its script under the command's name with the script's full
help (every option's default), and bad commands are refused with the choices."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from focus_pretrain import cli

CLEAN = "import sys; from focus_pretrain import cli; cli.main(sys.argv[1:])"
ROOT = Path(__file__).parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    """``focus-pretrain ARGS`` in a fresh interpreter (the entry point's function)."""
    return subprocess.run(
        [sys.executable, "-c", CLEAN, *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_every_command_without_loading_torch():
    done = _run("--help")
    assert done.returncode == 0 and done.stderr == ""
    for name, command in cli.COMMANDS.items():
        assert f"  {name}" in done.stdout and command.summary in done.stdout
        assert importlib.util.find_spec(f"focus_pretrain.commands.{command.module}"), name
    probe = "import sys; from focus_pretrain import cli\ntry:\n    cli.main(['--help'])\n"
    probe += "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert loaded.stdout.strip().endswith("False")  # no heavy import behind --help


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_subcommands_help_answers_without_loading_torch_or_warnings(name):
    """``focus-pretrain COMMAND --help``: the scripts import their heavy modules after parsing."""
    probe = (
        f"import sys; from focus_pretrain import cli\ntry:\n    cli.main([{name!r}, '--help'])\n"
    )
    probe += "except SystemExit as done:\n    assert done.code in (0, None), done.code\n"
    probe += "print('torch' in sys.modules, file=sys.stderr)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: focus-pretrain {name}")
    assert done.stderr == "False\n"  # no warning, and PyTorch never loaded


def test_a_subcommand_runs_its_script_with_the_full_help():
    done = _run("export", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: focus-pretrain export")
    assert "--adapter-only" in done.stdout and "(default: 2GB)" in done.stdout
    assert "attach_focus_adapter" in done.stdout  # the docstring, not its first line only
    assert "Warning" not in done.stderr and "WARNING" not in done.stderr


def test_a_subcommand_keeps_its_scripts_errors_and_exit_code(tmp_path):
    done = _run("import-hf", str(tmp_path / "missing"))
    assert done.returncode == 2
    assert "config.json does not exist" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["nope"], "unknown command 'nope'; choose from train, retrofit, import-hf"),
    (["--nope"], "unknown option '--nope'; give a command first"),
])  # fmt: skip
def test_bad_commands_are_refused_with_the_choices(args, message):
    done = _run(*args)
    assert done.returncode == 2 and message in done.stderr


def test_the_console_script_is_installed():
    """``make setup`` installs the package editable with its ``[project.scripts]``."""
    script = Path(sys.executable).parent / "focus-pretrain"
    if not script.is_file():
        if os.environ.get("CI"):  # make setup installs it: its absence is a broken set-up
            pytest.fail(f"{script} is not installed; make setup installs the console script")
        pytest.skip(f"{script} not installed: a set-up other than make setup (pip install -e .)")
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("focus-pretrain ")


def test_no_scripts_help_loses_a_line_break():
    """A backslash ending a line of a (non-raw) docstring joins the next line to it: the help's
    multi-line command examples would print as one line. Every script writes ``\\\\``."""
    import re

    scripts = [*sorted((ROOT / "tools").glob("*.py")), ROOT / "launchers" / "pretrain.py"]
    scripts += sorted((ROOT / "focus_pretrain" / "commands").glob("*.py"))
    for script in scripts:
        source = script.read_text()
        doc = source[3 : source.index('"""', 3)] if source.startswith('"""') else ""
        assert not re.search(r"(?<!\\)\\\n", doc), f"{script.name}: a line ends in one backslash"


def test_generate_counts_a_rows_tokens_up_to_its_end_of_sequence():
    """``generate`` pads a row that ended (EOS) to the batch's length: the padding is not
    generated text (one or several EOS ids, or none)."""
    import torch

    from focus_pretrain.commands.generate import generated_tokens

    new = torch.tensor([[5, 2, 2, 2], [7, 8, 9, 4], [2, 2, 2, 2]])  # [b, n]; eos 2
    assert generated_tokens(new, 2) == 2 + 4 + 1
    assert generated_tokens(new, [4, 2]) == 2 + 4 + 1
    assert generated_tokens(new, [9]) == 4 + 3 + 4
    assert generated_tokens(new, None) == 12


def test_the_recipe_list_tells_whole_recipes_from_bases(tmp_path, capsys):
    """``focus-pretrain recipes``: each recipe's first sentence (cut at a word), and the bases
    that ``--config`` cannot run alone (focus-defaults, retrofit) apart."""
    from focus_pretrain.commands import recipes

    text = "# First sentence: it goes on. Second one.\n# more\nrun: {}\n"
    (tmp_path / "r.yaml").write_text(text)
    assert recipes.summary(tmp_path / "r.yaml") == "First sentence: it goes on"
    (tmp_path / "long.yaml").write_text("# " + "word " * 40 + "\n")
    cut = recipes.summary(tmp_path / "long.yaml", width=30)
    assert cut.endswith("...") and len(cut) <= 30 and "wor..." not in cut
    import sys

    argv, sys.argv = sys.argv, ["focus-pretrain recipes"]
    try:
        recipes.main()
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    whole, bases = out.split("bases and fragments")
    assert "  tiny " in whole and "  7b " in whole and "focus-defaults" not in whole
    assert "  focus-defaults " in bases and "  retrofit " in bases and "tiny" not in bases
