"""Per-peer links behind one interface, and the one process-level transport they plug into.

Imports only foundations (aiocoll._errors, aiocoll._deadline, aiocoll._matching,
aiocoll.algorithms._transport) and the wait policy (client/data/_waiting.py); never the public
surface. A link kind is a plug-in: adding one (as shm was added beside tcp) means writing a
``Link`` subclass and its connector (see _factory.py), nothing else; the engine, the driver and
the matcher never learn which kind carries a message.

The interface, both directions:

``Link`` (one object per peer, made by its kind's connector) must provide
  - ``peer`` (the other end's global rank), ``kind`` (a class attribute: "tcp", "memory", ...)
    and ``closed`` (True once closed, never reset);
  - ``send_nowait(tag, payload, meta)``: queue one message, FIFO with every other message on this
    link; return None once ``payload`` was handed off (the caller may reuse it), else an awaitable
    that finishes when it was. Cancelling that awaitable withdraws the message if none of it has
    left yet (the stream stays whole either way). Raise PeerLostError when the link is closed;
  - ``pause_reading()`` / ``resume_reading()``: stop and restart taking messages from the peer
    (the matcher calls them for backpressure; a paused link must make its peer's sends wait once
    whatever buffering the medium has is full, never drop or reorder);
  - ``close(reason, lost=...)``: close at once (queued sends fail with PeerLostError); ``lost``
    says whether this was unexpected (a crash, a cut) or orderly; twice is fine;
  - ``aclose()``: an orderly goodbye (the peer sees an orderly close), bounded in time, then
    ``close(..., lost=False)``; twice is fine;
  - ``debug_state()``: a small dict for diagnosing a stuck operation.

and must report to its ``LinkHost`` (the LinkTransport it was attached to):
  - every message it takes from the peer, to ``host.matcher``: ``claim(peer, tag, nbytes)`` when it
    learns a payload's length before its bytes (land them where it answers, then
    ``landed(peer, tag, meta, payload)``), or ``arrived(peer, tag, meta, payload)`` for a whole
    message it did not claim (the matcher keeps ``payload`` without copying: it must stay valid);
  - its closing, once, to ``host.link_closed(link, reason, lost)``, from inside ``close``.

``LinkTransport`` (one per process) is the Transport of aiocoll/algorithms/_transport.py over a
dict of links, one per peer, of any mix of kinds: it routes sends by destination, matches every
receive with its one Matcher, turns a link's close into PeerLostError for the receives bound to
that peer, and runs the lost-peer handlers. A connector makes a link and calls ``attach(link)``;
``wait_links(peers, deadline)`` waits until every expected peer has one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection
from typing import Any, ClassVar, Protocol

from aiocoll._deadline import Deadline
from aiocoll._errors import DistError, MismatchError, PeerLostError, RendezvousError
from aiocoll._matching import Matcher, Polled, Posted
from aiocoll.algorithms._transport import (
    LandedCallback,
    LostPeerHandler,
    RecvCallback,
    StrayHandler,
    Tag,
    Transport,
)

from .._waiting import LATE_YIELD_S, PLAIN_SPIN_S, SPIN_MIN_S, SpinBudget, oversubscribed, spin

__all__ = ["Link", "LinkHost", "LinkTransport", "as_bytes_view"]

log = logging.getLogger("aiocoll.client.links")

_EMPTY = memoryview(b"")
# Receives waiting for peers whose links poll (Link.poll_while_waiting) keep the event loop
# turning without sleeping for up to _POLL_S each. After _POLL_MISSES waits in a row outlast
# that, polling stops for _POLL_OFF_S and is then tried again, so a rank whose messages come
# rarely wastes a fraction of a percent of a core.
_POLL_S = 200e-6
_POLL_MISSES = 4
_POLL_OFF_S = 0.05
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


def as_bytes_view(buf: memoryview) -> memoryview:
    """``buf`` as a flat byte view (no copy); the empty view for an empty buffer."""
    if buf.format == "B" and buf.ndim == 1:
        return buf
    if not len(buf):
        return _EMPTY
    return buf.cast("B")


class LinkHost(Protocol):
    """What a link reports to (a LinkTransport)."""

    matcher: Matcher

    def link_closed(self, link: Link, reason: str, lost: bool) -> None: ...


class Link(ABC):
    """One peer's link, of one kind (see the module header for the whole contract)."""

    kind: ClassVar[str]
    peer: int
    closed: bool
    # Whether a receive waiting for this peer keeps the event loop polling for a bounded time
    # (LinkTransport._poll_while_waiting) rather than letting it sleep: for peers whose messages
    # come within microseconds (this host), a sleep and its wake-up cost more than the wait.
    poll_while_waiting: ClassVar[bool] = False

    @abstractmethod
    def send_nowait(self, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> Awaitable[None] | None:
        """Queue one message; None once handed off, else an awaitable finishing the hand-off.

        Raises:
            PeerLostError: the link is closed.
        """

    def read_now(self) -> bool:
        """Take in what the peer sent so far, here and now, as the event loop's reader would
        (its frames are dispatched to the matcher the same way); True when a frame came. A
        receive that expects a reply within microseconds polls with this instead of letting the
        loop sleep (LinkTransport.recv_now). Links without such a read return False."""
        return False

    def take_now(self, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | bool:
        """``read_now`` for a receive of the next message ``tag`` from this peer, when nothing
        in the matcher comes before it (LinkTransport.recv_now): a message that the link holds
        whole in memory of its own (the shm kind's mailbox), of that tag and ``len(into)``
        bytes, is copied into ``into`` and its (peer, meta) returned; else True when something
        else came (handed to the matcher, or announced and left for ``read_now``: the receive
        then goes through the matcher), False when nothing did."""
        return self.read_now()

    def peer_waits(self) -> bool:
        """Whether the peer waits in place for a message from us (its receive's spin, ``watch``)
        and has taken in all we sent: then it sends us nothing before its wait ends. Links
        that cannot tell return False."""
        return False

    def watch(self, on: bool, in_place: bool = True) -> None:
        """A receive starts (True) or stops (False) calling ``read_now`` in a spin (``in_place``),
        or the event loop's polling turns do (LinkTransport._poll_turn): a link whose peer can
        hand it a message in memory while it is read (the shm kind's mailbox) tells the peer so,
        which then need not wake this rank, and takes what came as it stopped. Others do
        nothing."""
        return None

    @abstractmethod
    def pause_reading(self) -> None:
        """Stop taking messages from the peer (its sends wait once the medium's buffers fill)."""

    @abstractmethod
    def resume_reading(self) -> None:
        """Take messages from the peer again."""

    @abstractmethod
    def close(self, reason: str, *, lost: bool) -> None:
        """Close at once; reports to the host once. Twice is fine."""

    @abstractmethod
    async def aclose(self) -> None:
        """Say goodbye (bounded in time), then close as orderly. Twice is fine."""

    @abstractmethod
    def debug_state(self) -> dict[str, Any]:
        """A small dict for diagnosing a stuck operation."""


class _Notify:
    """A posted receive's completion that hands the outcome straight to a callback, from inside
    the event that decided it (``post_recv``): no future, no task, no loop iteration."""

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: RecvCallback | LandedCallback) -> None:
        self._callback: Any = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:  # (src, meta), or (src, meta, memory) when in place
        self._hand_over(result, None)

    def set_exception(self, exception: BaseException) -> None:
        self._hand_over(None, exception)

    def cancel(self) -> bool:
        if self._done:
            return False
        self._hand_over(None, asyncio.CancelledError())
        return True

    def _hand_over(self, result: tuple[int, dict[str, Any]] | None, exc: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._callback(result, exc)
        except Exception:  # the link's reading state must survive a faulty callback
            log.exception("a receive callback failed")


class LinkTransport(Transport):
    """The process's transport over one link per peer (any mix of kinds) and one Matcher.

    Args:
        rank, world_size: this process's global rank and the job's size (None: set later by
            ``assign``, once rendezvous has told them).
        inbox_bytes, inbox_messages: per-peer bounds on messages buffered before their receive.
    """

    def __init__(
        self,
        rank: int | None,
        world_size: int | None,
        *,
        inbox_bytes: int = 64 * 1024 * 1024,
        inbox_messages: int = 8192,
    ) -> None:
        self.rank = -1
        self.world_size = 0
        self.matcher = Matcher(inbox_bytes=inbox_bytes, inbox_messages=inbox_messages, landing=_landing)
        self._identity: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._links: dict[int, Link] = {}
        self._ended: dict[int, PeerLostError] = {}  # how each closed link ended, by its peer
        self.links_version = 0  # changes whenever a link is attached or closed (providers re-select)
        self._link_ready: dict[int, asyncio.Future[None]] = {}
        # Peers whose link was taken into service, even if it has closed since: such a peer was
        # there when the group formed. A peer may form a group, use it and leave before a slower
        # member has finished forming it; that member's forming succeeds and its operations with
        # that peer then fail as with any peer gone (torch's new_subgroups, destroyed in turn).
        self._was_linked: set[int] = set()
        self._handlers: list[LostPeerHandler] = []
        self._closed = False
        # Per-process state of link kinds that have some (the shm kind's arena), by kind name,
        # and what to close with the transport.
        self.kind_state: dict[str, Any] = {}
        self._closers: list[Callable[[], None]] = []
        self._polled: list[Callable[[], bool]] = []  # done() of each receive being polled for
        self._watched: dict[int, Link] = {}  # the links those receives wait on (Link.watch)
        self._poll_until = 0.0
        self._poll_misses = 0
        self._poll_off_until = 0.0
        # receives done while this rank polled for them, in place (recv_now) or with the event
        # loop kept turning (_poll_while_waiting), instead of sleeping (diagnostics)
        self.polled_arrivals = 0
        self._straight_spin = SpinBudget(_STRAIGHT_SPIN_S)
        # the wait policy's first stage for an in-place spin (_spin_for): checks without
        # yielding, unless this host has more ranks than cores; for the links of links_version
        self._plain_s = 0.0
        self._plain_for = -1
        # the last in-place spin that ran out: its peer, when it started, the sends made before it
        self._missed: tuple[int, float, int] | None = None
        self._sends = 0  # messages sent so far (see _posted_result)
        # in-place receives that stopped as their peer waited for us, or as other work held our
        # core (diagnostics)
        self.mutual_waits = 0
        self.late_yields = 0
        if rank is not None and world_size is not None:
            self.assign(rank, world_size)

    # -- setup -----------------------------------------------------------------------------
    def assign(self, rank: int, world_size: int) -> None:
        """Fix this process's rank once rendezvous has assigned it (before links are made).

        Raises:
            ValueError: rank outside 0..world_size-1.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.matcher.assign(rank, world_size)
        if self._identity is not None and not self._identity.done():
            self._identity.set_result(None)

    async def _known_identity(self) -> None:
        if self.world_size:
            return
        if self._identity is None:
            self._identity = self._get_loop().create_future()
        await asyncio.shield(self._identity)

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def _ready_future(self, peer: int) -> asyncio.Future[None]:
        """Resolved once ``peer`` has a link (failed if it cannot have one)."""
        fut = self._link_ready.get(peer)
        if fut is None:
            fut = self._get_loop().create_future()
            self._link_ready[peer] = fut
            if peer in self._links or peer in self._was_linked:
                fut.set_result(None)
            elif peer in self.matcher.lost:
                fut.set_exception(self._lost_error(peer))
                fut.exception()
        return fut

    def attach(self, link: Link) -> None:
        """Take ``link`` into service for its peer (a connector calls this once per peer).

        Raises:
            ValueError: the peer already has a link.
        """
        peer = link.peer
        if self._closed:
            link.close("this rank's transport is closed", lost=False)
            return
        if peer in self._links:
            raise ValueError(f"rank {peer} already has a {self._links[peer].kind} link to rank {self.rank}")
        self._links[peer] = link
        self._was_linked.add(peer)
        self.links_version += 1
        self.matcher.attach(peer, link)
        fut = self._link_ready.get(peer)
        if fut is not None and not fut.done():
            fut.set_result(None)

    def has_link(self, peer: int) -> bool:
        """Whether ``peer`` has (or had) a link."""
        return peer in self._links or peer in self.matcher.lost

    def fail_link(self, peer: int, exc: BaseException) -> None:
        """A connector could not make ``peer``'s link: ``wait_links`` raises ``exc``."""
        fut = self._ready_future(peer)
        if not fut.done():
            fut.set_exception(exc)
            fut.exception()

    async def wait_links(self, peers: Collection[int], deadline: Deadline) -> None:
        """Wait until every rank in ``peers`` has a link.

        Raises:
            RendezvousError: some did not within the deadline (names them); or what a connector
                passed to ``fail_link``.
        """
        waits = [self._ready_future(p) for p in peers]
        if not waits:
            return
        done, pending = await asyncio.wait(
            waits, timeout=deadline.remaining(), return_when=asyncio.FIRST_EXCEPTION
        )
        for fut in done:
            fut.result()
        if pending:
            missing = sorted(p for p in peers if not self._link_ready[p].done())
            raise RendezvousError(
                f"rank {self.rank}: no peer link with rank(s) {missing} within the rendezvous "
                f"timeout; check that they run, share the token and job, and can reach each "
                f"other's advertised addresses"
            )

    def link(self, peer: int) -> Link | None:
        """``peer``'s link while it is open."""
        return self._links.get(peer)

    def link_kinds(self) -> dict[int, str]:
        """Each linked peer's link kind."""
        return {peer: link.kind for peer, link in self._links.items()}

    # -- LinkHost ---------------------------------------------------------------------------
    def link_closed(self, link: Link, reason: str, lost: bool) -> None:
        peer = link.peer
        self._ended.setdefault(peer, PeerLostError(peer, reason, left=not lost))
        if self._links.get(peer) is link:
            del self._links[peer]
            self.links_version += 1
        loop = self._loop
        if loop is None or self._closed or loop.is_closed():
            self._peer_gone(peer, reason, lost)
            return
        # What the peer sent before its goodbye or end-of-file came in the same read: its
        # messages are delivered already, and its control notices (it gave up on an operation,
        # found a mismatch, left a group) wake their receivers in the next turn. The loss is
        # acted on after them, so that what fails here fails with the cause the peer told, not
        # with its leaving, on every kind of link.
        loop.call_soon(self._peer_gone, peer, reason, lost)

    def take_in_from(self, rank: int) -> PeerLostError | None:
        link = self._links.get(rank)
        if link is not None and not link.closed:
            link.read_now()
        return self._ended.get(rank)

    def _peer_gone(self, peer: int, reason: str, lost: bool) -> None:
        if not self.matcher.peer_lost(peer, reason, left=not lost):
            return
        self._fail_ready(peer, reason)
        if not self._closed:
            # A peer that left in order is gone as surely as a lost one: whoever waits for it
            # without a message (a shared-memory arena) hears it from the same handlers.
            exc = PeerLostError(peer, reason, left=not lost)
            # INFO: the engine logs the loss once, with this rank's last operations (its record).
            log.info("rank %d: the link to rank %d is gone: %s", self.rank, peer, reason)
            for handler in list(self._handlers):
                try:
                    handler(peer, exc)
                except Exception:
                    log.exception("peer-lost handler failed")

    def _fail_ready(self, peer: int, reason: str) -> None:
        fut = self._link_ready.get(peer)
        if fut is not None and not fut.done():
            fut.set_exception(self._lost_error(peer))
            fut.exception()

    # -- Transport: sending -----------------------------------------------------------------
    async def send(self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> None:
        """Send one message; returns when ``payload`` may be reused.

        Raises:
            PeerLostError: ``dst`` is gone. ValueError: no such rank.
        """
        if dst == self.rank:
            self.matcher.arrived(dst, tag, meta, memoryview(bytes(as_bytes_view(payload))))
            return
        link = self._links.get(dst)
        if link is None:
            link = await self._wait_link(dst)
        self._sends += 1
        rest = link.send_nowait(tag, payload, meta)
        if rest is not None:
            await rest

    def send_nowait(
        self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> Awaitable[None] | None:
        """See Transport.send_nowait: a small message usually leaves inside this call."""
        link = self._links.get(dst)
        if link is None or dst == self.rank:
            return self.send(dst, tag, payload, meta)
        self._sends += 1
        return link.send_nowait(tag, payload, meta)

    async def _wait_link(self, dst: int) -> Link:
        if dst in self.matcher.lost:
            raise self._lost_error(dst)
        if not 0 <= dst < self.world_size:
            raise ValueError(
                f"rank {self.rank}: destination rank {dst} is outside the world of size {self.world_size}"
            )
        if self._closed:
            raise DistError(f"rank {self.rank}'s transport is closed")
        await asyncio.shield(self._ready_future(dst))
        link = self._links.get(dst)
        if link is None:
            raise self._lost_error(dst)
        return link

    def _lost_error(self, rank: int) -> PeerLostError:
        return PeerLostError(
            rank, self.matcher.lost.get(rank, "the link is closed"), left=rank in self.matcher.left
        )

    # -- Transport: receiving ---------------------------------------------------------------
    async def recv(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        """Receive the next message ``tag`` from ``src`` (None: any rank) into ``into``.

        Raises:
            PeerLostError, MismatchError (wrong length; the message is consumed), DistError
            (closed), ValueError (no such rank).
        """
        into = as_bytes_view(into)
        got = self.matcher.take(src, tag, into)
        if got is None and self._read_in(src):
            got = self.matcher.take(src, tag, into)
        if got is not None:
            return got
        result: tuple[int, dict[str, Any]] = await self._posted_result(src, tag, into, in_place=False)
        return result

    async def recv_landed(
        self, src: int | None, tag: Tag, into: memoryview
    ) -> tuple[int, dict[str, Any], memoryview]:
        """``recv`` that may leave the payload where it arrived (see Transport.recv_landed): a
        message that came before its receive is not copied into ``into``."""
        into = as_bytes_view(into)
        early = self.matcher.take_early(src, tag, len(into))
        if early is None and self._read_in(src):
            early = self.matcher.take_early(src, tag, len(into))
        if early is not None:
            return early.src, early.meta, early.payload
        landed: tuple[int, dict[str, Any], memoryview]
        landed = await self._posted_result(src, tag, into, in_place=True)
        return landed

    def _read_in(self, src: int | None) -> bool:
        """Read ``src``'s link in place when it is one of this host's (Link.poll_while_waiting),
        before a receive is posted: a message that came without waking us (a shm mailbox) is
        taken now rather than in a later turn of the loop. True when something came."""
        link = self._links.get(src) if src is not None else None
        return link is not None and link.poll_while_waiting and link.read_now()

    async def _posted_result(self, src: int | None, tag: Tag, into: memoryview, *, in_place: bool) -> Any:
        """Post a receive for a message not here yet and wait for its result (withdrawn again if
        the wait is cancelled)."""
        fut: asyncio.Future[Any] = self._get_loop().create_future()
        posted = self._post(src, tag, into, fut, in_place)
        self._poll_while_waiting(src, fut.done)
        try:
            result = await fut
        except asyncio.CancelledError:
            self.matcher.unpost(posted)
            raise
        missed = self._missed
        if missed is not None and missed[0] == src:
            # This receive's in-place spin ran out (recv_now, then here): when its message came
            # within the most a spin may last, and this rank sent nothing meanwhile that the
            # message may have answered, a longer spin would have taken it without the sleep,
            # so the budget grows to twice that wait. Without this, misses in a row (a peer held
            # off the CPU for a while) would leave the budget too short to ever take a reply
            # again, and so never grow back.
            self._missed = None
            waited = time.perf_counter() - missed[1]
            budget = self._straight_spin
            if waited < budget.most and self._sends == missed[2]:
                budget.now = min(budget.most, max(budget.now, 2 * waited))
        return result

    def recv_now(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | None:
        """A receive's straight path: the message when it is here already (read or not yet read
        from ``src``'s link), or when that link (one of this host's, Link.poll_while_waiting)
        brings it within a short spin of in-place reads; else None and nothing is posted (the
        caller then receives as usual). The spin follows the wait policy: its budget shrinks
        while the peer keeps answering slower. It also ends once the peer has waited for us
        for a while (Link.peer_waits): two ranks that each receive before they send would
        otherwise both spin out their budgets; and after a yield that came back late (the
        wait policy's late-yield rule: other work holds the core, and a sleeper gets it back
        sooner).

        Raises:
            MismatchError: the message's payload is not ``len(into)`` bytes (it is consumed).
        """
        into = as_bytes_view(into)
        matcher = self.matcher
        got = matcher.take(src, tag, into)
        if got is not None or src is None:
            return got
        link = self._links.get(src)
        if link is None:
            return None
        if not link.poll_while_waiting:
            if link.read_now():  # here, but not yet read: one read in place, on any link
                return matcher.take(src, tag, into)
            return None
        # A receive that nothing in the matcher comes before takes a message the link holds
        # whole straight into ``into`` (Link.take_now); otherwise, and once the link brings
        # anything else, the receive polls through the matcher (see _InPlace).
        straight = matcher.first_to_poll(src, tag)
        if straight:
            here = link.take_now(tag, into)  # what came already
            if here is True:  # something else came (to the matcher): through it from now on
                straight = False
                got = matcher.take(src, tag, into)  # (it may be this receive's)
                if got is not None:
                    return got
            elif here is not False:
                return here
        wait = _InPlace(self, link, src, tag, into, straight)
        try:
            if straight or not wait.look():  # (a straight receive has read what came already)
                self._spin_for(wait)
        finally:
            if wait.polled is not None:
                matcher.unpoll(wait.polled)
        return wait.outcome()

    def _spin_for(self, wait: _InPlace) -> None:
        """recv_now's wait: its link read in place by the wait policy's spin (``wait.look``),
        with the link watching (see recv_now for when it stops)."""
        budget = self._straight_spin
        before = budget.now
        link = wait.link
        if self._plain_for != self.links_version:
            self._plain_for = self.links_version
            here = 1 + sum(1 for other in self._links.values() if other.poll_while_waiting)
            self._plain_s = 0.0 if oversubscribed(here) else PLAIN_SPIN_S
        started = wait.seen = time.perf_counter()
        link.watch(True)
        try:
            self._missed = None
            if not spin(wait.look, budget, self._plain_s):  # the budget ran out: see _posted_result
                self._missed = (link.peer, started, self._sends)
            elif wait.arrived():
                self.polled_arrivals += 1
            elif wait.stopped == _PEER_WAITS:
                # The peer could not send before its own wait ended: spinning was no use, as
                # with two ranks that each receive before they send, so spin for less next time.
                budget.now = max(SPIN_MIN_S, before / 2)
            else:
                budget.now = before  # (a late yield says nothing of when the peer answers)
        finally:
            link.watch(False)  # (what the link takes as it stops watching still comes here)

    def _post(self, src: int | None, tag: Tag, into: memoryview, done: Any, in_place: bool) -> Posted:
        if src is not None and self.world_size and not 0 <= src < self.world_size:
            raise ValueError(
                f"rank {self.rank}: source rank {src} is outside the world of size {self.world_size}"
            )
        return self.matcher.post(src, tag, into, done, in_place=in_place)

    def _poll_while_waiting(self, src: int | None, done: Callable[[], bool]) -> None:
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
            self.polled_arrivals += len(polled) - len(waiting)
            self._poll_misses = 0
        if not waiting:
            self._stop_polling()
            return
        if time.perf_counter() > self._poll_until:
            self._stop_polling()
            self._poll_misses += 1
            if self._poll_misses >= _POLL_MISSES:
                self._poll_misses = 0
                self._poll_off_until = time.perf_counter() + _POLL_OFF_S
            return
        polled[:] = waiting
        os.sched_yield()
        self._get_loop().call_soon(self._poll_turn)

    def _stop_polling(self) -> None:
        self._polled.clear()
        watched = tuple(self._watched.values())
        self._watched.clear()
        for link in watched:
            link.watch(False, in_place=False)  # (what it takes as it stops still arrives)

    def post_recv(self, src: int | None, tag: Tag, into: memoryview, callback: RecvCallback) -> None:
        """``recv`` with its outcome handed to ``callback`` right where the message is read (no
        task, no extra loop iteration); see Transport.post_recv."""
        self._post_with_callback(src, tag, into, callback, False)

    def post_recv_landed(self, src: int | None, tag: Tag, into: memoryview, callback: LandedCallback) -> None:
        """``recv_landed`` with its outcome handed to ``callback`` as ``post_recv`` does (no task);
        see Transport.post_recv_landed."""
        self._post_with_callback(src, tag, into, callback, True)

    def _post_with_callback(
        self, src: int | None, tag: Tag, into: memoryview, callback: Any, in_place: bool
    ) -> None:
        into = as_bytes_view(into)
        got: Any
        try:
            if in_place:
                early = self.matcher.take_early(src, tag, len(into))
                got = None if early is None else (early.src, early.meta, early.payload)
            else:
                got = self.matcher.take(src, tag, into)
            if got is None:
                notify = _Notify(callback)
                self._post(src, tag, into, notify, in_place)
                self._poll_while_waiting(src, notify.done)
                return
        except (DistError, MismatchError, ValueError) as exc:
            callback(None, exc)
            return
        callback(got, None)

    # -- Transport: finished operations, loss, diagnostics ----------------------------------
    def discard(self, tag_prefix: Tag) -> None:
        self.matcher.discard(tag_prefix)

    def holds(self, src: int, tag: Tag) -> bool:
        return self.matcher.holds(src, tag)

    def retire(self, tag_prefix: Tag) -> None:
        self.matcher.retire(tag_prefix)

    def on_stray(self, handler: StrayHandler) -> None:
        self.matcher.on_stray(handler)

    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        self._handlers.append(handler)

    def mark_lost(self, rank: int, reason: str) -> None:
        link = self._links.get(rank)
        if link is not None:
            link.close(reason, lost=True)
        elif rank != self.rank and self.matcher.peer_lost(rank, reason):
            self._fail_ready(rank, reason)

    @property
    def lost_peers(self) -> dict[int, str]:
        return dict(self.matcher.lost)

    @property
    def received_direct(self) -> int:
        """Diagnostics: payloads received straight into their receive's buffer."""
        return self.matcher.received_direct

    @property
    def received_buffered(self) -> int:
        """Diagnostics: payloads that waited in the inbox for their receive."""
        return self.matcher.received_buffered

    def debug_state(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            **self.matcher.debug_state(),
            "links": {peer: {"kind": link.kind, **link.debug_state()} for peer, link in self._links.items()},
        }

    # -- closing ----------------------------------------------------------------------------
    def on_close(self, closer: Callable[[], None]) -> None:
        """Run ``closer`` when the transport closes (a link kind's per-process resources)."""
        self._closers.append(closer)

    def _begin_close(self) -> bool:
        """Mark the transport closed; False when it already was. Kinds with more to stop (a
        listener) extend this."""
        if self._closed:
            return False
        self._closed = True
        for closer in self._closers:
            try:
                closer()
            except Exception:
                log.exception("closing a link kind's resources failed")
        return True

    def abort(self) -> None:
        """Close every link at once, without goodbye: peers see what a crash looks like
        (PeerLostError naming this rank). Pending receives fail; twice is fine."""
        if not self._begin_close():
            return
        for link in list(self._links.values()):
            link.close("this rank aborted its transport", lost=False)
        self._fail_all(f"rank {self.rank}'s transport was aborted")

    async def aclose(self) -> None:
        """Say goodbye on every link and close them. Twice is fine."""
        if not self._begin_close():
            return
        links = list(self._links.values())
        if links:
            await asyncio.gather(*(link.aclose() for link in links), return_exceptions=True)
        self._fail_all(f"rank {self.rank}'s transport is closed")

    def _fail_all(self, reason: str) -> None:
        self.matcher.close(reason)
        err = DistError(reason)
        for fut in self._link_ready.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()


_LATE_YIELD, _PEER_WAITS = 1, 2  # why a rule ended an in-place wait (_InPlace.stopped)


class _InPlace:
    """recv_now's receive while it reads its source's link in place: straight from the link
    while nothing in the matcher comes before it (Link.take_now), else, and from the first time
    the link brings anything else, polled through the matcher (Matcher.poll), which then decides
    every message as it does for any receive. ``look`` is one read and the wait policy's rules
    for the spin: the late yield, and the peer that waits for us."""

    __slots__ = ("got", "into", "link", "polled", "seen", "since", "src", "stopped", "tag", "transport")

    def __init__(
        self, transport: LinkTransport, link: Link, src: int, tag: Tag, into: memoryview, straight: bool
    ) -> None:
        self.transport = transport
        self.link = link
        self.src = src
        self.tag = tag
        self.into = into
        self.polled: Polled | None = None if straight else transport.matcher.poll(src, tag, into)
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
                matcher = self.transport.matcher
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
            self.transport.late_yields += 1
            self.stopped = _LATE_YIELD
            return True
        self.seen = now
        if not self.link.peer_waits():
            self.since = 0.0
        elif not self.since:
            self.since = now
        elif now - self.since > _MUTUAL_WAIT_S:
            self.transport.mutual_waits += 1
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
            return self.transport.matcher.take(self.src, self.tag, self.into)
        if isinstance(got, BaseException):
            raise got
        return got


def _landing(nbytes: int) -> memoryview:
    """Uninitialised memory for a large early payload (zeroing it would cost a pass over it)."""
    import numpy as np

    return np.empty(nbytes, np.uint8).data
