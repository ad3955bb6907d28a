"""Data preparation in a distributed job: rank 0 prepares, the other ranks wait for it with
a timeout, and a failure anywhere fails every rank with a clear error.

A plain ``dist.barrier()`` behind rank 0's preparation waits for the process group's timeout
(and then fails with a message about collectives, not data). Here the other ranks wait on a key
of the default process group's store (``store.wait([key], timeout)``): rank 0 sets it to ``ok``
or to its error message. A rank that gives up (``data.prepare_timeout_s``) says so in the store,
and rank 0, once done, waits (as long again at most) for every rank's answer and fails too if
one gave up, so that no rank is left waiting on a collective.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from focus_pretrain.data.datasets import DataConfig, prepare_data

T = TypeVar("T")
_CALLS = itertools.count()  # every rank calls in the same order: the n-th call's keys match
_MESSAGE_CHARS = 4000
OFFLINE_HINT = "tokenise large corpora offline first (focus-pretrain preprocess, docs/training.md)"


class DataWaitError(RuntimeError):
    """A rank gave up waiting for rank 0's data preparation, or rank 0 failed at it."""


def _default_group() -> tuple[Any, int, int] | None:
    """``(store, rank, world_size)`` of the default process group, ``None`` when there is no
    group or only one rank."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    return store, dist.get_rank(), dist.get_world_size()


def rank0_first(
    fn: Callable[[], T],
    *,
    timeout_s: float,
    what: str = "the data",
    setting: str = "data.prepare_timeout_s",
    group: tuple[Any, int, int] | None = None,
    key: str | None = None,
) -> T:
    """Run ``fn`` on rank 0, then on every other rank (which waits at most ``timeout_s`` for
    rank 0 to finish); returns ``fn()``'s result on each rank.

    ``fn`` must be cheap once rank 0 has run it (idempotent preparation). ``group`` is
    ``(store, rank, world_size)`` (default: the default process group's store; without a group
    or with one rank, ``fn`` just runs). ``key`` names the store keys (default: one per call,
    numbered in call order, the same on every rank).

    Raises:
        DataWaitError: on every other rank when rank 0 failed (with rank 0's message) or did not
            finish in time (naming ``setting`` and the fix); on rank 0 when another rank gave
            up or never arrived. Rank 0 re-raises ``fn``'s own exception.
    """
    group = group if group is not None else _default_group()
    if group is None:
        return fn()
    store, rank, world = group
    key = key or f"focus_pretrain/prepare/{next(_CALLS)}"
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        _wait_for_rank0(store, key, rank, world, timeout_s, what, setting)
        return fn()
    started = time.perf_counter()
    try:
        result = fn()
    except BaseException as error:
        store.set(key, f"error: {type(error).__name__}: {error}"[:_MESSAGE_CHARS])
        raise
    store.set(key, "ok")
    took = time.perf_counter() - started
    try:
        store.wait([f"{key}/answered"], timeout)
    except RuntimeError as error:
        raise DataWaitError(
            f"rank 0 prepared {what} in {took:.0f} s but not every rank answered within "
            f"{timeout_s:g} s ({setting}) after that: {error}"
        ) from None
    if store.check([f"{key}/gave_up"]):
        gave_up = store.get(f"{key}/gave_up").decode()
        raise DataWaitError(
            f"rank 0 prepared {what} in {took:.0f} s, longer than {setting}={timeout_s:g} s: "
            f"rank {gave_up} (maybe others) gave up waiting. What rank 0 prepared is cached: "
            f"restart the job, {OFFLINE_HINT}, or raise {setting}"
        )
    return result


def _wait_for_rank0(
    store: Any, key: str, rank: int, world: int, timeout_s: float, what: str, setting: str
) -> None:
    """Wait for rank 0's word on ``key``; answer it (the last rank to answer sets
    ``key/answered``); raise :class:`DataWaitError` on a timeout or rank 0's failure."""

    def answer() -> None:
        if store.add(f"{key}/answers", 1) == world - 1:
            store.set(f"{key}/answered", "1")

    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except RuntimeError as error:
        store.set(f"{key}/gave_up", str(rank))
        answer()
        timed_out = "timeout" in str(error).lower()
        reason = (
            f"did not finish preparing {what} within {setting}={timeout_s:g} s"
            if timed_out
            else f"could not be reached while preparing {what} ({error}; see rank 0's log)"
        )
        raise DataWaitError(
            f"rank {rank}: rank 0 {reason}; {OFFLINE_HINT}, or raise {setting}"
        ) from None
    answer()
    word = store.get(key).decode()
    if word != "ok":
        raise DataWaitError(f"rank {rank}: rank 0 failed to prepare {what}: {word[7:]}")


def prepare_data_in_job(config: DataConfig, seed: int = 0) -> tuple[Path, list[str]]:
    """:func:`~focus_pretrain.data.datasets.prepare_data` for a training or evaluation job
    (``in_job``: raw corpora need ``data.tokenize_in_job``): rank 0 prepares, the other ranks
    wait at most ``data.prepare_timeout_s`` and then read what rank 0 made."""
    return rank0_first(
        lambda: prepare_data(config, seed, in_job=True), timeout_s=config.prepare_timeout_s
    )
