"""Progress reports and their cross-check for a job without a coordinator (it rendezvoused through a
store: the torch backend, file://, ``store=``).

May import foundations only (aiocoll._progress_check, aiocoll.stores, msgpack); never the public
surface. Runs on the event loop: there is no coordinator connection a thread could beat on.

The same reports as the coordinator path (client/_progress.py) and the same pure cross-check
(aiocoll._progress_check): every LOOK_EVERY seconds it asks the tracker for a report, which is
None while operations complete quickly, so nothing is written then. A rank with an operation
pending longer than the threshold writes its report under ``PREFIX/RANK`` in the store, reads the
reports of the other members of the groups it waits in, and runs the check itself. Members with
no fresh report are asked over the peer links (control message ``want``) to write one. A
mismatch fails the operation here and is told to the group's other ranks (the engine's control
notice), so every rank raises MismatchError; ranks found behind are named in a later timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import msgpack

from aiocoll._progress_check import JobProgress, ProgressError
from aiocoll.stores import Store

from .._progress import ProgressTracker

__all__ = ["LOOK_EVERY", "StoreProgress"]

log = logging.getLogger("aiocoll.client.progress")

LOOK_EVERY = 0.5
_ASK_AGAIN_AFTER = 1.0  # seconds before a rank asked for a report is asked again


class _Engine(Protocol):
    rank: int
    progress: ProgressTracker

    def ask_progress(self, ranks: list[int]) -> None: ...

    async def share_mismatch(self, gid: str, seq: int, ranks: list[int], why: str) -> None: ...


class StoreProgress:
    """Publishes this rank's progress in ``store`` under ``prefix`` and cross-checks on a stall.

    Args:
        engine: the engine whose tracker reports. store: the job's rendezvous store.
        prefix: keys are ``prefix + str(rank)`` (one prefix per rendezvous round).
    """

    def __init__(self, engine: _Engine, store: Store, prefix: str) -> None:
        self._engine = engine
        self._store = store
        self._prefix = prefix
        self._check = JobProgress()
        self._seen: dict[int, bytes] = {}  # the report bytes last taken per rank
        self._asked: dict[int, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._mine: dict[str, Any] | None = None  # this rank's latest report

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:
        tracker = self._engine.progress
        while True:
            await asyncio.sleep(LOOK_EVERY)
            full, tracker.wanted = tracker.wanted, False
            report = tracker.report(full)
            try:
                if report is not None:
                    self._mine = report
                    await self._store.set(self._prefix + str(self._engine.rank), msgpack.packb(report))
                if self._mine is not None and self._mine["ops"]:
                    await self._look(self._mine)  # while stalled, every look
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store went away: the job is ending or broken anyway
                log.debug("rank %d: progress through the store failed: %r", self._engine.rank, exc)

    async def _look(self, mine: dict[str, Any]) -> None:
        """Read the other members' reports and cross-check them with ours."""
        now = time.monotonic()
        verdicts = []
        members = sorted({r for op in mine["ops"] if op["s"] >= 0 for r in op["n"]})
        for rank in members:
            key = self._prefix + str(rank)
            if rank != self._engine.rank and not await self._store.check([key]):
                continue
            raw = msgpack.packb(mine) if rank == self._engine.rank else await self._store.get(key)
            if self._seen.get(rank) == raw:
                continue  # unchanged: keep the time it was first taken (freshness)
            self._seen[rank] = raw
            try:
                verdicts += self._check.update(rank, msgpack.unpackb(raw), now, time.time())
            except (ProgressError, ValueError, TypeError) as exc:
                log.warning(
                    "rank %d: rank %d's progress report is malformed: %s", self._engine.rank, rank, exc
                )
        for v in verdicts + self._check.recheck(now):
            if v.kind == "mismatch":
                await self._engine.share_mismatch(v.group, v.seq, list(v.ranks), v.message)
            else:
                log.warning("rank %d: %s", self._engine.rank, v.message)  # it names the group and seq
                self._engine.progress.note_behind(v.group, v.seq, v.ranks, v.message)
        ask = [
            r
            for r in sorted(self._check.wanted)
            if r != self._engine.rank and now - self._asked.get(r, 0.0) >= _ASK_AGAIN_AFTER
        ]
        if ask:
            for r in ask:
                self._asked[r] = now
            self._engine.ask_progress(ask)
