"""In-process Transport: n ranks of one event loop exchanging messages through memory.

Imports only foundations (the Transport ABC and errors). It exists so the algorithms, the engine
and their failure handling can be tested without sockets, with the same semantics the TCP
transport has: (source, tag) matching, FIFO per link, receive from any source, a bounded
inbox per link whose overflow blocks the sender (backpressure, like a socket that stops being
read), ``discard``, ``on_peer_lost`` and ``kill(rank)`` to simulate a dying process.

A sent payload is copied once (the copy is the hand-off: the sender may reuse its buffer as soon
as ``send`` returns); a message whose receive is already waiting is copied straight into the
receiver's buffer, otherwise it waits in the inbox until a matching ``recv``.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiocoll._errors import DistError, MismatchError, PeerLostError
from aiocoll.algorithms._transport import LostPeerHandler, Tag, Transport

__all__ = ["MemoryTransport", "MemoryWorld"]

DEFAULT_INBOX_BYTES = 64 * 1024 * 1024
DEFAULT_INBOX_MESSAGES = 4096
_DISCARD_MEMORY = 4096  # discarded tag prefixes remembered, so late messages are dropped too


@dataclass(slots=True)
class _Message:
    src: int
    data: bytes
    meta: dict[str, Any]


@dataclass(slots=True)
class _Waiter:
    src: int | None
    into: memoryview
    future: asyncio.Future[tuple[int, dict[str, Any]]]


@dataclass(slots=True)
class _Link:
    """Per-source state inside a destination: buffered load and the senders waiting for room."""

    bytes: int = 0
    messages: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    room: list[asyncio.Future[None]] = field(default_factory=list)

    def wake(self) -> None:
        for fut in self.room:
            if not fut.done():
                fut.set_result(None)
        self.room.clear()


def _as_bytes_view(buf: memoryview) -> memoryview:
    view = memoryview(buf)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def _size_mismatch(src: int, dst: int, tag: Tag, got: int, want: int, meta: dict[str, Any]) -> MismatchError:
    err = MismatchError(
        f"message from rank {src} to rank {dst} with tag {tag!r} has {got} bytes but the receive "
        f"expected {want}; the ranks disagree on the tensor size",
        ranks=sorted({src, dst}),
    )
    err.remote_meta = meta  # type: ignore[attr-defined]
    return err


class MemoryTransport(Transport):
    """One rank's end of a MemoryWorld. Create through MemoryWorld, not directly."""

    def __init__(self, world: MemoryWorld, rank: int) -> None:
        self.rank = rank
        self.world_size = world.size
        self._world = world
        self._inbox: dict[Tag, deque[_Message]] = {}
        self._waiters: dict[Tag, list[_Waiter]] = {}
        self._links: dict[int, _Link] = {}
        self._lost: dict[int, str] = {}
        self._handlers: list[LostPeerHandler] = []
        self._discarded: OrderedDict[Tag, None] = OrderedDict()
        self._discard_lengths: set[int] = set()
        self._closed_reason: str | None = None

    # ------------------------------------------------------------------ Transport interface

    async def send(self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> None:
        self._check_open()
        if not 0 <= dst < self.world_size:
            raise ValueError(
                f"rank {self.rank}: destination rank {dst} out of range for world size {self.world_size}"
            )
        peer = self._world.transports[dst]
        if dst in self._lost:
            raise PeerLostError(dst, self._lost[dst])
        # Copying is the hand-off: after this the caller may reuse or free its buffer.
        message = _Message(self.rank, bytes(_as_bytes_view(payload)), dict(meta))
        link = peer._link(self.rank)
        async with link.lock:  # one sender at a time per link keeps the link FIFO
            while True:
                self._check_open()
                if dst in self._lost:
                    raise PeerLostError(dst, self._lost[dst])
                if peer._accept(tag, message, link):
                    return
                room: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                link.room.append(room)
                await room

    async def recv(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        self._check_open()
        if src is not None and not 0 <= src < self.world_size:
            raise ValueError(
                f"rank {self.rank}: source rank {src} out of range for world size {self.world_size}"
            )
        view = _as_bytes_view(into)
        queue = self._inbox.get(tag)
        if queue:
            for i, message in enumerate(queue):
                if src is None or message.src == src:
                    del queue[i]
                    if not queue:
                        del self._inbox[tag]
                    link = self._link(message.src)
                    link.bytes -= len(message.data)
                    link.messages -= 1
                    link.wake()
                    return self._land(message, tag, view)
        lost = self._lost_sources(src)
        if lost is not None:
            raise PeerLostError(lost, self._lost[lost])
        future: asyncio.Future[tuple[int, dict[str, Any]]] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(src, view, future)
        self._waiters.setdefault(tag, []).append(waiter)
        try:
            return await future
        finally:
            waiting = self._waiters.get(tag)
            if waiting is not None and waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._waiters[tag]

    def discard(self, tag_prefix: Tag) -> None:
        prefix = tuple(tag_prefix)
        size = len(prefix)
        for tag in [t for t in self._inbox if t[:size] == prefix]:
            for message in self._inbox.pop(tag):
                link = self._link(message.src)
                link.bytes -= len(message.data)
                link.messages -= 1
                link.wake()
        for tag in [t for t in self._waiters if t[:size] == prefix]:
            for waiter in self._waiters.pop(tag):
                waiter.future.cancel()
        self._discarded[prefix] = None
        self._discard_lengths.add(size)
        while len(self._discarded) > _DISCARD_MEMORY:
            self._discarded.popitem(last=False)

    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        self._handlers.append(handler)

    async def aclose(self) -> None:
        if self._closed_reason is not None:
            return
        self._shut(f"rank {self.rank}'s transport was closed")
        for other in self._world.transports:
            if other is not self:
                other._peer_lost(self.rank, "it closed its transport")

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise DistError(f"{self._closed_reason}; no more messages can be sent or received")

    def _link(self, src: int) -> _Link:
        link = self._links.get(src)
        if link is None:
            link = self._links[src] = _Link()
        return link

    def _lost_sources(self, src: int | None) -> int | None:
        if src is None:
            # A receive from any rank cannot complete in a broken world: fail it like gloo does.
            return next(iter(self._lost), None)
        return src if src in self._lost else None

    def _is_discarded(self, tag: Tag) -> bool:
        return any(tag[:size] in self._discarded for size in self._discard_lengths)

    def _accept(self, tag: Tag, message: _Message, link: _Link) -> bool:
        """Take a message from a sender: hand it to a waiting recv, or buffer it if there is room."""
        if self._closed_reason is not None:
            return True  # a closed rank reads nothing; the sender learns of it via _peer_lost
        if self._discard_lengths and self._is_discarded(tag):
            return True
        waiting = self._waiters.get(tag)
        if waiting:
            for i, waiter in enumerate(waiting):
                if waiter.src is None or waiter.src == message.src:
                    del waiting[i]
                    if not waiting:
                        del self._waiters[tag]
                    if not waiter.future.done():
                        try:
                            waiter.future.set_result(self._land(message, tag, waiter.into))
                        except MismatchError as exc:
                            waiter.future.set_exception(exc)
                    return True
        limits = self._world
        if link.messages and (
            link.bytes + len(message.data) > limits.max_inbox_bytes
            or link.messages + 1 > limits.max_inbox_messages
        ):
            return False
        self._inbox.setdefault(tag, deque()).append(message)
        link.bytes += len(message.data)
        link.messages += 1
        return True

    def _land(self, message: _Message, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        if len(message.data) != into.nbytes:
            raise _size_mismatch(message.src, self.rank, tag, len(message.data), into.nbytes, message.meta)
        into[:] = message.data
        return message.src, message.meta

    def _peer_lost(self, rank: int, reason: str) -> None:
        if self._closed_reason is not None or rank in self._lost:
            return
        self._lost[rank] = reason
        for tag in list(self._waiters):
            keep = []
            for waiter in self._waiters[tag]:
                if waiter.src is None or waiter.src == rank:
                    if not waiter.future.done():
                        waiter.future.set_exception(PeerLostError(rank, reason))
                else:
                    keep.append(waiter)
            if keep:
                self._waiters[tag] = keep
            else:
                del self._waiters[tag]
        # Senders blocked on the lost rank's full inbox re-check and fail.
        self._world.transports[rank]._link(self.rank).wake()
        for handler in self._handlers:
            self._call_soon(handler, rank, PeerLostError(rank, reason))

    def _shut(self, reason: str) -> None:
        self._closed_reason = reason
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(DistError(f"{reason} while a receive was waiting"))
        self._waiters.clear()
        self._inbox.clear()
        for link in self._links.values():
            link.wake()
        for other in self._world.transports:
            if other is not self:
                other._link(self.rank).wake()

    @staticmethod
    def _call_soon(handler: LostPeerHandler, rank: int, exc: BaseException) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            handler(rank, exc)
        else:
            loop.call_soon(handler, rank, exc)


class MemoryWorld:
    """n MemoryTransports that reach each other; index it to get rank r's transport.

    Args:
        n: world size.
        max_inbox_bytes, max_inbox_messages: per link (source -> destination) bound on messages
            buffered before their recv is posted; a send over the bound waits (a message always
            fits into an empty inbox, so a large message never deadlocks on its own).
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

    def __getitem__(self, rank: int) -> MemoryTransport:
        return self.transports[rank]

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[MemoryTransport]:
        return iter(self.transports)

    def kill(self, rank: int) -> None:
        """Simulate rank ``rank`` dying: every other rank sees PeerLostError for it at once."""
        victim = self.transports[rank]
        if victim._closed_reason is not None:
            return
        victim._shut(f"rank {rank} was killed")
        for other in self.transports:
            if other is not victim:
                other._peer_lost(rank, "killed (MemoryWorld.kill)")

    async def aclose(self) -> None:
        for transport in self.transports:
            await transport.aclose()
