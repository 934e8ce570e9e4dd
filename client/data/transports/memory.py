"""The memory link kind: n ranks of one event loop exchanging messages through memory.

Imports only foundations and client/data/transports/_link.py. It exists so the algorithms, the engine
and their failure handling can be tested without sockets, over the same LinkTransport and the
same Matcher as the tcp kind (so the same rules, by construction): a MemoryLink behaves like a
socket pair, so a send to a peer that stopped reading (backpressure) waits until that peer reads
it; ``MemoryWorld.kill(rank)`` simulates a dying process.

A payload is copied at the send (that copy is the hand-off: the sender may reuse its buffer as
soon as ``send`` returns) and reaches the receiver's matcher from the event loop, never inside the
sender's call (as with a socket): into the receive's buffer when one is waiting (the matcher's
``claim``), else into the inbox. Up to 64 messages per link travel without the sender waiting,
like a socket's buffers; beyond that, or while the receiver does not read, the sender waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Iterator
from typing import Any

from aiocoll._errors import PeerLostError
from aiocoll.algorithms._transport import Tag

from ._link import Link, LinkTransport, as_bytes_view

__all__ = ["MemoryLink", "MemoryTransport", "MemoryWorld"]

DEFAULT_INBOX_BYTES = 64 * 1024 * 1024
DEFAULT_INBOX_MESSAGES = 4096


# A message on its way: (tag, meta, payload, the sender's wait, or None once handed off).
_Unread = tuple[Tag, dict[str, Any], bytes, "asyncio.Future[None] | None"]
# Messages a link takes without making the sender wait (what a socket's buffers would hold).
_IN_FLIGHT = 64


class MemoryLink(Link):
    """Rank ``owner``'s end of its link to ``peer``; ``mirror`` is the peer's end."""

    kind = "memory"

    def __init__(self, owner: LinkTransport, peer: int) -> None:
        self.peer = peer
        self.closed = False
        self.close_reason = ""
        self.mirror: MemoryLink | None = None
        self._owner = owner
        self._reading = False
        self._said_bye = False
        self._drain_scheduled = False
        # Messages from the peer not yet taken by this end, in order.
        self._wire: deque[_Unread] = deque()

    # -- sending (into the mirror) -----------------------------------------------------------
    def send_nowait(self, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> Awaitable[None] | None:
        mirror = self.mirror
        if self.closed or mirror is None or mirror.closed:
            raise PeerLostError(self.peer, self.close_reason or "the link is closed")
        data = bytes(as_bytes_view(payload))  # the copy is the hand-off
        if mirror._reading and len(mirror._wire) < _IN_FLIGHT:
            mirror._wire.append((tag, dict(meta), data, None))
            mirror._schedule_drain()
            return None
        wait: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (tag, dict(meta), data, wait)
        mirror._wire.append(entry)
        mirror._schedule_drain()
        return self._handed_off(mirror, entry)

    async def _handed_off(self, mirror: MemoryLink, entry: _Unread) -> None:
        """Wait until the peer read the message; cancelled before that, it is withdrawn."""
        assert entry[3] is not None
        try:
            await entry[3]
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                mirror._wire.remove(entry)
            raise

    # -- reading -----------------------------------------------------------------------------
    def _schedule_drain(self) -> None:
        # Messages reach the matcher from the loop, as a socket's would: never inside the
        # sender's call, so a receive's callback never runs in the middle of a send.
        if self._reading and self._wire and not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        wire = self._wire
        matcher, src = self._owner.matcher, self.peer
        while wire and self._reading and not self.closed:
            tag, meta, data, wait = wire.popleft()
            matcher.deliver(src, tag, meta, memoryview(data), lasting=True)
            if wait is not None and not wait.done():
                wait.set_result(None)

    def pause_reading(self) -> None:
        self._reading = False

    def resume_reading(self) -> None:
        if self.closed or self._reading:
            return
        self._reading = True
        self._schedule_drain()

    # -- closing -----------------------------------------------------------------------------
    def close(self, reason: str, *, lost: bool) -> None:
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self._reading = False
        self._fail_wire(reason)
        mirror = self.mirror
        if mirror is not None and not mirror.closed:
            # What the other end sees: an orderly close after a goodbye (aclose), else a crash.
            if self._said_bye:
                mirror._peer_closed(f"rank {self._owner.rank} left (closed its transport)", lost=False)
            else:
                mirror._peer_closed(f"rank {self._owner.rank} vanished: {reason}", lost=True)
        self._owner.link_closed(self, reason, lost)

    def _peer_closed(self, reason: str, lost: bool) -> None:
        """The other end closed: what it handed off before still arrives (as the bytes already
        in a socket's buffers do), then this end closes too."""
        if self.closed:
            return
        matcher, src = self._owner.matcher, self.peer
        for tag, meta, data, _wait in [entry for entry in self._wire if entry[3] is None]:
            matcher.deliver(src, tag, meta, memoryview(data), lasting=True)
        self.close(reason, lost=lost)

    def _fail_wire(self, reason: str) -> None:
        while self._wire:
            _, _, _, wait = self._wire.popleft()
            if wait is not None and not wait.done():
                wait.set_exception(PeerLostError(self._owner.rank, reason))
                wait.exception()

    async def aclose(self) -> None:
        self._said_bye = True
        self.close("this rank closed its transport", lost=False)

    def debug_state(self) -> dict[str, Any]:
        return {"reading": self._reading, "wire": len(self._wire)}


class MemoryTransport(LinkTransport):
    """One rank's end of a MemoryWorld (a LinkTransport of memory links). Create through
    MemoryWorld, not directly."""

    def __init__(self, world: MemoryWorld, rank: int) -> None:
        super().__init__(
            rank, world.size, inbox_bytes=world.max_inbox_bytes, inbox_messages=world.max_inbox_messages
        )
        self._world = world


class MemoryWorld:
    """n MemoryTransports linked pairwise; index it to get rank r's transport.

    Args:
        n: world size.
        max_inbox_bytes, max_inbox_messages: per link (source -> destination) bound on messages
            buffered before their recv is posted; once reached, the link stops reading and a
            further send waits until the receiver consumes (a message always fits into an empty
            inbox, so a large message never deadlocks on its own).
    """

    def __init__(
        self,
        n: int,
        *,
        max_inbox_bytes: int = DEFAULT_INBOX_BYTES,
        max_inbox_messages: int = DEFAULT_INBOX_MESSAGES,
    ) -> None:
        if n < 1:
            raise ValueError(f"a world needs at least one rank, got {n}")
        self.size = n
        self.max_inbox_bytes = max_inbox_bytes
        self.max_inbox_messages = max_inbox_messages
        self.transports = [MemoryTransport(self, r) for r in range(n)]
        for a in range(n):
            for b in range(a + 1, n):
                ab = MemoryLink(self.transports[a], b)
                ba = MemoryLink(self.transports[b], a)
                ab.mirror, ba.mirror = ba, ab
                self.transports[a].attach(ab)
                self.transports[b].attach(ba)

    def __getitem__(self, rank: int) -> MemoryTransport:
        return self.transports[rank]

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[MemoryTransport]:
        return iter(self.transports)

    def kill(self, rank: int) -> None:
        """Simulate rank ``rank`` dying: every other rank sees PeerLostError for it at once."""
        self.transports[rank].abort()  # no goodbye: its peers see a crash, naming it

    async def aclose(self) -> None:
        for transport in self.transports:
            await transport.aclose()
