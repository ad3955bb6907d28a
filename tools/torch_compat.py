"""Run the torch-sensitive tests under the lowest supported torch as well as the locked one.

The main run of ``make test`` uses the locked torch (``TORCH_SPEC``, the CPU build of 2.13).
The GPU machines run an older one (their image's 2.11), whose dynamo traces less: a call the
locked torch captures can break a ``fullgraph=True`` compile there (``copy.copy`` did). The
lowest torch pyproject.toml allows is that version, and this tool checks it: it lays that torch
(the registry's wheel, a CUDA build, which also runs on a CPU) and what pip would change with
it (the CUDA libraries) over the locked environment, in ``<work>/overlay-torch-<version>``
first on ``PYTHONPATH`` (the environment is not touched), and runs

* the tests marked ``torch`` (captures with ``fullgraph=True``, host syncs and launches, every
  backend against the reference, the gate forms) and the shipped HF modeling tests (``hf and
  not e2e``), with the locked CPU Triton, whose interpreter runs the kernels;
* the kernels' compile for the GPU (sm_90, no GPU needed) with that torch's own Triton (the
  GPU image's 3.6 refused a kernel that 3.9 compiled), in ``<work>/overlay-triton-<version>``.

It prints a table, writes ``<work>/summary.json`` and exits non-zero if a run failed.

    .venv/bin/python tools/torch_compat.py                    # pyproject's lowest torch (make test)
    .venv/bin/python tools/torch_compat.py --versions 2.12.0  # another one
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_compat import ROOT, declared_range, lowest_version, overlay, run_pytest, run_tool
from hf_compat import table as runs_table

# what is repeated under each torch: whatever depends on what torch traces, dispatches or
# computes (the marker's tests), and the exported modeling code, which runs on the user's torch
TORCH_MARKER = "torch or (hf and not e2e)"
# and under that torch's own Triton: its compiler must accept the kernels for the GPU (no GPU
# needed). The other runs keep the locked CPU Triton: on a CPU Triton only interprets the
# kernels, and the interpreter of Triton < 3.9 fails with NumPy 2.
TRITON_TESTS = ["tests/unit/test_soft_triton.py", "-k", "compile_for_hopper"]


def lowest_torch(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The lowest torch release pyproject.toml allows (its single ``>=`` bound), as a full
    release number (``>=2.11`` -> ``"2.11.0"``)."""
    release = Version(lowest_version(declared_range(pyproject, name="torch"))).release
    return ".".join(map(str, (*release, 0, 0)[:3]))


def under_torch(python: str, version: str, work: Path, pytest_args: list[str]) -> list[dict]:
    """Two runs with ``torch==version`` laid over the locked environment: the ``torch``-marked
    and HF modeling tests (the locked Triton kept), then the kernels' GPU compile with that
    torch's Triton; each ``{run, passed, failed, skipped, returncode}``."""
    torch_dir = overlay(python, f"torch=={version}", work, leave_out=("triton",))
    planned = json.loads((torch_dir / ".plan.json").read_text())
    runs = [("torch-marked and HF modeling tests", [torch_dir], ["-m", TORCH_MARKER])]
    if "triton" in planned:
        triton_dir = overlay(python, f"triton=={planned['triton']}", work)
        name = f"the kernels' GPU compile, triton {planned['triton']}"
        runs.append((name, [triton_dir, torch_dir], TRITON_TESTS))
    results = []
    for index, (name, dirs, selection) in enumerate(runs):
        path = os.pathsep.join([*map(str, dirs), *filter(None, [os.environ.get("PYTHONPATH")])])
        env = {"PYTHONPATH": path, "FOCUS_EXPECT_TORCH": version}
        junit = work / f"torch-{version}-{index}.xml"
        counts = run_pytest(python, [*selection, *pytest_args], env, junit)
        results.append({"run": name, **counts})
    return results


def table(rows: list[dict]) -> str:
    return runs_table(rows, package="torch", column="run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--versions",
        nargs="+",
        default=["lowest"],
        help="torch versions: 'lowest' (pyproject's lower bound) or exact ones",
    )
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "torch-compat")
    parser.add_argument("--pytest-args", default="-q", help="extra arguments of each run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_tool("torch_compat.py", lambda: run(parse_args(argv)))


def run(args: argparse.Namespace) -> int:
    args.work.mkdir(parents=True, exist_ok=True)
    lowest = lowest_torch()
    versions = list(dict.fromkeys(lowest if v == "lowest" else v for v in args.versions))
    import torch  # the locked one (the main run's)

    print(f"torch: declared >={lowest}, locked {torch.__version__}, checking {versions}")
    rows = []
    for version in versions:
        if Version(version) == Version(Version(torch.__version__).base_version):
            note = "the installed version: the main run's"
            rows.append({"version": version, "run": "-", "note": note})
            continue
        for counts in under_torch(sys.executable, version, args.work, args.pytest_args.split()):
            rows.append({"version": version, "run": counts.pop("run"), "counts": counts})
    summary = {"lowest": lowest, "locked": torch.__version__, "runs": rows}
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(rows))
    return 1 if any(row.get("counts", {}).get("returncode", 0) != 0 for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
