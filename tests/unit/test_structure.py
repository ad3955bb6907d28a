"""The package's shape: no import cycle and dependencies pointing inwards, counting the imports
inside functions too (not those under ``if TYPE_CHECKING:``), short functions in the trainer,
every name the docs tell a user to import importable, one source for the Focus settings."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).parents[2]

# Which of our top-level parts each part may import, at module level or inside a function
# (inwards only).
ALLOWED = {
    "focus": set(),
    "model": {"focus"},
    "parallel": {"focus", "model"},
    "data": {"focus"},
    "config": {"focus", "model", "data", "parallel"},
    # training checkpoints, read by everyone: below convert/ and train/, above the model
    "checkpoint": {"focus", "model", "parallel", "data", "config"},
    "convert": {"focus", "model", "data", "config", "checkpoint"},
    "train": {"focus", "model", "parallel", "data", "config", "checkpoint", "convert"},
    "experiments": {"config", "train", "data"},
    # benchmarks sit outside, like analysis: attention kernels, the export's decode, the ring
    # step (parallel), training throughput (train, config)
    "bench": {"focus", "model", "parallel", "data", "config", "checkpoint", "convert", "train"},
    # reads checkpoints (checkpoint/) and exports (convert/), never the trainer
    "analysis": {"focus", "model", "parallel", "data", "config", "checkpoint", "convert"},
    # evaluation of trained and retrofitted models: the retrofit report (its plots: analysis)
    "eval": {
        "focus",
        "model",
        "parallel",
        "data",
        "config",
        "checkpoint",
        "convert",
        "train",
        "analysis",
    },
    # the command lines (focus-pretrain's subcommands) on top of everything; cli.py runs them
    "commands": {
        "focus",
        "model",
        "parallel",
        "data",
        "config",
        "checkpoint",
        "convert",
        "train",
        "bench",
        "analysis",
        "eval",
        "cli",
        "experiments",
    },
    "cli": set(),
    "errors": set(),
    "validation": {"errors"},
    "storage": {"errors", "environment"},
    "environment": set(),
    "recipe_files": {"errors", "storage"},
}
# importing no layer of ours, importable from every layer
LEAVES = {"errors", "validation", "storage", "environment", "recipe_files"}
# old import paths kept for one release, each re-exporting its new home (an arrow up allowed)
ALIASES = {
    "focus_pretrain.convert.lm_eval_task": "focus_pretrain.eval.lm_eval_task",
    "focus_pretrain.convert.checkpoints": "focus_pretrain.checkpoint.read",
    "focus_pretrain.convert.families": "focus_pretrain.model.tp_rules",
    "focus_pretrain.train.checkpoint": "focus_pretrain.checkpoint.save",
    "focus_pretrain.train.reshard": "focus_pretrain.checkpoint.reshard",
}


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.Module, nested: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` at module level, or (``nested``) anywhere, less those
    under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for statement in node.body
        for inner in ast.walk(statement)
    }
    nodes = ast.walk(tree) if nested else tree.body
    return [
        node
        for node in nodes
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in typing_only
    ]


def import_graph(root: pathlib.Path, nested: bool = True) -> dict[str, set[str]]:
    """Module -> our modules it imports, inside functions too (``nested=False``: at module level
    only). ``from a.b import c`` imports ``a.b.c`` if that is a module, else ``a.b``; importing
    a module also runs its parent packages, except the importer's own ancestors (already
    running). ``hf_modeling`` is left out: it ships inside exports and imports only
    transformers."""
    paths = {
        _module_name(root, p): p
        for p in (root / "focus_pretrain").rglob("*.py")
        if "hf_modeling" not in p.parts
    }
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = []
        for node in _runtime_imports(ast.parse(path.read_text()), nested):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets += [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names
                ]
        found = set()
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                prefix = ".".join(parts[:i])
                if prefix in paths and prefix != name and not name.startswith(prefix + "."):
                    found.add(prefix)
        graph[name] = found
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (``[a, b, ..., a]``), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [])):
            return cycle
    return None


def test_no_import_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 40 and "focus_pretrain.train.trainer" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_check_finds_cycles(tmp_path):
    """The checker itself: a cycle through imports is found (also through a package's
    ``__init__``); an import inside a function counts unless only module level is asked for;
    one under ``if TYPE_CHECKING:`` never does."""
    pkg = tmp_path / "focus_pretrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from focus_pretrain.sub.c import y\n")
    (pkg / "sub" / "c.py").write_text("y = 1\n")
    (pkg / "a.py").write_text("from focus_pretrain.b import x\n")
    (pkg / "b.py").write_text("import os\n\n\ndef f():\n    import focus_pretrain.a\n")
    graph = import_graph(tmp_path, nested=False)
    assert graph["focus_pretrain.a"] == {"focus_pretrain.b"} and not graph["focus_pretrain.b"]
    assert find_cycle(graph) is None
    assert import_graph(tmp_path)["focus_pretrain.b"] == {"focus_pretrain.a"}  # in a function
    assert find_cycle(import_graph(tmp_path)) is not None
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from focus_pretrain import a\n"
    )
    assert not import_graph(tmp_path)["focus_pretrain.b"]
    (pkg / "b.py").write_text("from focus_pretrain import a\n")
    assert find_cycle(import_graph(tmp_path)) == [
        "focus_pretrain.a",
        "focus_pretrain.b",
        "focus_pretrain.a",
    ]
    (pkg / "b.py").write_text("x = 1\n")
    (pkg / "sub" / "c.py").write_text("from focus_pretrain.a import z\n")
    (pkg / "a.py").write_text("import focus_pretrain.sub.c\n")
    cycle = find_cycle(import_graph(tmp_path))
    assert cycle is not None and "focus_pretrain.sub" in cycle


def test_dependencies_point_inwards():
    """``focus`` imports nothing of ours, ``model`` only ``focus``, ... (see :data:`ALLOWED`),
    inside functions too."""
    bad = []
    for name, targets in import_graph(ROOT).items():
        part = name.split(".")[1] if "." in name else None
        if name in ALIASES:
            assert targets <= {ALIASES[name], ALIASES[name].rsplit(".", 1)[0]}, name  # home only
            continue
        for target in targets:
            other = target.split(".")[1] if "." in target else None
            if part and other and other != part and other not in ALLOWED[part] | LEAVES:
                bad.append(f"{name} -> {target}")
    assert not bad, bad


def test_each_alias_warns_and_gives_its_new_home_s_objects():
    """An old import path (:data:`ALIASES`) still works for one release: importing it warns
    (naming the new home) and gives the very objects of the new home."""
    import subprocess
    import sys

    probe = f"""
import importlib, warnings
aliases = {ALIASES!r}
for old, new in aliases.items():  # their own imports may warn, and the old ones' packages'
    importlib.import_module(new)
    importlib.import_module(old.rsplit(".", 1)[0])
warnings.simplefilter("error", DeprecationWarning)
for old, new in aliases.items():
    try:
        importlib.import_module(old)
    except DeprecationWarning as warning:
        assert new in str(warning), warning
    else:
        raise SystemExit(f"{{old}}: no DeprecationWarning")
warnings.simplefilter("ignore")
for old, new in aliases.items():
    alias, home = importlib.import_module(old), importlib.import_module(new)
    names = alias.__all__  # what the alias re-exports
    assert names and all(getattr(alias, n) is getattr(home, n) for n in names), (old, names)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines without its docstring (signature and decorators' lines excluded)."""
    body = node.body
    documented = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    first = body[1] if documented and len(body) > 1 else body[0]
    return node.end_lineno - first.lineno + 1


def test_functions_are_short_and_files_small():
    """Every module of the package has at most 500 lines and every function at most 80 lines of
    code (its docstring not counted; in ``train/`` and ``checkpoint/``, the trainer's layers,
    80 with the docstring)."""
    package = ROOT / "focus_pretrain"
    long, big = [], []
    for path in sorted(package.rglob("*.py")):
        name = str(path.relative_to(package))
        if len(path.read_text().splitlines()) > 500:
            big.append(name)
        strict = path.parent.name in ("train", "checkpoint")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1 if strict else _code_lines(node)
                if lines > 80:
                    long.append(f"{name}:{node.name} ({lines} lines)")
    assert not big, f"modules over 500 lines: {big}"
    assert not long, long


_FROM_IMPORT = re.compile(r"^\s*from (focus_pretrain[\w.]*) import ([\w, ]+)$", flags=re.M)
_DOTTED = re.compile(r"\bfocus_pretrain(?:\.\w+)+")


def _quoted_names() -> set[str]:
    """``focus_pretrain...`` names in README.md and docs/*.md: what ``python`` code blocks
    import, ``from X import a, b`` lines of other blocks, and dotted names in code spans and
    blocks (``X.y`` or ``X.y(...)``)."""
    names = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        blocks = re.findall(r"```(\w*)\n(.*?)```", text, flags=re.S)
        for language, block in blocks:
            if language == "python":
                for node in ast.walk(ast.parse(block)):
                    if isinstance(node, ast.ImportFrom) and node.module.startswith(
                        "focus_pretrain"
                    ):
                        names |= {f"{node.module}.{alias.name}" for alias in node.names}
            for module, items in _FROM_IMPORT.findall(block):
                names |= {f"{module}.{item.strip()}" for item in items.split(",")}
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for chunk in [block for _, block in blocks] + spans:
            names |= {m for m in _DOTTED.findall(chunk) if not m.endswith((".py", ".md"))}
    return names


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_name_the_docs_quote_exists():
    names = _quoted_names()
    assert {
        "focus_pretrain.train.pretrain",
        "focus_pretrain.parallel.apply_context_parallel",
    } <= names
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name}: {error}")
    assert not missing, missing


def _focus_defaults() -> dict[str, object]:
    from focus_pretrain.focus import FocusConfig

    return {f.name: f.default for f in dataclasses.fields(FocusConfig)}


def test_focus_defaults_yaml_lists_every_setting_with_its_default():
    section = yaml.safe_load((ROOT / "configs" / "focus-defaults.yaml").read_text())["focus"]
    assert section == _focus_defaults()


def test_exported_focus_settings_come_from_the_config():
    """The export's ``focus`` section is FocusConfig minus the training-only knobs, and the
    shipped (standalone) modeling code's defaults are FocusConfig's."""
    from focus_pretrain.convert import hf_export
    from focus_pretrain.convert.hf_modeling.configuration_focus import FOCUS_DEFAULTS
    from focus_pretrain.focus import FocusConfig

    defaults = _focus_defaults()
    exported = set(hf_export.EXPORTED_FOCUS_FIELDS)
    assert exported | set(hf_export.NOT_EXPORTED_FOCUS_FIELDS) == set(defaults)
    assert {name: defaults[name] for name in exported} == FOCUS_DEFAULTS
    assert hf_export._focus_section(FocusConfig(num_groups=3)) == {
        **FOCUS_DEFAULTS,
        "num_groups": 3,
    }
