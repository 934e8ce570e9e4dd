"""The wake-ups of this process's arena groups: one ShmWaker per process watches the process's
eventfd (client.data._shm's ShmHost.efd) in the event loop and resumes the groups sleeping on it.

Imports client.data._shm (ShmHost) only; never the public surface, and never the groups'
scheduler (client.data._shm_sched), whose groups it resumes as ``_Sleeper``s. Publishers write
the eventfd of a member whose sleeping flag is up (client.data._shm_sched's ``_publish``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Protocol

from ._shm import ShmHost

__all__ = ["ShmWaker"]


class _Sleeper(Protocol):
    """A group sleeping on the eventfd (client.data._shm_sched.ShmScheduler)."""

    def _wake(self) -> None: ...


class ShmWaker:
    """Watches this process's eventfd and resumes the groups sleeping on it."""

    def __init__(self, host: ShmHost) -> None:
        self._efd = host.efd
        self._loop = asyncio.get_running_loop()
        self.sleeping: set[_Sleeper] = set()
        self.wakeups = 0
        self.watch()

    def watch(self) -> None:
        self._loop.add_reader(self._efd, self._on_wake)

    def unwatch(self) -> None:
        """Stop watching for a while (a wait napping in place off the loop's thread: the loop
        thread, woken by the same write, would only compete with it for the CPU)."""
        self._loop.remove_reader(self._efd)

    def drain(self) -> None:
        """Take a write waiting on the eventfd, if any (it is non-blocking)."""
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)

    def _on_wake(self) -> None:
        self.drain()
        self.wakeups += 1
        self.resume()

    def resume(self) -> None:
        for group in list(self.sleeping):
            group._wake()

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._efd)
