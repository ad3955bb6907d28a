"""The ``triton`` backend's training step per length, against dense attention and other
backends, and the ranking ``auto`` trains by (``tools/tune_triton.py``'s ``lengths`` stage).

* :func:`length_rows`: per length, dense SDPA's training step, the soft gate's and sparse top-1's
  (``hard_gated``) through ``triton`` and through each rival backend, in ms with TFLOP/s and the
  speedup over dense;
* :func:`write_training`: those speedups into the tile table, per mode and length
  (``training``: ``half/128/soft@8192``), which ``auto`` ranks by
  (:func:`~focus_pretrain.focus.triton_tiles.fastest_training_backend`).

Layout: ``[batch, seq, heads, head_dim]``.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from focus_pretrain.bench.triton_kernels import (
    DTYPES,
    Case,
    api_step,
    causal_flops,
    dense_times,
    inputs,
    write_atomically,
)
from focus_pretrain.focus.soft_triton_launch import precision_class
from focus_pretrain.focus.triton_tiles import TRAINING_MODES, training_key


def length_rows(
    case: Case,
    lengths: list[int],
    device: str,
    measure: Callable,
    log=print,
    rivals: tuple[str, ...] = (),
):
    """Per length: dense SDPA's training step, the soft one and sparse top-1 (``hard_gated``)
    through the ``triton`` backend, each in ms with TFLOP/s (dense-equivalent: the causal
    pairs' FLOPs over the time) and its speedup over dense; sparse with the pair-count ideal;
    ``rivals``: the same steps through other backends (``rivals: {name: {ms, speedup}}`` per
    mode, an ``error`` where one fails), what ``auto`` ranks ``triton`` against."""
    from focus_pretrain.focus.pattern import pattern_density
    from focus_pretrain.focus.router import Routing

    rows = []
    for seq in lengths:
        sized = replace(case, seq=seq)
        data = inputs(sized, device)
        dense = dense_times(sized, data, measure)["fwd_bwd"]
        flops = causal_flops(sized)
        row = dict(seq=seq, dense_ms=dense, dense_tflops=flops / dense / 1e9)
        for mode in TRAINING_MODES:
            row[mode] = _timed_step(sized, data, "triton", mode, measure, flops, dense)
            if rivals:
                row[mode]["rivals"] = {
                    name: _timed_step(sized, data, name, mode, measure, flops, dense)
                    for name in rivals
                }
        member = Routing(data["probs"].float()).membership(1).cpu()
        row["hard_gated"]["ideal"] = 1.0 / float(pattern_density(member, case.window).mean())
        log(json.dumps(row))
        rows.append(row)
    return rows


def _timed_step(case, data, backend, mode, measure, flops: float, dense: float) -> dict:
    """``{ms, tflops, speedup}`` of one training step through ``backend``, or ``{error}``."""
    try:
        ms = measure(api_step(case, data, backend, mode))
    except Exception as exc:
        return dict(error=str(exc)[:200])
    return dict(ms=ms, tflops=flops / ms / 1e9, speedup=dense / ms)


def write_training(path: Path, gpu: str, case: Case, rows: list[dict]) -> dict:
    """Merge the training speedups of :func:`length_rows` (``triton`` and its rivals, per mode
    and length) into the table at ``path`` for ``gpu`` (``training``, the records ``auto``
    ranks by); returns the records written."""
    table = json.loads(path.read_text()) if path.exists() else {}
    entry = table.setdefault("gpus", {}).setdefault(gpu, {"tiles": {}})
    precision, written = precision_class(DTYPES[case.dtype]), {}
    for row in rows:
        for mode in TRAINING_MODES:
            result = row.get(mode, {})
            speeds = {name: r["speedup"] for name, r in result.get("rivals", {}).items()
                      if "speedup" in r}  # fmt: skip
            if "speedup" in result:
                speeds["triton"] = result["speedup"]
            if speeds:
                written[training_key(precision, case.head_dim, mode, row["seq"])] = speeds
    entry.setdefault("training", {}).update(written)
    entry["training_lengths_measured"] = (
        f"{datetime.date.today().isoformat()}: tools/tune_triton.py --stages lengths "
        f"(batch {case.batch}, {case.heads} heads x {case.head_dim}, K={case.groups}, "
        f"window {case.window}, {case.dtype}; speedups over dense SDPA's training step)"
    )
    write_atomically(path, table)
    return written
