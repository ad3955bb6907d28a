"""Bad input ends a command with one line and status 2; a crash keeps its traceback."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from focus_pretrain.config import load_config
from focus_pretrain.errors import InputError, MissingInputError, exit_on_input_error

ROOT = pathlib.Path(__file__).parents[2]


def test_an_input_error_exits_with_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as stopped, exit_on_input_error("prog"):
        raise InputError("model.x must be >= 1, got 0")
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "prog: error: model.x must be >= 1, got 0\n"


def test_any_other_error_propagates_with_its_traceback():
    with pytest.raises(ValueError, match="a bug"), exit_on_input_error("prog"):
        raise ValueError("a bug")


def test_config_errors_are_input_errors_of_the_old_types(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {num_layers: [1,\n")
    with pytest.raises(InputError, match=r"bad.yaml is not valid YAML"):
        load_config(bad)
    with pytest.raises(InputError, match=r"unknown key\(s\) model.num_layer"):
        load_config(None, ["model.num_layer=2"])
    with pytest.raises(MissingInputError) as missing:
        load_config(tmp_path / "absent.yaml")
    assert isinstance(missing.value, FileNotFoundError)  # what callers caught before
    with pytest.raises(ValueError, match=r"focus.top_k must be <= num_groups \(4\), got 9"):
        load_config(None, ["model.focus.num_groups=4", "model.focus.top_k=9"])


@pytest.mark.parametrize(
    "tool,args,message",
    [
        ("import_hf.py", ["{missing}"], r"config.json does not exist: point at a HuggingFace"),
        ("reshard_checkpoint.py", ["{missing}"], r"is neither a checkpoint .* nor a run"),
        ("evaluate.py", ["--checkpoint", "{missing}"], r"is neither a checkpoint .* nor a run"),
    ],
)
def test_the_tools_print_a_missing_input_on_one_line(tmp_path, tool, args, message):
    missing = str(tmp_path / "absent")
    command = [
        sys.executable,
        str(ROOT / "tools" / tool),
        *(a.format(missing=missing) for a in args),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    prefix = f"{tool}: error:"  # the parser's program name: the script's
    (line,) = [x for x in done.stderr.splitlines() if x.startswith(prefix)]
    assert re.search(message, line), line
