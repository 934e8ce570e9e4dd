"""A receive's in-place wait: its source's link read in place by the wait policy's spin, and the
rules that end it (one InPlaceWaits per transport, one InPlaceReceive per wait).

Imports only foundations (aiocoll._errors, aiocoll._matching, aiocoll.algorithms._transport), the
wait policy (client/data/_waiting.py) and the link interface (_link_interface.py); never the
transport (_link.py, whose ``recv_now`` hands its receives here once nothing is here yet), a
kind's module or the public surface. It exists apart from the transport so that the spin's
budget, its stop rules and their counts live in one place beside the one receive they wait for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiocoll._errors import MismatchError
from aiocoll._matching import Matcher, Polled
from aiocoll.algorithms._transport import Tag

from .._waiting import LATE_YIELD_S, PLAIN_SPIN_S, SPIN_MIN_S, SpinBudget, oversubscribed, spin
from ._link_interface import Link

__all__ = ["InPlaceReceive", "InPlaceWaits"]

# A receive that can complete inside its call (recv_now) reads its peer's link in place for up to
# this long (the wait policy's spin, client/data/_waiting.py) before it waits in the event loop.
# A reply takes the peer's receive and send, tens of microseconds of Python each, and a sleep
# in the loop costs a wake-up of about as much again: a shorter budget misses most replies. The
# budget halves after each miss, so a rank whose messages come late soon spins for little (it
# adapts on its own: the pause of the loop's polling after misses does not stop it).
_STRAIGHT_SPIN_S = 1e-3
# ... unless the peer waits for us meanwhile (Link.peer_waits), for at least this long: it sends
# nothing before its own wait ends, so spinning on only holds both ranks up. (Not at once: a peer
# that has just taken our last message still says it waits for a moment.)
_MUTUAL_WAIT_S = 20e-6

_LATE_YIELD, _PEER_WAITS = 1, 2  # why a rule ended an in-place wait (InPlaceReceive.stopped)


class InPlaceWaits:
    """The transport's in-place waits (``receive``): the spin's budget, the wait policy's first
    stage for this host's links, the last spin that ran out, and counts for diagnostics.

    Args:
        matcher: the transport's matcher.
        sends: how many messages the transport has sent so far (read when a spin runs out, and
            when a receive comes after that: see ``came_after_miss``).
    """

    def __init__(self, matcher: Matcher, sends: Callable[[], int]) -> None:
        self.matcher = matcher
        self._sends = sends
        self.budget = SpinBudget(_STRAIGHT_SPIN_S)
        # the wait policy's first stage for a spin: checks without yielding, unless this host
        # has more ranks than cores (links_changed)
        self.plain_s = 0.0
        self._polling_links = 0  # this host's links (Link.poll_while_waiting)
        self.links_changed(0)
        # the last spin that ran out: its peer, when it started, the sends made by the time it
        # ran out
        self.missed: tuple[int, float, int] | None = None
        # receives done in a spin, and spins that stopped as their peer waited for us, or as
        # other work held our core (diagnostics)
        self.arrivals = 0
        self.mutual_waits = 0
        self.late_yields = 0

    def links_changed(self, change: int) -> None:
        """``change`` links of this host's (Link.poll_while_waiting) were attached (+1) or closed
        (-1): sets the first stage by how many ranks this host has."""
        self._polling_links += change
        self.plain_s = 0.0 if oversubscribed(1 + self._polling_links) else PLAIN_SPIN_S

    def receive(
        self, link: Link, src: int, tag: Tag, into: memoryview, straight: bool
    ) -> tuple[int, dict[str, Any]] | None:
        """recv_now's wait for the next message ``tag`` from ``src`` into ``into`` (``straight``:
        nothing in the matcher comes before it, and ``link`` was read already): ``link`` read in
        place by the wait policy's spin (InPlaceReceive.look), with the link watching (see
        LinkTransport.recv_now for when it stops); the message's (src, meta), or None when it
        did not come and nothing is left posted.

        Raises:
            MismatchError: the message's payload is not ``len(into)`` bytes (it is consumed).
        """
        wait = InPlaceReceive(self, link, src, tag, into, straight)
        try:
            if straight or not wait.look():  # (a straight receive has read what came already)
                budget = self.budget
                before = budget.now
                started = wait.seen = time.perf_counter()
                link.watch(True)
                try:
                    self.missed = None
                    if not spin(wait.look, budget, self.plain_s):  # ran out: see came_after_miss
                        self.missed = (src, started, self._sends())
                    elif wait.arrived():
                        self.arrivals += 1
                    elif wait.stopped == _PEER_WAITS:
                        # The peer could not send before its own wait ended: spinning was no use,
                        # as with two ranks that each receive before they send, so spin for less
                        # next time.
                        budget.now = max(SPIN_MIN_S, before / 2)
                    else:
                        budget.now = before  # (a late yield says nothing of when the peer answers)
                finally:
                    link.watch(False)  # (what the link takes as it stops watching still comes here)
        finally:
            if wait.polled is not None:
                self.matcher.unpoll(wait.polled)
        return wait.outcome()

    def came_after_miss(self, src: int | None) -> None:
        """A receive from ``src`` got its message while waiting in the loop, after the last spin
        ran out (``missed``): when its message came within the most a spin may last, and this
        rank sent nothing since the spin ran out that the message may have answered (a send
        made during the spin, by a callback of a message it read, would have been answered
        inside a longer spin too), a longer spin would have taken it
        without the sleep, so the budget grows to twice that wait. Without this, misses in a row
        (a peer held off the CPU for a while) would leave the budget too short to ever take a
        reply again, and so never grow back."""
        missed = self.missed
        if missed is None or missed[0] != src:
            return
        self.missed = None
        waited = time.perf_counter() - missed[1]
        budget = self.budget
        if waited < budget.most and self._sends() == missed[2]:
            budget.now = min(budget.most, max(budget.now, 2 * waited))


class InPlaceReceive:
    """One receive while it reads its source's link in place: straight from the link while
    nothing in the matcher comes before it (Link.take_now), else, and from the first time the
    link brings anything else, polled through the matcher (Matcher.poll), which then decides
    every message as it does for any receive. ``look`` is one read and the wait policy's rules
    for the spin: the late yield, and the peer that waits for us."""

    __slots__ = ("got", "into", "link", "polled", "seen", "since", "src", "stopped", "tag", "waits")

    def __init__(
        self, waits: InPlaceWaits, link: Link, src: int, tag: Tag, into: memoryview, straight: bool
    ) -> None:
        self.waits = waits
        self.link = link
        self.src = src
        self.tag = tag
        self.into = into
        self.polled: Polled | None = None if straight else waits.matcher.poll(src, tag, into)
        self.got: tuple[int, dict[str, Any]] | BaseException | None = None  # (straight from the link)
        # when the spin last looked, since when the peer has been seen waiting for us (0: not),
        # and which rule ended the spin (0: none)
        self.seen = self.since = 0.0
        self.stopped = 0

    def look(self) -> bool:
        """Read the link once: True once the receive is done, or the link closed (the waiting
        path reports that). In the spin (``seen``: when it last looked), then the wait policy's
        rules: True when they end the wait."""
        polled = self.polled
        if polled is None:
            here = self.link.take_now(self.tag, self.into)
            if here is True:  # something else came (to the matcher): through it from now on
                matcher = self.waits.matcher
                try:
                    got = matcher.take(self.src, self.tag, self.into)  # (it may be this receive's)
                except MismatchError as exc:
                    self.got = exc
                    return True
                if got is not None:
                    self.got = got
                    return True
                polled = self.polled = matcher.poll(self.src, self.tag, self.into)  # (read below)
            elif here is not False:
                self.got = here
                return True
        if polled is not None:
            link = self.link  # (nothing read: nothing changed)
            if (link.read_now() or link.closed) and (polled.done() or link.closed):
                return True
        seen = self.seen
        if not seen:  # (the look before the spin)
            return False
        now = time.perf_counter()
        if now - seen > LATE_YIELD_S:
            # Other work held our core for a time slice: a rank woken from sleep gets it back
            # ahead of busy processes, where a spinner that yields queues behind them.
            self.waits.late_yields += 1
            self.stopped = _LATE_YIELD
            return True
        self.seen = now
        if not self.link.peer_waits():
            self.since = 0.0
        elif not self.since:
            self.since = now
        elif now - self.since > _MUTUAL_WAIT_S:
            self.waits.mutual_waits += 1
            self.stopped = _PEER_WAITS
            return True
        return False

    def arrived(self) -> bool:
        polled = self.polled
        return self.got is not None if polled is None else polled.done()

    def outcome(self) -> tuple[int, dict[str, Any]] | None:
        """The message's source and meta, None when it did not come (call after the link stopped
        watching).

        Raises:
            MismatchError: the message's payload is not ``len(into)`` bytes (it is consumed).
        """
        if self.polled is not None:
            return self.polled.outcome()
        got = self.got
        if got is None:  # (what the link took as it stopped watching went to the matcher)
            return self.waits.matcher.take(self.src, self.tag, self.into)
        if isinstance(got, BaseException):
            raise got
        return got
