"""Declarative studies: recipe variants x seeds, exports, evaluations, a table over seeds.

A spec (YAML, ``configs/experiments/*.yaml``)::

    name: e1-demo
    recipe: configs/experiments/demo-small.yaml   # the base recipe of every run
    seeds: [1, 2, 3]
    overrides: []                                 # applied to every run
    variants:                                     # name -> overrides, in order
      focus: []
      dense: [model.focus.enabled=false]
    export: [dense]                               # exported to HuggingFace (RUN/hf)
    evaluations:                                  # tools/evaluate.py on final checkpoints
      top2: {overrides: [model.focus.top_k=2], variants: [focus]}
    report: [valid.loss, train.tokens_per_s, eval.top2.kept_pairs]
    tables:                                       # optional: several tables
      quality: {variants: [focus, dense], report: [valid.loss]}

Overrides may name another variant's run of the same seed: ``{run:V}`` (its directory),
``{hf:V}`` (its export), ``{tokenizer:V}`` (its tokenizer file); ``{seed}`` is the seed. A run
waits for the variants it names. Each run is ``launchers/pretrain.py`` in its own process
(``--jobs`` at a time, CPU threads split between them) writing to
``OUT/VARIANT/seedS``; a run whose ``metrics.jsonl`` has its ``end`` record is not redone.

Report keys: ``valid.K`` (the last validation's ``K``), ``train.K`` (mean over the logged
intervals after the first, e.g. ``tokens_per_s``), ``train.K@max`` / ``train.K@last`` (max or
last logged value, e.g. ``max_group_share``), ``eval.E.K`` (evaluation ``E``'s ``K``), and
``wall_s`` (the run's wall-clock seconds). The table gives mean +- sample standard deviation
over seeds; ``results.json`` holds every seed's values.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from focus_pretrain.config import load_config
from focus_pretrain.data.datasets import prepare_data, tokenizer_path_for
from focus_pretrain.train.metrics import METRICS_FILE, read_metrics

ROOT = Path(__file__).resolve().parents[2]
_PLACEHOLDER = re.compile(r"\{(run|hf|tokenizer):([\w-]+)\}")


@dataclass(frozen=True)
class Evaluation:
    """``tools/evaluate.py`` with ``overrides`` on the final checkpoint of ``variants``
    (all when empty)."""

    overrides: list[str] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Table:
    """A table of the report: these ``variants`` (all when empty) and ``report`` keys."""

    report: list[str]
    variants: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ExperimentSpec:
    """A study (see the module docstring)."""

    name: str
    recipe: str
    variants: dict[str, list[str]]
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3])
    overrides: list[str] = field(default_factory=list)
    export: list[str] = field(default_factory=list)
    evaluations: dict[str, Evaluation] = field(default_factory=dict)
    report: list[str] = field(default_factory=lambda: ["valid.loss"])
    tables: dict[str, Table] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        if not self.variants:
            raise ValueError(f"experiment {self.name}: variants must name at least one run")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"experiment {self.name}: seeds must be distinct, got {self.seeds}")
        names = list(self.variants)
        for variant, sets in self.variants.items():
            for _, other in (m.groups() for s in sets for m in _PLACEHOLDER.finditer(s)):
                if other not in names or names.index(other) >= names.index(variant):
                    raise ValueError(
                        f"experiment {self.name}: variant {variant} refers to {other}, which "
                        "must be an earlier variant"
                    )
        for variant in self.export:
            if variant not in self.variants:
                raise ValueError(f"experiment {self.name}: export names unknown {variant}")
        for name, ev in self.evaluations.items():
            for variant in ev.variants:
                if variant not in self.variants:
                    raise ValueError(f"evaluation {name} names unknown variant {variant}")


def load_spec(path: str | os.PathLike) -> ExperimentSpec:
    """Read and check an experiment spec."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"experiment spec {path} does not exist (see configs/experiments)")
    tree = yaml.safe_load(path.read_text()) or {}
    allowed = set(ExperimentSpec.__dataclass_fields__)
    unknown = sorted(set(tree) - allowed)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    evaluations = {
        name: Evaluation(**(value or {}))
        for name, value in (tree.pop("evaluations", {}) or {}).items()
    }
    variants = {k: _flat(v or []) for k, v in (tree.pop("variants", {}) or {}).items()}
    tables = {name: Table(**value) for name, value in (tree.pop("tables", {}) or {}).items()}
    return ExperimentSpec(variants=variants, evaluations=evaluations, tables=tables, **tree)


def _flat(items: list) -> list[str]:
    """Overrides with YAML aliases expanded (``[*base, x]`` nests ``base``'s list)."""
    return [x for item in items for x in (_flat(item) if isinstance(item, list) else [item])]


class _Runs:
    """Where each (variant, seed) lives and how it is launched."""

    def __init__(self, spec: ExperimentSpec, out: Path, threads: int, extra: list[str]) -> None:
        self.spec, self.out, self.threads, self.extra = spec, out, threads, extra
        self.lock = threading.Lock()

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / variant / f"seed{seed}"

    def overrides(self, variant: str, seed: int) -> list[str]:
        def fill(text: str) -> str:
            def one(m: re.Match) -> str:
                kind, other = m.groups()
                run = self.run_dir(other, seed)
                if kind == "run":
                    return str(run)
                if kind == "hf":
                    return str(run / "hf")
                config = load_config(run / "config.yaml", [])
                return str(tokenizer_path_for(config.data, config.run.seed))

            return _PLACEHOLDER.sub(one, text).replace("{seed}", str(seed))

        sets = [*self.spec.overrides, *self.spec.variants[variant], *self.extra]
        return [
            *map(fill, sets),
            f"run.seed={seed}",
            f"run.output_dir={self.run_dir(variant, seed)}",
            f"run.name={self.spec.name}-{variant}-{seed}",
        ]

    def _launch(self, args: list[str], log: Path) -> None:
        env = dict(os.environ, OMP_NUM_THREADS=str(self.threads))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as handle:
            proc = subprocess.run(args, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if proc.returncode:
            tail = log.read_text()[-3000:]
            raise RuntimeError(
                f"{' '.join(args[:3])} ... failed ({proc.returncode}); log {log}:\n{tail}"
            )

    def train(self, variant: str, seed: int) -> float:
        """Train (unless done), export if asked; returns the training's wall seconds."""
        run = self.run_dir(variant, seed)
        done = run / "wall_s.json"
        if not done.is_file():
            sets = self.overrides(variant, seed)
            args = [
                sys.executable,
                str(ROOT / "launchers" / "pretrain.py"),
                "--config",
                self.spec.recipe,
            ]
            for item in sets:
                args += ["--set", item]
            start = time.perf_counter()
            self._launch(args, run.parent / f"seed{seed}.log")
            done.write_text(json.dumps({"wall_s": time.perf_counter() - start}))
        if variant in self.spec.export and not (run / "hf" / "config.json").is_file():
            args = [
                sys.executable,
                str(ROOT / "tools" / "convert_to_hf.py"),
                str(run),
                str(run / "hf"),
                "--force",  # a half-written export of an interrupted run is redone
            ]
            self._launch(args, run.parent / f"seed{seed}-export.log")
        return json.loads(done.read_text())["wall_s"]

    def evaluate(self, name: str, variant: str, seed: int) -> dict[str, Any]:
        run = self.run_dir(variant, seed)
        path = run / f"eval-{name}.json"
        if not path.is_file():
            args = [sys.executable, str(ROOT / "tools" / "evaluate.py"), "--checkpoint", str(run)]
            for item in self.spec.evaluations[name].overrides:
                args += ["--set", item.replace("{seed}", str(seed))]
            self._launch([*args, "--out", str(path)], run.parent / f"seed{seed}-eval-{name}.log")
        return json.loads(path.read_text())["metrics"]


def _collect(records: list[dict], key: str) -> float | None:
    split, _, name = key.partition(".")
    name, _, how = name.partition("@")
    values = [r[name] for r in records if r.get("split") == split and r.get(name) is not None]
    if not values:
        return None
    if split == "valid" or how == "last":
        return float(values[-1])
    if how == "max":
        return float(max(values))
    return float(sum(values[1:]) / len(values[1:])) if len(values) > 1 else float(values[0])


def run_experiment(
    spec: ExperimentSpec, out: str | os.PathLike, *, jobs: int = 1, extra: list[str] = ()
) -> dict[str, Any]:
    """Run ``spec`` into ``out`` (``jobs`` runs at a time; ``extra`` overrides every run, e.g.
    a shorter ``train.steps`` for a smoke test); write ``results.json`` and ``results.md``.

    Returns ``{"spec", "values": {variant: {key: [per seed]}}, "table": markdown}``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    runs = _Runs(spec, out, threads, list(extra))
    # data (tokenizers, token files) once, before runs race for it; a variant that names
    # another variant's files is prepared by its own run (after that variant's)
    for variant in spec.variants:
        if _depends(spec, variant):
            continue
        sets = [*spec.overrides, *spec.variants[variant], *runs.extra]
        for seed in spec.seeds:
            config = load_config(spec.recipe, [*sets, f"run.seed={seed}"])
            prepare_data(config.data, config.run.seed)
    futures: dict[tuple[str, int], Future] = {}
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=jobs) as pool:

        def job(variant: str, seed: int) -> dict[str, Any]:
            for other in _depends(spec, variant):
                futures[(other, seed)].result()
            wall = runs.train(variant, seed)
            result = {"wall_s": wall}
            for name, ev in spec.evaluations.items():
                if not ev.variants or variant in ev.variants:
                    result[name] = runs.evaluate(name, variant, seed)
            print(f"[{spec.name}] {variant} seed {seed}: done ({wall:.0f} s)", flush=True)
            return result

        for variant in spec.variants:  # dependencies first: submitted in spec order
            for seed in spec.seeds:
                futures[(variant, seed)] = pool.submit(job, variant, seed)
        results = {key: f.result() for key, f in futures.items()}
    values: dict[str, dict[str, list]] = {}
    for (variant, seed), result in results.items():
        records = (
            read_metrics(runs.run_dir(variant, seed))
            if (runs.run_dir(variant, seed) / METRICS_FILE).is_file()
            else []
        )
        row = values.setdefault(variant, {})
        keys = list(spec.report) + [k for t in spec.tables.values() for k in t.report]
        for key in dict.fromkeys(keys):
            if key == "wall_s":
                value = result["wall_s"]
            elif key.startswith("eval."):
                _, name, metric = key.split(".", 2)
                value = result.get(name, {}).get(metric)
            else:
                value = _collect(records, key)
            row.setdefault(key, []).append(value)
    table = _table(spec, values)
    summary = {
        "spec": spec.name,
        "seeds": spec.seeds,
        "values": values,
        "table": table,
        "total_wall_s": time.perf_counter() - started,
        "extra_overrides": list(extra),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    (out / "results.md").write_text(table + "\n")
    return summary


def _depends(spec: ExperimentSpec, variant: str) -> list[str]:
    return sorted({m.group(2) for s in spec.variants[variant] for m in _PLACEHOLDER.finditer(s)})


def mean_std(values: list[float | None]) -> tuple[float, float, int]:
    """Mean and sample standard deviation of the non-missing, finite values, and their count."""
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return math.nan, math.nan, 0
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return mean, std, len(xs)


def _table(spec: ExperimentSpec, values: dict[str, dict[str, list]]) -> str:
    """One markdown table per entry of ``tables`` (or one of ``report`` for all variants)."""
    tables = spec.tables or {"": Table(spec.report)}
    parts = []
    for name, table in tables.items():
        rows = {v: values[v] for v in (table.variants or values) if v in values}
        parts.append((f"**{name}**\n\n" if name else "") + _one_table(spec, table.report, rows))
    return "\n\n".join(parts)


def _one_table(spec: ExperimentSpec, report: list[str], values: dict[str, dict[str, list]]) -> str:
    head = "| variant | " + " | ".join(report) + " |"
    rule = "|---|" + "---:|" * len(report)
    lines = [head, rule]
    for variant, row in values.items():
        cells = []
        for key in report:
            mean, std, n = mean_std(row[key])
            cells.append(
                "-"
                if n == 0
                else f"{_fmt(mean)} ± {_fmt(std)}" + ("" if n == len(spec.seeds) else f" (n={n})")
            )
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:.0f}"
