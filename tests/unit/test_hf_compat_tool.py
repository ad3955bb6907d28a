"""``tools/hf_compat.py``'s parts (its full run is ``make test-compat``, part of ``make test``)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = pathlib.Path(__file__).parents[2]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("hf_compat", ROOT / "tools" / "hf_compat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lowest_version_is_the_single_lower_bound(tool):
    assert tool.lowest_version(">=5.0,<5.25") == "5.0"
    assert tool.lowest_version("<6,>=5.3.1") == "5.3.1"
    for unbounded in ("<5.25", ">4,<5"):
        with pytest.raises(ValueError, match="no single '>=' lower bound"):
            tool.lowest_version(unbounded)


def test_the_declared_range_is_pyprojects(tool, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["torch", "transformers >=5.1, <5.9"]\n')
    assert SpecifierSet(tool.declared_range(pyproject)) == SpecifierSet(">=5.1,<5.9")
    pyproject.write_text('[project]\ndependencies = ["torch"]\n')
    with pytest.raises(ValueError, match="declares no transformers dependency"):
        tool.declared_range(pyproject)


def test_named_versions_are_releases_inside_the_range(tool):
    """Asks the package index (as CI does): ``lowest`` is a full release equal to the bound,
    ``newest`` the newest inside the range, ``latest`` at least as new."""
    specifier = tool.declared_range()
    named = tool.named_versions(sys.executable, specifier)
    assert Version(named["lowest"]) == Version(tool.lowest_version(specifier))
    assert named["newest"] in SpecifierSet(specifier)
    assert Version(named["lowest"]) <= Version(named["newest"]) <= Version(named["latest"])


def test_a_run_is_counted_from_its_junit_report(tool, tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): assert 1 == 2\n"
        "@pytest.mark.skip(reason='a sample skip: the report must count it as skipped')\n"
        "def test_d(): pass\n"
    )
    args = ["--noconftest", "-o", "addopts=", "-q", str(tests)]
    counts = tool.run_pytest(sys.executable, args, {}, tmp_path / "run.xml")
    assert counts["passed"] == 2 and counts["failed"] == 1 and counts["skipped"] == 1
    assert counts["returncode"] == 1


def test_the_table_flags_failed_runs(tool):
    rows = [
        {
            "version": "5.0.0",
            "environment": "standalone",
            "counts": dict(passed=3, failed=0, skipped=1, returncode=0),
        },
        {
            "version": "5.9.0",
            "environment": "standalone",
            "counts": dict(passed=2, failed=1, skipped=0, returncode=1),
        },
        {"version": "5.24.0", "environment": "locked", "note": "covered by the main run"},
    ]
    lines = tool.table(rows).splitlines()
    assert lines[2] == "| 5.0.0 | standalone | 3 | 0 | 1 | ok |"
    assert lines[3] == "| 5.9.0 | standalone | 2 | 1 | 0 | FAILED |"
    assert lines[4] == "| 5.24.0 | locked | - | - | - | covered by the main run |"


def test_only_directories_the_tool_made_are_replaced(tool, tmp_path):
    """An overlay, venv or exports directory is remade only when it holds the tool's marker
    (an unfinished one of its own); anything else at that path is refused and kept, and so
    is a file or a symlink there."""
    mine = tmp_path / "overlay-x-1"
    tool.fresh_dir(mine)
    (mine / "half-installed.py").write_text("x = 1\n")
    tool.fresh_dir(mine)  # an unfinished overlay of the tool's: remade empty
    assert sorted(p.name for p in mine.iterdir()) == [tool.MADE_BY]
    users = tmp_path / "users-venv"
    users.mkdir()
    (users / "notes.txt").write_text("the user's")
    (tmp_path / "a-file").write_text("the user's")
    (tmp_path / "a-link").symlink_to(users)
    for path in (users, tmp_path / "a-file", tmp_path / "a-link"):
        with pytest.raises(ValueError, match="exists and was not made by this tool"):
            tool.fresh_dir(path)
    assert (users / "notes.txt").read_text() == "the user's"
    assert (tmp_path / "a-file").read_text() == "the user's" and (tmp_path / "a-link").is_symlink()
    code = tool.main(["--venv", str(users), "--versions", "5.0.0", "--work", str(tmp_path / "w")])
    assert code == 2 and (users / "notes.txt").read_text() == "the user's"
