"""How a rank waits for a peer on this host: the one wait policy every waiter follows.

Imports only the standard library; the waiters (the arenas' scheduler in client/data/_shm_sched.py,
the shared-memory link's sides in transports/_shm_outbound.py and _shm_inbound.py, the links'
receive polling in transports/_in_place.py and transports/_loop_polling.py, the TCP link's
in-payload polling in client/data/_peer.py) each own what they wait on (a counter in an arena,
room in a ring, a socket) and how they sleep in the event loop; how long they spin, when they
yield the CPU and when they sleep is decided here.

The policy, in the order a wait goes through it:

1. **Spin** without yielding for a few microseconds (``spin(plain_s=...)``): a peer on another
   core answers within them. Not where the host has fewer cores than ranks (``oversubscribed``):
   the peer is then likely queued behind us.
2. **Yield** the CPU before each further check (``os.sched_yield``), up to an adaptive budget
   (``SpinBudget``: halved after a wait that ended in sleep, doubled back after one that did
   not, so a slow peer is not spun for). The rank we wait for may be queued on our core, and
   only a yield lets it run. With more ranks than cores, a yield that handed the core to another
   task for a moment (``HANDOFF_S`` .. ``LATE_YIELD_S``: a peer's turn) is not charged.
3. **Sleep** on a file descriptor (an eventfd the peer writes, a socket), in the event loop or
   in place (``nap``), once the budget is spent.

Between the steps of a large operation, where the peers are a copy away, a waiter spins on while
the host has a free core (``host_contended``: the kernel's count of runnable tasks), and yields
when it does not, unless a yield came back late (``LATE_YIELD_S``: other work held the core for
a time slice), after which it naps on its descriptor for a while (the late-yield rule): a woken
sleeper gets the core back ahead of busy processes, where a yielding spinner queues behind them.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Callable

__all__ = [
    "HANDOFF_S",
    "LATE_YIELD_S",
    "PLAIN_SPIN_S",
    "SPIN_MIN_S",
    "SpinBudget",
    "host_contended",
    "nap",
    "oversubscribed",
    "spin",
]

SPIN_MIN_S = 5e-6  # a budget never shrinks below this
PLAIN_SPIN_S = 10e-6  # the first stage's checks without yielding (a peer on another core)
LATE_YIELD_S = 200e-6  # a yield that returns later than this: other work held our core
HANDOFF_S = 3e-6  # a yield that returns later than this ran another task (a peer rank's turn)

_CPUS = os.cpu_count() or 1
_LOADAVG_FD: int | None = None


def oversubscribed(ranks_on_host: int) -> bool:
    """More ranks on this host than cores: a waiting rank's spin holds a core a peer needs."""
    return ranks_on_host > _CPUS


def host_contended() -> bool:
    """Whether more tasks are runnable on this host than it has cores (this one included):
    the kernel's instantaneous count, the fourth field of /proc/loadavg ("2/95")."""
    global _LOADAVG_FD
    try:
        if _LOADAVG_FD is None:
            _LOADAVG_FD = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        field = os.pread(_LOADAVG_FD, 128, 0).split()[3]
        return int(field.split(b"/")[0]) > _CPUS
    except (OSError, IndexError, ValueError):
        return True  # no count to go by: do not hold a core we may not have


class SpinBudget:
    """How long the next spin may yield and check (seconds): halved after a spin that failed,
    doubled back (up to ``most``) after one that succeeded."""

    __slots__ = ("most", "now")

    def __init__(self, most: float) -> None:
        self.most = most
        self.now = most


def spin(ready: Callable[[], bool], budget: SpinBudget, plain_s: float = 0.0, handoffs: int = 0) -> bool:
    """Wait for ``ready()`` by the policy's first two stages; True once it holds, False when the
    budget ran out (the caller then sleeps).

    Args:
        ready: the condition, checked once per turn.
        budget: adapts to how the spin ended.
        plain_s: at most this long of checks without yielding first.
        handoffs: of the yields, at most this many that briefly ran another task are not charged.
    """
    spent = budget.now
    if spent <= 0:
        return False
    clock = time.perf_counter
    start = clock()
    stop = start + spent
    plain = start + min(spent, plain_s)
    while clock() < plain:
        if ready():
            return True
    sched_yield = os.sched_yield
    while True:
        if handoffs:
            before = clock()
            sched_yield()
            took = clock() - before
            if HANDOFF_S < took < LATE_YIELD_S:
                handoffs -= 1
                stop += took
        else:  # (no clock read to time the yield: it would only make each look longer)
            sched_yield()
        if ready():
            budget.now = min(budget.most, spent * 2)
            return True
        if clock() > stop:
            budget.now = max(SPIN_MIN_S, spent / 2)
            return False


def nap(fd: int, ready: Callable[[], bool], stop: float) -> tuple[bool, bool, int]:
    """Block on ``fd`` (an eventfd a peer writes) in place, without the event loop, until
    ``ready()`` holds or the clock (time.perf_counter) reaches ``stop``; the caller has told
    the peers it sleeps. Returns (ready, whether a wake-up was consumed, naps taken)."""
    woke = False
    naps = 0
    while not ready():
        left = stop - time.perf_counter()
        if left <= 0:
            return False, woke, naps
        naps += 1
        if select.select((fd,), (), (), left)[0]:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(fd)
            woke = True
    return True, woke, naps
