"""Run the HF-facing tests against the lowest and the newest supported ``transformers``.

The exported modeling code runs in the user's environment, with whatever ``transformers`` they
have; the locked run of ``make test`` sees one version. This tool adds, for each version asked
for (default: the lowest release the range in pyproject.toml allows and the newest release on the
package index inside that range; ``latest``, the newest of all, tries a release before the range
is widened):

* **with the package**: the tests marked ``hf`` but not ``e2e`` (import against transformers'
  models, the shipped modeling code: generation, static decode, packed documents, sparse
  decode, config and export checks, ``tests/compat``'s export checks; the end-to-end recipes
  only with ``--with-e2e``) in the locked environment with that
  ``transformers`` laid over it: what pip would change for it (``transformers`` and the
  dependencies it needs at other versions) is installed into ``<work>/overlay-<version>`` and put
  first on ``PYTHONPATH``; the locked environment itself is not touched. Skipped where the
  version is the locked one (the main run covers it).
* **standalone**: ``tests/compat`` in a small environment of its own (``<venv>``: torch, pytest
  and that ``transformers``, nothing else of ours) on exports the locked environment wrote
  (``python -m tests.compat.write_exports``), with ``focus_pretrain`` unimportable.

Each run writes a JUnit XML; the tool prints a table of what each run measured and writes it as
JSON (``<work>/summary.json``); the exit status is non-zero if any run failed.

    .venv/bin/python tools/hf_compat.py                       # lowest and newest (make test-compat)
    .venv/bin/python tools/hf_compat.py --versions 5.10.0     # one version
    .venv/bin/python tools/hf_compat.py --versions latest     # a release past the range
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ElementTree
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# the HF-facing tests repeated under each version: not the end-to-end recipes, whose HF parts
# (import, export, the exported code) the unit and multi-process tests and the standalone
# run cover, while their training would only repeat the main run (--with-e2e adds them)
HF_MARKER = "hf and not e2e"


def declared_range(pyproject: Path = ROOT / "pyproject.toml", name: str = "transformers") -> str:
    """The specifier pyproject.toml declares for ``name``, e.g. ``">=5.0,<5.25"``."""
    for dep in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        requirement = Requirement(dep)
        if requirement.name == name:
            return str(requirement.specifier)
    raise ValueError(f"{pyproject} declares no {name} dependency")


def lowest_version(specifier: str) -> str:
    """The lower bound of ``specifier`` (its ``>=`` clause): the lowest supported release."""
    bounds = [s.version for s in Requirement(f"x{specifier}").specifier if s.operator == ">="]
    if len(bounds) != 1:
        raise ValueError(f"{specifier!r} has no single '>=' lower bound to test")
    return bounds[0]


def pip_plan(python: str, requirement: str, *, ignore_installed: bool = False) -> dict[str, str]:
    """``{name: version}`` that ``pip install requirement`` would install into ``python``'s
    environment (only what it lacks, unless ``ignore_installed``), asked with ``--dry-run``."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        args = [python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report)]
        args += ["--ignore-installed", "--no-deps"] if ignore_installed else []
        subprocess.run([*args, requirement], check=True, stdout=subprocess.DEVNULL)
        items = json.loads(report.read_text())["install"]
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in items}


def release(python: str, specifier: str) -> str:
    """The newest ``transformers`` release on the package index that ``specifier`` allows
    (``"==5.0"`` resolves to ``"5.0.0"``; ``""``: the newest of all)."""
    return pip_plan(python, f"transformers{specifier}", ignore_installed=True)["transformers"]


def named_versions(python: str, specifier: str) -> dict[str, str]:
    """``lowest``: the range's lower bound; ``newest``: the newest release inside the range
    (a release past the upper bound is not supported until the range is widened, so it must
    not fail CI overnight); ``latest``: the newest of all (to try one before widening)."""
    return {
        "lowest": release(python, f"=={lowest_version(specifier)}"),
        "newest": release(python, specifier),
        "latest": release(python, ""),
    }


MADE_BY = ".made-by-focus-compat"  # in every directory these tools make (and may remake)


def check_ours(path: Path) -> None:
    """Refuse ``path`` when something is there that this tool did not make (no
    :data:`MADE_BY` in it): the tool never replaces it."""
    if (path.exists() or path.is_symlink()) and not (
        path.is_dir() and not path.is_symlink() and (path / MADE_BY).is_file()
    ):
        raise ValueError(
            f"{path} exists and was not made by this tool: move it away or give another "
            "--work / --venv"
        )


def fresh_dir(path: Path) -> None:
    """Make ``path`` an empty directory of this tool's: an unfinished one of ours (holding
    :data:`MADE_BY`) is removed first; any other existing path is refused, never deleted."""
    check_ours(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / MADE_BY).write_text("made by tools/hf_compat.py or tools/torch_compat.py\n")


def overlay(python: str, requirement: str, work: Path, leave_out: tuple[str, ...] = ()) -> Path:
    """A directory holding ``requirement`` (e.g. ``transformers==5.0.0``, ``torch==2.11.0``)
    and the dependencies it needs at versions other than the installed ones (what pip would
    change, less the packages named in ``leave_out``), to put first on ``PYTHONPATH``: the
    environment itself is not touched. pip's whole plan is kept in ``<dir>/.plan.json``."""
    target = work / f"overlay-{requirement.replace('==', '-')}"
    if not (target / ".complete").is_file():
        plan = pip_plan(python, requirement)
        fresh_dir(target)
        pins = [f"{name}=={pinned}" for name, pinned in plan.items() if name not in leave_out]
        pip = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target)]
        subprocess.run([*pip, *pins], check=True)
        (target / ".plan.json").write_text(json.dumps(plan, indent=1))
        (target / ".complete").write_text("\n".join(pins) + "\n")
    return target


def small_venv(venv: Path, torch_spec: str, lock: Path | None) -> str:
    """The standalone environment's python: torch (``torch_spec``), pytest; nothing of ours."""
    python = venv / "bin" / "python"
    if not (venv / ".complete").is_file():
        fresh_dir(venv)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet"]
        constraints = ["-c", str(lock)] if lock else []
        subprocess.run([*pip, *constraints, "--upgrade", "pip"], check=True)
        if torch_spec:
            subprocess.run([*pip, *constraints, *torch_spec.split()], check=True)
        subprocess.run([*pip, *constraints, "pytest", "pytest-timeout"], check=True)
        (venv / ".complete").touch()
    return str(python)


def run_pytest(python: str, args: list[str], env: dict[str, str], junit: Path) -> dict:
    """Run pytest; ``{passed, failed, skipped, returncode}`` read from its JUnit XML."""
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *args]
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}).returncode
    counts = {"passed": 0, "failed": 0, "skipped": 0, "returncode": code}
    if junit.is_file():
        for suite in ElementTree.parse(junit).getroot().iter("testsuite"):
            tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
            failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            counts["failed"] += failed
            counts["skipped"] += skipped
            counts["passed"] += tests - failed - skipped
    return counts


def with_package(
    python: str, version: str, work: Path, pytest_args: list[str], marker: str = HF_MARKER
) -> dict:
    """The ``marker`` tests in the locked environment with ``transformers==version`` over it."""
    target = overlay(python, f"transformers=={version}", work)
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "FOCUS_COMPAT_TRANSFORMERS": version, "FOCUS_COMPAT_PACKAGE": "1"}
    junit = work / f"with-package-{version}.xml"
    return run_pytest(python, ["-m", marker, *pytest_args], env, junit)


def standalone(venv_python: str, version: str, exports: Path, work: Path) -> dict:
    """``tests/compat`` in the small environment with ``transformers==version``."""
    pip = [venv_python, "-m", "pip", "install", "--quiet", f"transformers=={version}"]
    subprocess.run(pip, check=True)
    env = {
        "FOCUS_COMPAT_EXPORTS": str(exports),
        "FOCUS_COMPAT_TRANSFORMERS": version,
        "FOCUS_COMPAT_PACKAGE": "0",
        "PYTHONPATH": "",
    }
    args = ["--noconftest", "-o", "addopts=", "tests/compat/test_exports.py", "-q"]
    return run_pytest(venv_python, args, env, work / f"standalone-{version}.xml")


def write_exports(python: str, work: Path) -> Path:
    exports = work / "exports"
    fresh_dir(exports)
    subprocess.run([python, "-m", "tests.compat.write_exports", str(exports)], cwd=ROOT, check=True)
    return exports


def table(rows: list[dict], package: str = "transformers", column: str = "environment") -> str:
    """Markdown: one line per run (``row["version"]``, ``row[column]``, its counts or note)."""
    lines = [f"| {package} | {column} | passed | failed | skipped | result |", "|---" * 6 + "|"]
    for row in rows:
        counts = row.get("counts") or {}
        result = row.get("note") or ("ok" if counts.get("returncode") == 0 else "FAILED")
        cells = [row["version"], row[column]]
        cells += [str(counts.get(k, "-")) for k in ("passed", "failed", "skipped")]
        lines.append("| " + " | ".join([*cells, result]) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--versions",
        nargs="+",
        default=["lowest", "newest"],
        help="transformers versions: 'lowest' (pyproject's lower bound), 'newest' (the newest "
        "release inside pyproject's range), 'latest' (the newest of all) or exact ones",
    )
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "hf-compat")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-compat", help="small venv")
    parser.add_argument("--torch", default="torch==2.13.0", help="torch for the small venv")
    parser.add_argument(
        "--lock",
        default=str(ROOT / "requirements" / "lock.txt"),
        help="constraints for the small venv's torch and pytest ('' for none)",
    )
    parser.add_argument("--pytest-args", default="-q", help="extra arguments of the hf runs")
    parser.add_argument(
        "--with-e2e", action="store_true", help="also the end-to-end recipes marked hf"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run_tool("hf_compat.py", lambda: run(parse_args(argv)))


def run_tool(name: str, work) -> int:
    """``work()``'s exit status; a ``ValueError`` (a directory the tool would not replace, a
    bad version range) is one line ``NAME: error: ...`` and status 2."""
    try:
        return work()
    except ValueError as error:
        print(f"{name}: error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    for path in (args.venv, args.work / "exports"):  # before any work
        if not (path / ".complete").is_file():
            check_ours(path)
    python = sys.executable
    args.work.mkdir(parents=True, exist_ok=True)
    specifier, locked = declared_range(), metadata.version("transformers")
    named = named_versions(python, specifier)
    versions = list(dict.fromkeys(named.get(v, v) for v in args.versions))
    print(f"transformers: declared {specifier}, locked {locked}, checking {versions}", flush=True)
    if named["latest"] != named["newest"]:
        print(
            f"note: transformers {named['latest']} is out, past the declared range {specifier}: "
            "try it with --versions latest, then widen the range and `make lock`",
            flush=True,
        )
    rows = []
    for version in versions:
        row = {"version": version, "environment": "locked + this transformers (hf tests)"}
        if Version(version) == Version(locked):
            row["note"] = "the locked version: covered by the main run"
        else:
            marker = "hf" if args.with_e2e else HF_MARKER
            extra = args.pytest_args.split()
            row["counts"] = with_package(python, version, args.work, extra, marker)
        rows.append(row)
    exports = write_exports(python, args.work)
    venv_python = small_venv(args.venv, args.torch, Path(args.lock) if args.lock else None)
    for version in versions:
        counts = standalone(venv_python, version, exports, args.work)
        rows.append({"version": version, "environment": "standalone", "counts": counts})
    summary = {"declared": specifier, "locked": locked, "named": named, "runs": rows}
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(rows))
    failed = [r for r in rows if r.get("counts") and r["counts"]["returncode"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
