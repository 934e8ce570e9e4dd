"""The one process-level transport that per-peer links plug into (LinkTransport), and the names
other modules import with it (the link interface, re-exported from _link_interface.py).

Imports only foundations (aiocoll._errors, aiocoll._deadline, aiocoll._matching,
aiocoll.algorithms._transport) and this package's link interface (_link_interface.py), in-place
waits (_in_place.py) and loop polling (_loop_polling.py); never a kind's module or the public
surface. The link interface, both directions, is described in _link_interface.py.

``LinkTransport`` (one per process) is the Transport of aiocoll/algorithms/_transport.py over a
dict of links, one per peer, of any mix of kinds: it routes sends by destination, matches every
receive with its one Matcher, turns a link's close into PeerLostError for the receives bound to
that peer, and runs the lost-peer handlers. A connector makes a link and calls ``attach(link)``;
``wait_links(peers, deadline)`` waits until every expected peer has one. A receive that can
complete inside its call (``recv_now``) waits in place (_in_place.py); one posted to wait keeps
the event loop polling its link for a moment (_loop_polling.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiocoll._deadline import Deadline
from aiocoll._errors import DistError, MismatchError, PeerLostError, RendezvousError
from aiocoll._matching import Matcher, Posted
from aiocoll.algorithms._transport import (
    LandedCallback,
    LostPeerHandler,
    RecvCallback,
    StrayHandler,
    Tag,
    Transport,
)

from ._in_place import InPlaceWaits
from ._link_interface import Link, LinkHost, as_bytes_view
from ._loop_polling import LoopPolling

__all__ = ["Link", "LinkHost", "LinkTransport", "as_bytes_view"]

log = logging.getLogger("aiocoll.client.links")


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
        self._sends = 0  # messages sent so far (see InPlaceWaits.came_after_miss)
        self._in_place = InPlaceWaits(self.matcher, lambda: self._sends)  # recv_now's waits
        self._polling = LoopPolling(self._links, self._get_loop)  # posted receives' waits
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
        if link.poll_while_waiting:
            self._in_place.links_changed(1)
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
            if link.poll_while_waiting:
                self._in_place.links_changed(-1)
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
        self._polling.poll_for(src, fut.done)
        try:
            result = await fut
        except asyncio.CancelledError:
            self.matcher.unpost(posted)
            raise
        if self._in_place.missed is not None:  # (this receive's in-place spin may have run out)
            self._in_place.came_after_miss(src)
        return result

    def recv_now(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | None:
        """A receive's straight path: the message when it is here already (read or not yet read
        from ``src``'s link), or when that link (one of this host's, Link.poll_while_waiting)
        brings it within a short spin of in-place reads (InPlaceWaits.receive); else None and
        nothing is posted (the caller then receives as usual). The spin follows the wait policy:
        its budget shrinks while the peer keeps answering slower. It also ends once the peer has
        waited for us for a while (Link.peer_waits): two ranks that each receive before they
        send would otherwise both spin out their budgets; and after a yield that came back late
        (the wait policy's late-yield rule: other work holds the core, and a sleeper gets it
        back sooner).

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
        # anything else, the receive polls through the matcher (see InPlaceReceive, _in_place.py).
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
        return self._in_place.receive(link, src, tag, into, straight)

    def _post(self, src: int | None, tag: Tag, into: memoryview, done: Any, in_place: bool) -> Posted:
        if src is not None and self.world_size and not 0 <= src < self.world_size:
            raise ValueError(
                f"rank {self.rank}: source rank {src} is outside the world of size {self.world_size}"
            )
        return self.matcher.post(src, tag, into, done, in_place=in_place)

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
                self._polling.poll_for(src, notify.done)
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
    def polled_arrivals(self) -> int:
        """Diagnostics: receives done while this rank polled for them, in place (recv_now) or
        with the event loop kept turning (LoopPolling), instead of sleeping."""
        return self._in_place.arrivals + self._polling.arrivals

    @property
    def mutual_waits(self) -> int:
        """Diagnostics: in-place receives that stopped as their peer waited for us."""
        return self._in_place.mutual_waits

    @property
    def late_yields(self) -> int:
        """Diagnostics: in-place receives that stopped as other work held our core."""
        return self._in_place.late_yields

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


def _landing(nbytes: int) -> memoryview:
    """Uninitialised memory for a large early payload (zeroing it would cost a pass over it)."""
    import numpy as np

    return np.empty(nbytes, np.uint8).data
