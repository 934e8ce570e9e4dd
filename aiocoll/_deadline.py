"""One timeout budget: a deadline computed once and passed down; imports nothing from aiocoll.

A caller's ``timeout`` becomes a Deadline at the public surface; every layer below asks it for
the remainder instead of restarting its own clock, so nested waits never exceed the budget.
The clock is injectable so timing logic can be tested without sleeping.
"""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable

__all__ = ["Deadline", "to_seconds"]


def to_seconds(timeout: float | datetime.timedelta | None) -> float | None:
    """Normalise a timeout given as seconds or timedelta; None means never.

    Raises:
        ValueError: for a negative or NaN timeout.
    """
    if timeout is None:
        return None
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout must be a non-negative number of seconds or None, got {timeout!r}")
    return seconds


class Deadline:
    """A point in time after which waits give up; ``Deadline(None)`` never expires."""

    __slots__ = ("_clock", "_expires_at", "timeout")

    def __init__(
        self,
        timeout: float | datetime.timedelta | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout = to_seconds(timeout)
        self._clock = clock
        self._expires_at = None if self.timeout is None else clock() + self.timeout

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None when there is no deadline."""
        if self._expires_at is None:
            return None
        return max(0.0, self._expires_at - self._clock())

    def expired(self) -> bool:
        return self._expires_at is not None and self._clock() >= self._expires_at

    def __repr__(self) -> str:
        return f"Deadline(timeout={self.timeout}, remaining={self.remaining()})"
