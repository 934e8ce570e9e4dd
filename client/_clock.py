"""This process's estimate of the coordinator's wall clock, so that the times of ranks on
different hosts line up (the timeline's arrivals, the flight recorder's dumps).

The beat thread (client/control/_beat.py) sends a heartbeat every second; the coordinator's reply
carries its wall clock (``t``). A heartbeat sent at ``sent`` and answered at ``received`` (this
host's time.time()) gives the offset ``t - (sent + received) / 2``, true to within half the
round trip. As NTP does, the estimate is the sample with the shortest round trip among the last
WINDOW: a round trip lengthened by a busy host or network says little about the offset.

May import only the standard library. Samples come from beat threads, readers are any thread:
the estimate is one tuple, replaced whole.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["WINDOW", "ClockEstimate", "estimate"]

WINDOW = 32


class ClockEstimate:
    """The offset to add to this host's time.time() to get the coordinator's, from samples."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._lock = threading.Lock()
        # (offset, error) in seconds: the coordinator's time is time.time() + offset, to within
        # error; None until the first sample.
        self.current: tuple[float, float] | None = None

    def sample(self, sent: float, coordinator: float, received: float) -> None:
        """A heartbeat sent at ``sent``, answered at ``received`` (both time.time() here), whose
        reply said the coordinator's time was ``coordinator``."""
        rtt = received - sent
        if rtt < 0:  # this host's clock stepped back between the two readings
            return
        with self._lock:
            self._samples.append((rtt, coordinator - (sent + received) / 2))
            best_rtt, offset = min(self._samples)
            self.current = (offset, best_rtt / 2)


_process = ClockEstimate()


def estimate() -> ClockEstimate:
    """The estimate of this process (every engine's beat thread talks to its job's coordinator)."""
    return _process
