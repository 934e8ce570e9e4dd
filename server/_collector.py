"""Pacing of Python's cyclic garbage collector in a coordinator's process: the young generations
are collected as usual, but the full collection, which walks every live object (hundreds of
milliseconds once 100,000 members are held), runs at a quiet moment every FULL_EVERY seconds
instead of each time the heap has grown by a quarter (a stall every second or two while a large
job joins, just when every answer is awaited). May import only the standard library; the
Coordinator (_coordinator.py) starts and stops it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

__all__ = ["FULL_EVERY", "CollectorPacing"]

log = logging.getLogger("aiocoll.server")

# Seconds between full collections (they reclaim reference cycles, such as a forgotten job's).
FULL_EVERY = 60.0
# A busy coordinator postpones a due collection by this much at a time, for at most QUIET_WAIT_MAX.
_RETRY = 1.0
QUIET_WAIT_MAX = 300.0
# Full collections never start on their own while any coordinator in the process paces them.
_NEVER = 1 << 30

_pacers = 0
_saved_threshold: tuple[int, int, int] | None = None


class CollectorPacing:
    """Hold off the automatic full collection while started; run it when ``busy()`` says the
    coordinator is quiet (or has been busy for QUIET_WAIT_MAX). A process with the collector
    disabled is left as it is."""

    def __init__(self, loop: asyncio.AbstractEventLoop, busy: Callable[[], bool]) -> None:
        self._loop = loop
        self._busy = busy
        self._timer: asyncio.TimerHandle | None = None
        self._due_since = 0.0
        self.full_collections = 0
        self.last_pause = 0.0
        self._started = False

    def start(self) -> None:
        global _pacers, _saved_threshold
        if self._started or not gc.isenabled():
            return
        self._started = True
        if _pacers == 0:
            _saved_threshold = gc.get_threshold()
            young, middle, _ = _saved_threshold
            gc.set_threshold(young, middle, _NEVER)
        _pacers += 1
        self._timer = self._loop.call_later(FULL_EVERY, self._due)

    def stop(self) -> None:
        global _pacers
        if not self._started:
            return
        self._started = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        _pacers -= 1
        if _pacers == 0 and _saved_threshold is not None:
            gc.set_threshold(*_saved_threshold)

    def _due(self) -> None:
        now = time.monotonic()
        if not self._due_since:
            self._due_since = now
        if self._busy() and now - self._due_since < QUIET_WAIT_MAX:
            self._timer = self._loop.call_later(_RETRY, self._due)
            return
        self._due_since = 0.0
        began = time.perf_counter()
        found = gc.collect()
        self.last_pause = time.perf_counter() - began
        self.full_collections += 1
        log.debug("event=gc_full seconds=%.3f unreachable=%d", self.last_pause, found)
        self._timer = self._loop.call_later(FULL_EVERY, self._due)
