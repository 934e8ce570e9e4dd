"""The event loop's polling of the links that posted receives wait on (one per transport).

Imports only the link interface (_link_interface.py) and the standard library; never the
transport (_link.py, which owns one LoopPolling), a kind's module or the public surface. It
exists apart from the transport so that the transport's module holds routing and matching, and
this one the one rule for when a waiting receive keeps the loop turning instead of sleeping.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from ._link_interface import Link

__all__ = ["LoopPolling"]

# Receives waiting for peers whose links poll (Link.poll_while_waiting) keep the event loop
# turning without sleeping for up to _POLL_S each. After _POLL_MISSES waits in a row outlast
# that, polling stops for _POLL_OFF_S and is then tried again, so a rank whose messages come
# rarely wastes a fraction of a percent of a core.
_POLL_S = 200e-6
_POLL_MISSES = 4
_POLL_OFF_S = 0.05


class LoopPolling:
    """Keeps the event loop turning, for a bounded time, while posted receives wait on links
    that ask for it (``poll_for``); one callback reschedules itself per turn.

    Args:
        links: the transport's links by peer (the same dict, kept current by the transport).
        get_loop: the transport's running event loop.
    """

    def __init__(self, links: dict[int, Link], get_loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self._links = links
        self._get_loop = get_loop
        self._polled: list[Callable[[], bool]] = []  # done() of each receive being polled for
        self._watched: dict[int, Link] = {}  # the links those receives wait on (Link.watch)
        self._poll_until = 0.0
        self._poll_misses = 0
        self._poll_off_until = 0.0
        self.arrivals = 0  # receives done while the loop was kept turning for them (diagnostics)

    def poll_for(self, src: int | None, done: Callable[[], bool]) -> None:
        """While a posted receive from ``src`` is not done, keep the event loop turning for up
        to _POLL_S, if ``src``'s link asks for it: the loop's non-blocking polls then read the
        message as soon as it comes, where an idle loop would sleep in the kernel and pay a
        wake-up. One callback per transport reschedules itself (yielding the CPU each turn, so a
        peer rank queued on our core gets it) and reads the links waited on in place, which
        watch meanwhile (Link.watch: a shm peer then hands over a small message without waking
        us); other callbacks and tasks run in between as usual, so nothing is delayed behind
        the polling."""
        link = self._links.get(src) if src is not None else None
        if link is None or not link.poll_while_waiting or done():
            return
        now = time.perf_counter()
        if now < self._poll_off_until:
            return
        self._poll_until = now + _POLL_S
        self._polled.append(done)
        if link.peer not in self._watched:
            self._watched[link.peer] = link
            link.watch(True, in_place=False)
        if len(self._polled) == 1:
            self._get_loop().call_soon(self._poll_turn)

    def _poll_turn(self) -> None:
        for link in tuple(self._watched.values()):
            link.read_now()  # (a watched link's peer puts small messages in memory without waking us)
        polled = self._polled
        waiting = [done for done in polled if not done()]
        if len(waiting) < len(polled):
            self.arrivals += len(polled) - len(waiting)
            self._poll_misses = 0
        if not waiting:
            self._stop()
            return
        if time.perf_counter() > self._poll_until:
            self._stop()
            self._poll_misses += 1
            if self._poll_misses >= _POLL_MISSES:
                self._poll_misses = 0
                self._poll_off_until = time.perf_counter() + _POLL_OFF_S
            return
        polled[:] = waiting
        os.sched_yield()
        self._get_loop().call_soon(self._poll_turn)

    def _stop(self) -> None:
        self._polled.clear()
        watched = tuple(self._watched.values())
        self._watched.clear()
        for link in watched:
            link.watch(False, in_place=False)  # (what it takes as it stops still arrives)
