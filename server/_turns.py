"""The coordinator's share of one event-loop turn: how long it has spent on requests since the turn
began, and the work put off to later turns once that share is spent (requests read but not yet
handled, replies decided but not yet written), run first come, first served. It keeps /healthz,
/metrics and status answering while thousands of hosts join at once. May import only the standard
library; the Coordinator (_coordinator.py) and its connections (_connection.py) use it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

__all__ = ["TURN_BUDGET", "Turns"]

# Seconds of request handling per loop turn before later requests wait for the next turn. Short
# enough that an admin request or an HTTP probe arriving in a storm is answered within a few
# turns; long enough that a turn is not mostly the loop's own overhead.
TURN_BUDGET = 0.01


class Turns:
    """Time spent in the current loop turn, and the work waiting for the next ones.

    ``spent`` is reset at the start of the turn after the one in which it first grew past a
    quarter of the budget: a light load schedules nothing, and a heavy one is measured from a
    point at most a quarter of the budget into its turn.
    """

    def __init__(self, budget: float = TURN_BUDGET) -> None:
        self.budget = budget
        self.spent = 0.0
        # This turn's share is spent: new work should wait (``later``). An attribute kept by
        # ``charge`` and the turn's start, not a property: every read of requests asks it.
        self.exhausted = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: collections.deque[Callable[[], None]] = collections.deque()
        self._next_turn_asked = False

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    @property
    def budget(self) -> float:
        """Seconds of request handling per loop turn; setting it also moves the point (a quarter
        of it) past which the next turn is scheduled."""
        return self._budget

    @budget.setter
    def budget(self, seconds: float) -> None:
        self._budget = seconds
        self._quarter = seconds / 4

    @property
    def backlog(self) -> int:
        """How many pieces of work wait for a later turn."""
        return len(self._waiting)

    def charge(self, seconds: float) -> None:
        spent = self.spent = self.spent + seconds
        if spent > self._quarter:
            if not self._next_turn_asked:
                self._ask_next_turn()
            self.exhausted = spent > self._budget

    def later(self, work: Callable[[], None]) -> None:
        """Run ``work`` in a later turn, after everything put off before it. ``work`` charges its
        own time (it is what it would have been, only later)."""
        self._waiting.append(work)
        if not self._next_turn_asked:
            self._ask_next_turn()

    def _ask_next_turn(self) -> None:
        assert self._loop is not None, "Turns.attach(loop) first"
        self._next_turn_asked = True
        self._loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._next_turn_asked = False
        self.spent = 0.0
        self.exhausted = False
        waiting = self._waiting
        while waiting and not self.exhausted:
            waiting.popleft()()
        if waiting and not self._next_turn_asked:
            self._ask_next_turn()

    def run_all(self) -> None:
        """Run everything waiting now, whatever the time (shutting down)."""
        waiting = self._waiting
        while waiting:
            waiting.popleft()()
