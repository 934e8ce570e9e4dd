"""The sending side of a shm link (client.data.transports.shm) beyond its mailbox: the queue of
messages on their way into the ring towards the peer, the pump that moves them there in chunks
and pieces, the offers of payloads the peer reads straight from our memory, and the waits for
ring room (spin, then sleep on the eventfd).

Imports foundations, client.data._shm_ring, client.data._waiting and this package's tcp module;
never the public surface, and never the link's own module (the link owns this object; ``_Link`` says
what this side uses of it).

A payload goes into the ring as one chunk when it fits in the ring, else in chunks of half the
ring, each announced by one small frame on the socket (the frame formats: the link's module
header). A chunk is copied in pieces of ``_PIECE`` bytes, each counted in the ring's header
(``written``) as it lands, and its frame goes before its first piece, so that the receiver asks
where the payload goes while it is copied in (a chunk of one piece: after it). The chunk's room
is reserved first, so the copy waits for nothing of the receiver's.

A payload larger than the ring, where the peer found that it may read our memory (the probe: the
link's module header), is offered instead: one frame says where it lies in our address space,
and the send completes once the peer says in the ring's header that it read it; later messages
wait behind it. We withdraw an offer (in the same header) before we let go of the payload.

Backpressure and waiting: a sender that finds no room in the ring spins for a bounded, adaptive
time (yielding at each check), then sets the ring's ``waiting`` flag and sleeps on its eventfd,
which the receiver writes after freeing space; a sender whose receiver keeps pace hands the event
loop a turn every 2 ms. Messages of one link leave in order; a paused receiver (full inbox) reads
no frames, so the ring fills and the sender waits. A cancelled send none of whose bytes has left
is withdrawn; one partly in the ring completes for the stream's sake. A sender asleep on a full
ring also polls the socket for a hang-up every half second (a paused link would not see it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable
from typing import Any, Protocol

import numpy as np

from aiocoll._errors import PeerLostError
from aiocoll.algorithms._transport import Tag

from .._shm_ring import RingWriter
from .._waiting import SpinBudget, spin
from .tcp import _consume_outcome

__all__ = ["FRAME_BYTES", "RING_SPIN_S", "ShmOutbound"]

_PIECE = 256 << 10  # a chunk is copied into the ring in pieces of this many bytes at most
RING_SPIN_S = 50e-6  # the most a sender spins for ring space before it sleeps
_HANGUP_CHECK_S = 0.5
_DRAIN_S = 1.0  # aclose waits this long for queued sends to reach the ring
_INLINE_S = 0.002  # the most a send moves into the ring before the event loop gets a turn
# Payloads up to this size travel inside their frame on the socket, as over tcp: the frame
# crosses the socket anyway, and for so few bytes the kernel's copy costs less than the ring's
# bookkeeping on both sides.
FRAME_BYTES = 1024


class _Link(Protocol):
    """What the sending side uses of its link (client.data.transports.shm.ShmLink)."""

    closed: bool
    _loop: asyncio.AbstractEventLoop
    _writer: RingWriter | None

    def _lost(self) -> PeerLostError: ...

    def _frame(self, head: dict[str, Any]) -> None: ...

    def _hung_up(self) -> bool: ...

    def _send_in_frame(
        self, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> Awaitable[None] | None: ...


class _Outgoing:
    """A message on its way into the ring (or queued behind one that is)."""

    __slots__ = ("body", "direct", "done", "fut", "meta", "sent", "tag")

    def __init__(self, tag: Tag, meta: dict[str, Any], body: memoryview, direct: bool = False) -> None:
        self.tag = tag
        self.meta = meta
        self.body = body
        self.sent = 0  # bytes of ``body`` already in the ring (or offered to be read directly)
        self.direct = direct  # the receiver reads ``body`` from our memory; done once it says so
        self.done = False
        self.fut: asyncio.Future[None] | None = None  # made only when the caller must wait


class ShmOutbound:
    """The messages a shm link sends through its ring or offers from our memory (see the module
    header), in order. ``queue`` is the link's: its straight path looks whether it is empty."""

    def __init__(self, link: _Link, capacity: int, spin_s: float) -> None:
        self._link = link
        self.queue: deque[_Outgoing] = deque()
        # A payload up to the ring's capacity moves as one chunk (one frame); a larger one in
        # chunks of half of it, so that the sender fills one while the receiver empties the other.
        self._capacity = capacity
        self._chunk = max(4096, capacity // 2)
        self._budget = SpinBudget(spin_s)
        self.asleep = False
        self._checker: asyncio.TimerHandle | None = None
        self._turn: asyncio.Handle | None = None  # the pump's continuation after a loop turn
        self._drained: asyncio.Future[None] | None = None
        # Whether the peer may read our memory (its answer to our probe), and the key of our
        # last offer (the head of the queue until it is read).
        self.peer_reads_us = False
        self._offered = 0
        # diagnostics: times we slept on a full ring; payload bytes through the ring and read
        # by the peer from our memory
        self.sleeps = 0
        self.bytes_out = 0
        self.direct_bytes_out = 0

    def send(self, tag: Tag, meta: dict[str, Any], body: memoryview) -> Awaitable[None] | None:
        """Send ``body`` (bytes, more than FRAME_BYTES unless queued behind others): into the
        ring now when the link is idle and there is room, else queued; None once it has left.

        Raises:
            PeerLostError: the link is closed.
        """
        link = self._link
        writer = link._writer
        assert writer is not None
        queue = self.queue
        n = len(body)
        if not queue and n <= self._capacity:
            # The common case of a message on an idle link: one chunk, one frame, now.
            end = writer.reserve(n)
            if end >= 0:
                self._put(end, body, {"r": [tag, meta, n, end, n]})
                if link.closed:
                    raise link._lost()
                return None
        out = _Outgoing(tag, meta, body, n > self._capacity and self.peer_reads_us)
        queue.append(out)
        if len(queue) == 1 and not self.asleep:
            self._pump()
        if link.closed:
            raise link._lost()
        if out.done:
            return None
        out.fut = link._loop.create_future()
        return self._finish(out)

    async def _finish(self, out: _Outgoing) -> None:
        fut = out.fut
        assert fut is not None
        try:
            await fut
        except asyncio.CancelledError:
            if out.sent == 0 and out in self.queue:
                self.queue.remove(out)  # none of it has left: withdrawn
            # else: partly in the ring; it completes for the stream's sake (the pump goes on)
            raise

    def _pump(self) -> None:
        """Move queued messages into the ring, in order, until done or out of room (then spin
        for a bounded time, then sleep until the receiver frees space)."""
        queue = self.queue
        writer = self._link._writer
        assert writer is not None
        clock = time.perf_counter
        began = clock()
        while queue:
            out = queue[0]
            if out.direct and out.sent:
                # Offered: it leaves the queue once the peer has read it (it says so in the
                # ring's header and wakes us); later messages wait behind it.
                if writer.was_read(self._offered) or not writer.sleep_unless_read(self._offered):
                    writer.offer(0)
                    queue.popleft()
                    self._sent(out)
                    continue
                self._sleep()
                return
            if clock() - began > _INLINE_S:
                # A receiver that keeps pace never lets this sleep: give the event loop a turn
                # now and then (heartbeats, timers, this process's own reading), then go on.
                self._turn = self._link._loop.call_soon(self._pump_later)
                return
            if not self._push(out, began + _INLINE_S):
                if self._link.closed:
                    return
                if clock() - began > _INLINE_S:
                    continue  # out of this turn's time, not of room: the loop gets its turn above
                need = self._chunk_size(out)
                if self._spin_until_room(writer, need):
                    continue
                if writer.sleep_unless_room(need):
                    self._sleep()
                    return
                continue
            if out.direct:
                continue  # offered: the check above waits for its read
            queue.popleft()
            self._sent(out)
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _sent(self, out: _Outgoing) -> None:
        """``out`` has left (the caller may reuse its buffer)."""
        out.done = True
        fut = out.fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _pump_later(self) -> None:
        self._turn = None
        if not self._link.closed and not self.asleep:
            self._pump()

    def _push(self, out: _Outgoing, until: float) -> bool:
        """Put as much of ``out`` into the ring as fits, until the clock (perf_counter) passes
        ``until``; True once all of it is there. A receiver that keeps pace frees room as fast as
        this fills it, so without ``until`` one long message would never give the loop a turn."""
        link = self._link
        body = out.body
        n = len(body)
        if n <= FRAME_BYTES:  # a plain message frame, in order behind the ring ones
            try:
                # a copy: the sender was told its buffer is free once this message is queued
                left = link._send_in_frame(out.tag, memoryview(bytes(body)), out.meta)
            except PeerLostError:
                return False
            if left is not None:  # a header-only frame: nobody waits for its hand-off
                asyncio.ensure_future(left).add_done_callback(_consume_outcome)
            return True
        writer = link._writer
        assert writer is not None
        if out.direct:
            # One frame says where the payload lies in our memory; the receiver copies it straight
            # into its destination and says so in the ring's header, which completes the send.
            # Until then it stays at the head of the queue: later messages wait behind it, as
            # behind a ring message larger than the ring.
            self._offered += 1
            writer.offer(self._offered)
            out.sent = n
            self.direct_bytes_out += n
            at = np.frombuffer(body, np.uint8).ctypes.data
            link._frame({"v": [out.tag, out.meta, n, at, self._offered]})
            return not link.closed
        while out.sent < n:
            c = self._chunk_size(out)
            end = writer.reserve(c)
            if end < 0:
                return False
            head = {"r": [out.tag, out.meta, n, end, c]} if out.sent == 0 else {"c": [end, c]}
            self._put(end, body[out.sent : out.sent + c], head)
            out.sent += c
            if link.closed or (out.sent < n and time.perf_counter() > until):
                return False
        return True

    def _chunk_size(self, out: _Outgoing) -> int:
        """The size of ``out``'s next chunk: all of it when it fits in the ring, else half the
        ring (or what is left)."""
        n = len(out.body)
        return n if n <= self._capacity else min(self._chunk, n - out.sent)

    def _put(self, end: int, src: memoryview, head: dict[str, Any]) -> None:
        """Fill the chunk reserved up to ``end`` with ``src``, in pieces, and send its frame
        first: the receiver learns where the payload goes while we copy it in, then copies
        each piece out as it lands (the ring's ``written``) while we copy the next. A chunk of
        one piece goes before its frame (the receiver then never waits for it). Nothing here
        waits for the receiver: its room was reserved."""
        link = self._link
        writer = link._writer
        assert writer is not None
        n = len(src)
        self.bytes_out += n
        if n <= _PIECE:
            writer.fill(end, n, 0, src)
            link._frame(head)
            return
        link._frame(head)
        k = 0
        while k < n and not link.closed:  # (a failed frame closed the link: the rings are gone)
            step = min(_PIECE, n - k)
            writer.fill(end, n, k, src[k : k + step])
            k += step

    def _spin_until_room(self, writer: RingWriter, need: int) -> bool:
        """Wait for room by the one wait policy (client/data/_waiting.py): yielding the CPU at every
        check (the receiver may be waiting for this very core), up to a budget that halves after
        a spin that failed and doubles back after one that succeeded, so a slow receiver is not
        spun for."""
        has_room = writer.has_room
        return spin(lambda: has_room(need), self._budget)

    def _sleep(self) -> None:
        self.asleep = True
        self.sleeps += 1
        self._checker = self._link._loop.call_later(_HANGUP_CHECK_S, self._check_hangup)

    def _stop_sleeping(self) -> None:
        if not self.asleep:
            return
        self.asleep = False
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None
        writer = self._link._writer
        if writer is not None:
            writer.woken()

    def on_space(self) -> None:
        """The receiver freed ring room or read our offer (it wrote our eventfd while we slept):
        go on."""
        self._stop_sleeping()
        if not self._link.closed:
            self._pump()

    def _check_hangup(self) -> None:
        """While asleep on a full ring: has the peer hung up (a paused link reads nothing, so it
        would not see the end-of-file)? Also re-checks the room, as a net under the wake-up."""
        self._checker = None
        if self._link._hung_up():
            return
        self.on_space()

    async def drain(self) -> None:
        """Let what is queued reach the peer first (for at most ``_DRAIN_S``): the link closes in
        order."""
        if self.queue:
            self._drained = self._link._loop.create_future()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drained), _DRAIN_S)

    def stop(self) -> list[_Outgoing]:
        """The link is closing: stop waiting and pumping, withdraw our offer (the receiver must
        not take a payload we let go of as whole), and hand back the sends still queued, which
        ``fail`` fails once the link is closed."""
        self._stop_sleeping()
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        writer = self._link._writer
        if writer is not None:
            writer.offer(0)
        waiting = list(self.queue)
        self.queue.clear()
        return waiting

    def fail(self, waiting: list[_Outgoing]) -> None:
        """Fail the sends ``stop`` took from the queue (the link is closed now)."""
        for out in waiting:
            if out.fut is not None and not out.fut.done():
                out.fut.set_exception(self._link._lost())
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def debug_state(self) -> dict[str, Any]:
        queue = self.queue
        return {
            "queued_sends": len(queue),
            "asleep": self.asleep,
            "sleeps": self.sleeps,
            "bytes_out": self.bytes_out,
            "unread_by_peer": int(bool(queue) and queue[0].direct and queue[0].sent > 0),
            "direct_bytes_out": self.direct_bytes_out,
        }
