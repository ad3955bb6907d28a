"""What every benchmark reports besides its rows: the environment (versions, machine, the
resolved settings) and the same outputs (environment line, markdown table on stdout; optional
JSON ``{"environment", "rows"}`` and markdown files)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import statistics
import time
from collections.abc import Callable, Iterable, Sequence

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def elapsed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Milliseconds of one call of ``fn``: CUDA events on a GPU, the wall clock elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """The median of :func:`elapsed_ms` over ``repeats`` calls of ``fn``, after ``warmup`` calls
    that are not timed."""
    for _ in range(warmup):
        fn()
    return statistics.median(elapsed_ms(fn, device) for _ in range(repeats))


def markdown(columns: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: a header of ``columns``, then one line per row of cells (``str`` of
    each); ``align`` has one letter a column, ``r`` (right-aligned: numbers) or ``l`` (left).

    Raises:
        ValueError: ``align`` does not give one letter ``r`` or ``l`` per column.
    """
    if len(align) != len(columns) or set(align) - {"r", "l"}:
        raise ValueError(f"align {align!r} must be one of 'r', 'l' per column ({len(columns)})")
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = [_markdown_line(columns), rule] + [_markdown_line(row) for row in rows]
    return "\n".join(lines)


def _markdown_line(cells: Iterable[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def environment(config, device: str) -> dict:
    """Versions, threads, GPU (when ``device`` is CUDA) and ``config`` (a dataclass)."""
    env = dict(torch=torch.__version__, threads=torch.get_num_threads())
    for package in ("transformers", "flash_attn"):
        if importlib.util.find_spec(package) is not None:
            env[package] = importlib.import_module(package).__version__
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    env["config"] = dataclasses.asdict(config)
    return env


def run_and_report(env: dict, run, table, json_path: str | None, markdown_path: str | None):
    """Print ``env`` (without the config), run ``run() -> rows``, print ``table(rows)`` and
    write the requested files; returns the rows."""
    print(json.dumps({k: v for k, v in env.items() if k != "config"}))
    rows = run()
    text = table(rows)
    print(text)
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    if markdown_path:
        pathlib.Path(markdown_path).write_text(text + "\n")
    return rows
