"""``tools/torch_compat.py``'s parts (its full run: ``make test-torch``, in ``make test``)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parents[2]


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(ROOT / "tools"))  # it imports hf_compat, its sibling
    spec = importlib.util.spec_from_file_location(
        "torch_compat", ROOT / "tools" / "torch_compat.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lowest_torch_is_pyprojects_bound_as_a_full_release(tool, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    for declared, lowest in [(">=2.11", "2.11.0"), (">=2.12.1,<3", "2.12.1"), (">=3", "3.0.0")]:
        pyproject.write_text(f'[project]\ndependencies = ["torch{declared}", "numpy"]\n')
        assert tool.lowest_torch(pyproject) == lowest
    pyproject.write_text('[project]\ndependencies = ["torch<3"]\n')
    with pytest.raises(ValueError, match="no single '>=' lower bound"):
        tool.lowest_torch(pyproject)


def test_the_repositorys_lowest_torch_is_the_gpu_images():
    """pyproject's bound is the GPU machine's torch (docs/benchmarks.md records its runs), so
    the stage tests what the GPU runs; move both together."""
    text = (ROOT / "pyproject.toml").read_text()
    assert '"torch>=2.11",' in text
    assert "PyTorch 2.11.0+cu130" in (ROOT / "docs" / "benchmarks.md").read_text()


def test_the_table_names_torch_and_each_run(tool):
    """The rendering is hf_compat's (tested there); the columns are torch's and the run's."""
    counts = dict(passed=3, failed=0, skipped=1, returncode=0)
    lines = tool.table([{"version": "2.11.0", "run": "kernels", "counts": counts}]).splitlines()
    assert lines[0].startswith("| torch | run | passed |")
    assert lines[2] == "| 2.11.0 | kernels | 3 | 0 | 1 | ok |"
