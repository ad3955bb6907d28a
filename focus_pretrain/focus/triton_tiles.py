"""Tiles, warps and stages of the ``triton`` backend's kernels: measured per GPU, else defaults.

Each kernel (``fwd``: the forward; ``kv``: the dK/dV pass; ``q``: the dQ pass) launches with a
:class:`Tile`: ``BM`` queries by ``BN`` keys, its warps and its pipeline stages. Where they come
from, first match wins:

1. ``FOCUS_TRITON_BLOCKS`` (for tuning), e.g. ``fwd=128x64x8x3,kv=64x128,warps=4``: a kernel's
   ``BMxBN[xWARPS[xSTAGES]]``, or ``warps=``/``stages=`` for every kernel. ``kva=...`` launches
   the backward as one dK/dV pass adding dQ atomically (:data:`ATOMIC`; ``kva=off``: not).
2. The measured table (``FOCUS_TRITON_TILES``, else the package's ``triton_tiles.json``,
   :data:`TABLE_PATH`; written by ``tools/tune_triton.py`` on the GPU: every candidate timed and
   checked against the first, the fastest kept), for the GPU by name, the input precision
   (``half``: fp16/bf16; ``tf32``; ``fp32``: 3xTF32 products), the head dim's size class and the
   layout (``packed``: the group-sorted top-1 path; without its own entry, the one-sequence
   entry). The table also records the training speed of each backend measured there, per
   mode and length (``training``: ``half/128/soft@8192``), which ``auto`` ranks by
   (:func:`fastest_training_backend`: the record at the nearest measured length).
3. :data:`DEFAULTS`: at half precision and head dim 128 an H200's measured tiles, elsewhere tiles
   that compile for sm_90 without a register spill (not tuned). A GPU missing from the table is
   reported once (``logging``), naming the tool that measures it.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

KERNELS = ("fwd", "kv", "q")
TRAINING_MODES = ("soft", "hard_gated")  # the modes whose training backends the table ranks
ATOMIC = "kva"  # the dK/dV kernel adding dQ atomically: used (no dQ pass) when the table has it
TABLE_PATH = Path(__file__).with_name("triton_tiles.json")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tile:
    """One kernel's launch: ``bm`` queries x ``bn`` keys per tile, ``warps``, ``stages``."""

    bm: int
    bn: int
    warps: int
    stages: int

    def text(self) -> str:
        """``BMxBNxWARPSxSTAGES``, the override's and the table's spelling."""
        return f"{self.bm}x{self.bn}x{self.warps}x{self.stages}"

    @staticmethod
    def parse(text: str, base: Tile | None = None) -> Tile:
        """``BMxBN[xWARPS[xSTAGES]]`` (missing fields from ``base``); ``ValueError`` if bad."""
        parts = [int(x) for x in text.lower().split("x")]
        if len(parts) < (2 if base else 4) or len(parts) > 4:
            raise ValueError(text)
        if any(x < 16 or x & (x - 1) for x in parts[:2]) or any(x < 1 for x in parts[2:]):
            raise ValueError(text)
        fields = parts + [base.warps, base.stages][len(parts) - 2 :] if base else parts
        return Tile(*fields)


def _uniform(fwd: tuple, kv: tuple, q: tuple, warps: int, stages: int) -> dict[str, Tile]:
    return {key: Tile(*bmn, warps, stages) for key, bmn in zip(KERNELS, (fwd, kv, q), strict=True)}


# (precision, head-dim size) -> tiles. Half precision at head dim 128: the H200's measured tiles
# (2026-11-27, triton_tiles.json: 2-8x faster than the spill-free ones that were the default
# before; the H100 has the same sm_90 shared memory); the rest compile for sm_90 with no register
# spill (tools/compile_triton_kernels.py), not tuned. fp32 with 3xTF32 products only at head dim
# 64 (above it the backward spills at every tile: soft_triton.cuda_refusal)
DEFAULTS: dict[tuple[str, int], dict[str, Tile]] = {
    ("half", 64): _uniform((64, 32), (16, 32), (32, 32), 4, 3),
    ("half", 128): {
        "fwd": Tile(64, 64, 4, 2),
        "kv": Tile(32, 128, 8, 3),
        "q": Tile(128, 64, 8, 3),
    },
    ("half", 256): _uniform((32, 64), (16, 32), (16, 64), 8, 2),
    ("tf32", 64): _uniform((64, 32), (16, 32), (64, 16), 4, 1),
    ("tf32", 128): _uniform((32, 32), (32, 32), (32, 16), 8, 1),
    ("tf32", 256): _uniform((32, 32), (16, 32), (16, 32), 8, 1),
    ("fp32", 64): _uniform((64, 32), (16, 16), (64, 16), 4, 1),
}


def size_class(head_dim: int) -> int:
    """The tile table's head-dim class: 64, 128 or 256."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def table_key(precision: str, head_dim: int, kernel: str, packed: bool) -> str:
    """A measured table's entry name, e.g. ``half/128/fwd`` or ``half/128/packed/kv``."""
    return "/".join([precision, str(size_class(head_dim)), *(["packed"] if packed else []), kernel])


def table_path() -> Path:
    """The measured table in use: ``FOCUS_TRITON_TILES`` (a table of your own GPUs, written by
    ``tools/tune_triton.py --table``), else the package's :data:`TABLE_PATH`."""
    return Path(os.environ.get("FOCUS_TRITON_TILES") or TABLE_PATH)


def measured_table() -> dict:
    """The measured table ``{gpu name: {"tiles": {key: "BMxBNxWxS"}, "date": ..., ...}}`` of
    :func:`table_path` (``{}`` when the file is missing)."""
    return _read_table(str(table_path()))


@functools.cache
def _read_table(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text()).get("gpus", {})
    except FileNotFoundError:
        return {}


@functools.cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _report_untuned(gpu: str) -> None:
    logger.warning(
        "triton kernels: no measured tiles for %s in %s; using untuned defaults (measure them "
        "with tools/tune_triton.py)", gpu, TABLE_PATH.name,
    )  # fmt: skip


def default_tiles(precision: str, head_dim: int, packed: bool = False) -> dict[str, Tile]:
    """:data:`DEFAULTS` for one launch (the group-sorted layout, ``packed``, takes the same)."""
    size = size_class(head_dim)
    return dict(DEFAULTS.get((precision, size), DEFAULTS[("tf32", size)]))


def launch_tiles(
    precision: str, head_dim: int, packed: bool = False, gpu: str | None = None
) -> dict[str, Tile]:
    """Each kernel's :class:`Tile` for a launch on ``gpu`` (``None``: no GPU: the defaults),
    overridden by ``FOCUS_TRITON_BLOCKS``. Resolved once per setting (each call launches
    kernels: the table is not parsed again)."""
    override = os.environ.get("FOCUS_TRITON_BLOCKS", "")
    size = size_class(head_dim)
    return dict(_resolved_tiles(precision, size, packed, gpu, str(table_path()), override))


@functools.cache
def _resolved_tiles(
    precision: str, size: int, packed: bool, gpu: str | None, table: str, override: str
) -> dict[str, Tile]:
    tiles = default_tiles(precision, size, packed)
    if gpu is not None:
        entry = _read_table(table).get(gpu)
        if entry is None:
            _report_untuned(gpu)
        else:
            for kernel in (*KERNELS, ATOMIC):  # packed: its own entry, else the one-sequence one
                found = entry["tiles"]
                text = found.get(table_key(precision, size, kernel, packed))
                text = text or found.get(table_key(precision, size, kernel, False))
                if text is not None:
                    tiles[kernel] = Tile.parse(text)
    return override_tiles(tiles, override)


def training_key(precision: str, head_dim: int, mode: str, seq: int | None = None) -> str:
    """A ``training`` record's name: ``half/128/soft`` (any length) or ``half/128/soft@8192``
    (measured at that length)."""
    key = f"{precision}/{size_class(head_dim)}/{mode}"
    return key if seq is None else f"{key}@{seq}"


def training_ranking(
    gpu: str, precision: str, head_dim: int, mode: str, seq: int | None = None
) -> dict[str, float] | None:
    """The speedups over dense attention of the backends measured together for a training
    step of ``mode`` on ``gpu`` (``{"triton": 0.40, "flex": 0.01}``): the record measured at
    the length nearest ``seq`` (by ratio; the shorter on a tie) among those that rank two
    backends or more, else the length-free record; ``None``: nothing ranked there."""
    return _ranking(str(table_path()), gpu, precision, head_dim, mode, seq)


@functools.cache  # auto asks at every attention call
def _ranking(
    table: str, gpu: str, precision: str, head_dim: int, mode: str, seq: int | None
) -> dict[str, float] | None:
    records = _read_table(table).get(gpu, {}).get("training", {})
    base = training_key(precision, head_dim, mode)
    by_length = {}
    for key, speeds in records.items():
        name, _, length = key.partition("@")
        if name == base and length.isdigit() and len(speeds) >= 2:
            by_length[int(length)] = speeds
    if seq is not None and by_length:
        nearest = min(by_length, key=lambda n: (abs(math.log(n / max(seq, 1))), n))
        return by_length[nearest]
    speeds = records.get(base)
    return speeds if speeds and len(speeds) >= 2 else None


def fastest_training_backend(
    gpu: str, precision: str, head_dim: int, mode: str, seq: int | None = None
) -> str | None:
    """The backend the table measured fastest for a training step (forward + backward) of
    ``mode`` on ``gpu`` at this precision, head dim and length (:func:`training_ranking`;
    ``None``: no ranking measured there)."""
    speeds = training_ranking(gpu, precision, head_dim, mode, seq)
    return max(speeds, key=speeds.get) if speeds else None


@torch.compiler.assume_constant_result
def triton_fastest_here(precision: str, head_dim: int, mode: str, seq: int | None = None) -> bool:
    """Whether the table says ``triton`` trains ``mode`` fastest at ``seq`` tokens on this
    process's GPU (a constant while tracing: ``auto`` dispatches inside compiled graphs)."""
    if not torch.cuda.is_available():
        return False
    gpu = _gpu_name(torch.cuda.current_device())
    return fastest_training_backend(gpu, precision, head_dim, mode, seq) == "triton"


def cuda_tiles(device: torch.device, precision: str, head_dim: int, packed: bool) -> dict:
    """:func:`launch_tiles` for the GPU that holds a tensor."""
    if not torch.cuda.is_available():  # compiling for a GPU on a host without one
        return launch_tiles(precision, head_dim, packed)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return launch_tiles(precision, head_dim, packed, _gpu_name(index))


def override_text(tiles: dict[str, Tile]) -> str:
    """The ``FOCUS_TRITON_BLOCKS`` text naming every kernel's tile (:func:`override_tiles`
    reads it back)."""
    return ",".join(f"{key}={tile.text()}" for key, tile in tiles.items())


def override_tiles(tiles: dict[str, Tile], override: str) -> dict[str, Tile]:
    """``tiles`` with ``FOCUS_TRITON_BLOCKS``'s items applied."""
    tiles = dict(tiles)
    for item in filter(None, (part.strip() for part in override.split(","))):
        key, _, value = item.partition("=")
        try:
            if key == ATOMIC and value == "off":
                tiles.pop(ATOMIC, None)
            elif key in tiles or key == ATOMIC:
                tiles[key] = Tile.parse(value, tiles.get(key, tiles["kv"]))
            elif key in ("warps", "stages"):
                for kernel, tile in tiles.items():
                    fields = {"warps": tile.warps, "stages": tile.stages, key: int(value)}
                    tiles[kernel] = Tile(tile.bm, tile.bn, **fields)
            else:
                raise ValueError(key)
        except ValueError:
            raise ValueError(
                f"FOCUS_TRITON_BLOCKS: bad item {item!r}; expected fwd|kv|q|kva=BMxBN[xWARPS"
                "[xSTAGES]] (tile sides powers of two >= 16; kva=off: no atomic dQ) or "
                "warps|stages=N, comma-separated"
            ) from None
    return tiles
