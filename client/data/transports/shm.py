"""The shm link kind: peers on this host, joined by an authenticated Unix socket that also
handed over each side's shared-memory arena and point-to-point rings (client.data._shm).

Imports foundations, client.data._shm, client.data._shm_ring, client.data._vm_read and this
package's tcp module; never the public surface.

Messages between two ranks of one host (point-to-point, and collectives that do not run over the
arenas: reduce, gather, scatter, all_to_all, the driver's schedules) keep the tcp kind's framing
on the Unix socket for their headers, but their payload bytes never cross it: the sender copies
each payload once into its ring towards the peer (client.data._shm_ring), as one chunk when it
fits in the ring, else in chunks of half the ring, and sends one small frame per chunk saying
where it lies (``{"r": [tag, meta, total, end, length]}`` for the first, ``{"c": [end, length]}``
for the rest). The receiver takes those frames in stream order like any other: the first asks the
process's matcher where the payload goes (``claim``: a posted receive's own buffer, the one of a
receive polling in place when the first chunk is the whole payload, the landing memory of a large
early message, or, for a small early one, memory of the link's own), every chunk is copied out of
the ring once, straight there, and freed at once; the last reports the message (``landed`` /
``arrived``), so posted and polling receives get exactly one copy and ``recv_landed`` reduces from
where the payload landed. Payloads are pipelined within a chunk: the sender copies a chunk in
pieces of ``_PIECE`` bytes, counting each in the ring's header (``written``) as it lands, and
sends the chunk's frame before its first piece (so that the receiver asks where the payload goes
while it is copied in; a chunk of one piece, after it); the receiver copies each piece out as it
lands, waiting in place for the next (the sender reserved the chunk's room first, so its copy
waits for nothing of ours and the wait usually lasts the rest of that copy; it looks for the
peer's hang-up between spins). A sender that has not filled the chunk within ``_FILL_IN_PLACE_S``
is stopped or off its core: the receiver then hands its event loop back (heartbeats and timers go
on) and copies the rest from there, reading nothing more from the link until it is whole; the
frames read behind the chunk wait for it, in order (``PeerLink.held``). Between chunks,
the receiver copies chunk k out while the sender writes chunk k+1. Zero-length messages are plain
frames, and so are payloads of at most ``_FRAME_BYTES`` (the frame crosses the socket anyway, and
for so few bytes the ring's bookkeeping costs more than the kernel's copy), unless they take the
straight path below.

The straight path for a small message: when nothing else is in flight on the link (no send
queued, the peer has taken our last mailbox message and dispatched every frame we wrote, as it
says in the ring's header), a payload of at most ``_MAIL_MAX`` bytes goes packed with its tag and
meta (msgpack) into the ring's one-message mailbox (client.data._shm_ring), with no frame. A
receive that polls its link in place (LinkTransport.recv_now; ``watch`` raises the ring's polling
flag) takes it from there; a receiver that does not poll is woken through our eventfd (the flag
and a fence on each side make sure one of the two happens). A receive polling in place with
nothing in the matcher before it (``take_now``) copies a payload of its tag and size straight
into its buffer (one whose msgpack head is that of the last it took so, unpacked not at all);
anything else goes to the matcher whole (``Matcher.deliver``). A receive spinning for its peer's
message stops once the peer's own polling flag says that it waits in place for us
(``peer_waits``). Order holds: the sender uses the mailbox only once every frame before it was
dispatched, and the receiver takes the mailbox's message before it dispatches any frame it reads
later, when woken, when polling, and when the link closes (a message put there before the peer
went is delivered). A polling receiver reads the socket only when the peer's header says it wrote
a frame not yet read. While the receiver's reading is paused (full inbox) the mailbox is not
taken. ``AIOCOLL_SHM_MAILBOX=0`` keeps a rank from sending through the mailbox.

Payloads larger than the ring skip it where the receiver may read the sender's memory: one frame
says where the payload lies in the sender's address space (``{"v": [tag, meta, total, address,
key]}``); the receiver claims its destination as for a ring message, copies the payload straight
there with process_vm_readv (client.data._vm_read: one copy per byte where the ring takes two; in
two halves on two threads where the cores allow) and reports the read in the ring's header (not
over the socket, whose reading the sender may have paused), waking the sender if it sleeps: that
completes the send. The sender withdraws an offer (in the same header) before it lets go of the
payload; a receiver that finds it withdrawn after the read does not deliver it. Whether the peer
may read our memory is asked once, when the link is made: each side sends where its arena's probe
nonce lies in its own address space (``{"vp": [address, length]}``), the other reads it there,
compares, and answers ``{"vok": bool}``. A receiver that cannot read an offer (the sender died)
closes the link as lost. ``AIOCOLL_SHM_DIRECT=0`` on either side keeps every payload in the rings.

Backpressure and waiting: a sender that finds no room in the ring spins for a bounded, adaptive
time (yielding at each check), then sets the ring's ``waiting`` flag and sleeps on its eventfd,
which the receiver writes after freeing space; a sender whose receiver keeps pace hands the event
loop a turn every 2 ms. Messages of one link leave in order; a paused receiver (full inbox) reads
no frames, so the ring fills and the sender waits. A cancelled send none of whose bytes has left
is withdrawn; one partly in the ring completes for the stream's sake. The link's end-of-file is
the peer's loss (a killed rank's socket is closed by the kernel); a sender asleep on a full ring
also polls the socket for a hang-up every half second. The rings are anonymous memory the link
owns and closes with its eventfds: nothing is left behind.

How the links are made (the kind, the process's host and its arena): client.data.transports._shm_kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import select
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np

from aiocoll._env import env_text
from aiocoll._errors import PeerLostError
from aiocoll.algorithms._transport import Tag
from aiocoll.protocol import PREFIX, Frame

from .._peer import PeerLink
from .._shm import NONCE_BYTES, PROBE_OFFSET, ShmPeer
from .._shm_ring import NEWS_FRAMES, NEWS_MAIL, RingReader, RingWriter
from .._vm_read import DIRECT_ENV, vm_read, vm_read_available, vm_read_split
from .._waiting import SpinBudget, spin
from ._link import LinkHost, as_bytes_view
from .tcp import TcpLink, _consume_outcome, _on_frames

__all__ = ["SHM_MAILBOX_ENV", "ShmLink"]

log = logging.getLogger("aiocoll.client.shm")
# a mailbox message, read where it lies (what it returns is a copy: the peer may write the
# mailbox again once we counted the message taken)
_unpack_mail = functools.partial(msgpack.unpackb, max_ext_len=0, strict_map_key=False)
_LANDED = object()  # a mailbox message taken straight into its receive's buffer (_unpack_into)
_NOTHING_EXPECTED = (b"", memoryview(b""))
_HEADS_KEPT = 64  # mailbox heads kept per link (tags and sizes received in place)

SHM_MAILBOX_ENV = "AIOCOLL_SHM_MAILBOX"
_PIECE = 256 << 10  # a chunk is copied into the ring in pieces of this many bytes at most
_FILL_CHECK_S = 1e-3  # a receiver waiting for a chunk's pieces looks for a hang-up this often
# A receiver waits in place for a chunk's pieces at most this long (the sender's copy of a whole
# ring takes a fraction of it); a sender still not done is stopped or off its core, and the
# receiver's event loop, which its heartbeats and timers need, looks again every _FILL_POLL_S,
# for _FILL_LOOK_S each time.
_FILL_IN_PLACE_S = 5e-3
_FILL_POLL_S = 1e-3
_FILL_LOOK_S = 1e-4
_SPIN_S = 50e-6  # the most a sender spins for ring space before it sleeps
_HANGUP_CHECK_S = 0.5
_DRAIN_S = 1.0  # aclose waits this long for queued sends to reach the ring
_INLINE_S = 0.002  # the most a send moves into the ring before the event loop gets a turn
_MAIL_MAX = 2048  # payloads up to this size go through the mailbox, where they fit packed
# Payloads up to this size travel inside their frame on the socket, as over tcp: the frame
# crosses the socket anyway, and for so few bytes the kernel's copy costs less than the ring's
# bookkeeping on both sides.
_FRAME_BYTES = 1024


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


class _Incoming:
    """A message whose chunks are being copied out of the peer's ring."""

    __slots__ = ("claimed", "dst", "got", "meta", "tag", "total")

    def __init__(self, tag: Tag, meta: dict[str, Any], dst: memoryview, total: int, claimed: bool) -> None:
        self.tag = tag
        self.meta = meta
        self.dst = dst
        self.total = total
        self.got = 0
        self.claimed = claimed


class _Filling:
    """A chunk the sender is still filling, piece by piece, and how much of it is copied out."""

    __slots__ = ("copied", "dst", "end", "incoming", "src")

    def __init__(self, incoming: _Incoming, end: int, src: memoryview, dst: memoryview) -> None:
        self.incoming = incoming
        self.end = end
        self.src = src
        self.dst = dst
        self.copied = 0

    def release(self) -> None:
        self.src.release()


class ShmLink(TcpLink):
    """A link to a peer on this host: headers as frames over the authenticated Unix socket,
    payloads through the shared-memory rings (see the module header). Takes over the peer's
    rings and their eventfds from ``shm`` (it closes them)."""

    kind = "shm"
    poll_while_waiting = True

    def __init__(
        self,
        shm: ShmPeer,
        host: LinkHost,
        *,
        max_payload: int,
        spin_s: float = _SPIN_S,
        own_arena: Any = None,
    ) -> None:
        super().__init__(shm.sock, shm.rank, host, max_payload=max_payload)
        self._max_payload = max_payload
        self._writer: RingWriter | None = None
        self._reader: RingReader | None = None
        self._rings = (shm.out_ring, shm.in_ring)
        self._space_efd, self._peer_efd = shm.out_efd, shm.in_efd
        shm.out_ring = shm.in_ring = None
        shm.out_efd = shm.in_efd = -1
        out_ring, in_ring = self._rings
        if out_ring is not None and in_ring is not None:
            self._writer = RingWriter(out_ring)
            self._reader = RingReader(in_ring)
        capacity = self._writer.capacity if self._writer is not None else 0
        # Small messages through the ring's mailbox when nothing else is in flight (we send
        # through it unless told not to; we always take what the peer put in its own)
        self._mailbox = self._writer is not None and env_text(SHM_MAILBOX_ENV) != "0"
        if self._reader is not None:
            self._on_frames = _on_shm_frames  # takes the mailbox's message ahead of later frames
            # our eventfd: the peer freed ring room or read our offer (while we sleep on it), or
            # put a message in its mailbox while we did not poll
            self._loop.add_reader(self._space_efd, self._on_efd)
        self._closing = False
        self._loop_watching = False  # the event loop's polling turns read the mailbox (watch)
        # diagnostics: messages we put in the mailbox and those we took out of the peer's (the
        # rings count them; kept here once the rings are closed), the times we had to wake the
        # peer for one
        self._mail_counts = (0, 0)
        self.mail_wakes = 0
        # The msgpack head (all but the payload's bytes) of the mailbox message last taken by a
        # receive of a tag and size, and its meta: a message with that head goes straight into
        # the receive's buffer without being unpacked (take_now, _unpack_into).
        self._taken_heads: dict[tuple[Tag, int], tuple[bytes, dict[str, Any]]] = {}
        self._expected: tuple[bytes, memoryview] = _NOTHING_EXPECTED  # (_unpack_into)
        # A payload up to the ring's capacity moves as one chunk (one frame); a larger one in
        # chunks of half of it, so that the sender fills one while the receiver empties the other.
        self._capacity = capacity
        self._chunk = max(4096, capacity // 2)
        self._budget = SpinBudget(spin_s)
        self._sending: deque[_Outgoing] = deque()
        self._incoming: _Incoming | None = None
        # a chunk whose pieces the event loop waits for (_park), and whether reading resumes then
        self._filling: _Filling | None = None
        self._fill_timer: asyncio.TimerHandle | None = None
        self._resume_after_fill = False
        self._asleep = False
        self._checker: asyncio.TimerHandle | None = None
        self._turn: asyncio.Handle | None = None  # the pump's continuation after a loop turn
        self._drained: asyncio.Future[None] | None = None
        # diagnostics: times a sender slept on a full ring; payload bytes through the rings
        self.ring_sleeps = 0
        self.ring_bytes_out = 0
        self.ring_bytes_in = 0
        # Large payloads read straight from the sender's memory: whether the peer may read ours
        # (its answer to our probe), our messages it has yet to read, and payload bytes so moved.
        self._peer_reads_us = False
        self._offered = 0  # the key of our last offer (the head of _sending until it is read)
        self._peer_pid = shm.pid
        self._peer_nonce = bytes(shm.mem[PROBE_OFFSET : PROBE_OFFSET + NONCE_BYTES])
        self.direct_bytes_out = 0
        self.direct_bytes_in = 0
        if own_arena is not None and self._writer is not None and _direct_allowed():
            # Ask the peer to read our arena's probe nonce from our memory (the kernel decides
            # whether it may: the same user and ptrace access); its answer enables direct sends.
            at = np.frombuffer(own_arena, np.uint8, count=NONCE_BYTES, offset=PROBE_OFFSET).ctypes.data
            # once the link is in service: a peer that already left makes this send fail, which
            # must close a link its transport knows, not one still being made
            self._loop.call_soon(self._ask_probe, at)

    def _ask_probe(self, at: int) -> None:
        if not self.closed:
            self._frame({"vp": [at, NONCE_BYTES]})

    # -- sending ----------------------------------------------------------------------------
    def send_nowait(self, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> Awaitable[None] | None:
        writer = self._writer
        if writer is None:
            return super().send_nowait(tag, payload, meta)
        if self.closed:
            raise self._lost()
        queue = self._sending
        n = payload.nbytes
        if not queue and 0 < n <= _MAIL_MAX and self._mailbox:
            # The straight path, when the receiver has taken everything we sent before: the
            # message goes to the mailbox without a frame; a receiver that polls takes it from
            # there, one that does not is woken. (msgpack packs a contiguous view's bytes
            # whatever its format: no byte view is made for it.)
            polling = writer.mail(self.frames_out, self._packer.pack, [tag, meta, payload])
            if polling is not None:
                if not polling:
                    self.mail_wakes += 1
                    try:
                        os.eventfd_write(self._peer_efd, 1)
                    except OSError:
                        pass  # (closed by now: the link's close reports the loss)
                return None
        body = as_bytes_view(payload)
        if not queue and n <= _FRAME_BYTES:  # in its frame, in order: nothing is queued ahead
            return super().send_nowait(tag, payload, meta)
        if not queue and n <= self._capacity:
            # The common case of a message on an idle link: one chunk, one frame, now.
            end = writer.reserve(n)
            if end >= 0:
                self._put(end, body, {"r": [tag, meta, n, end, n]})
                if self.closed:
                    raise self._lost()
                return None
        out = _Outgoing(tag, meta, body, n > self._capacity and self._peer_reads_us)
        queue.append(out)
        if len(queue) == 1 and not self._asleep:
            self._pump()
        if self.closed:
            raise self._lost()
        if out.done:
            return None
        out.fut = self._loop.create_future()
        return self._finish(out)

    def _unpack_into(self, view: memoryview) -> Any:
        """``take_now``'s reading of a mailbox message: one whose head is the one expected
        (``_expected``: the head taken last for this tag and size) goes straight into the
        receive's buffer (``_LANDED``); any other is unpacked."""
        head, into = self._expected
        k = len(head)
        if len(view) == k + len(into) and self._incoming is None and view[:k] == head:
            into[:] = view[k:]
            return _LANDED
        return _unpack_mail(view)  # (checked by _mail)

    @property
    def mail_out(self) -> int:
        """Messages we put in the peer's mailbox so far."""
        writer = self._writer
        return self._mail_counts[0] if writer is None else writer.mailed

    @property
    def mail_in(self) -> int:
        """Messages we took out of the peer's mailbox so far."""
        reader = self._reader
        return self._mail_counts[1] if reader is None else reader.taken

    async def _finish(self, out: _Outgoing) -> None:
        fut = out.fut
        assert fut is not None
        try:
            await fut
        except asyncio.CancelledError:
            if out.sent == 0 and out in self._sending:
                self._sending.remove(out)  # none of it has left: withdrawn
            # else: partly in the ring; it completes for the stream's sake (the pump goes on)
            raise

    def _pump(self) -> None:
        """Move queued messages into the ring, in order, until done or out of room (then spin
        for a bounded time, then sleep until the receiver frees space)."""
        queue = self._sending
        writer = self._writer
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
                self._turn = self._loop.call_soon(self._pump_later)
                return
            if not self._push(out, began + _INLINE_S):
                if self.closed:
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
        if not self.closed and not self._asleep:
            self._pump()

    def _push(self, out: _Outgoing, until: float) -> bool:
        """Put as much of ``out`` into the ring as fits, until the clock (perf_counter) passes
        ``until``; True once all of it is there. A receiver that keeps pace frees room as fast as
        this fills it, so without ``until`` one long message would never give the loop a turn."""
        body = out.body
        n = len(body)
        if n <= _FRAME_BYTES:  # a plain message frame, in order behind the ring ones
            try:
                # a copy: the sender was told its buffer is free once this message is queued
                left = TcpLink.send_nowait(self, out.tag, memoryview(bytes(body)), out.meta)
            except PeerLostError:
                return False
            if left is not None:  # a header-only frame: nobody waits for its hand-off
                asyncio.ensure_future(left).add_done_callback(_consume_outcome)
            return True
        writer = self._writer
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
            self._frame({"v": [out.tag, out.meta, n, at, self._offered]})
            return not self.closed
        while out.sent < n:
            c = self._chunk_size(out)
            end = writer.reserve(c)
            if end < 0:
                return False
            head = {"r": [out.tag, out.meta, n, end, c]} if out.sent == 0 else {"c": [end, c]}
            self._put(end, body[out.sent : out.sent + c], head)
            out.sent += c
            if self.closed or (out.sent < n and time.perf_counter() > until):
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
        writer = self._writer
        assert writer is not None
        n = len(src)
        self.ring_bytes_out += n
        if n <= _PIECE:
            writer.fill(end, n, 0, src)
            self._frame(head)
            return
        self._frame(head)
        k = 0
        while k < n and not self.closed:  # (a failed frame closed the link: the rings are gone)
            step = min(_PIECE, n - k)
            writer.fill(end, n, k, src[k : k + step])
            k += step

    def _frame(self, head: dict[str, Any]) -> None:
        """Send a header-only frame saying where a chunk lies (a failed send closes the link)."""
        packed = self._packer.pack(head)
        with contextlib.suppress(ConnectionError):
            self.write_nowait([memoryview(PREFIX.pack(len(packed), 0) + packed)])

    def _spin_until_room(self, writer: RingWriter, need: int) -> bool:
        """Wait for room by the one wait policy (client/data/_waiting.py): yielding the CPU at every
        check (the receiver may be waiting for this very core), up to a budget that halves after
        a spin that failed and doubles back after one that succeeded, so a slow receiver is not
        spun for."""
        has_room = writer.has_room
        return spin(lambda: has_room(need), self._budget)

    def _sleep(self) -> None:
        self._asleep = True
        self.ring_sleeps += 1
        self._checker = self._loop.call_later(_HANGUP_CHECK_S, self._check_hangup)

    def _stop_sleeping(self) -> None:
        if not self._asleep:
            return
        self._asleep = False
        if self._checker is not None:
            self._checker.cancel()
            self._checker = None
        if self._writer is not None:
            self._writer.woken()

    def _on_efd(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self._space_efd)
        reader = self._reader
        if reader is not None and reader.has_mail():
            self._take_mail()
        if self._asleep:
            self._on_space()

    def _on_space(self) -> None:
        self._stop_sleeping()
        if not self.closed:
            self._pump()

    def _check_hangup(self) -> None:
        """While asleep on a full ring: has the peer hung up (a paused link reads nothing, so it
        would not see the end-of-file)? Also re-checks the room, as a net under the wake-up."""
        self._checker = None
        if self._hung_up():
            return
        self._on_space()

    def _hung_up(self) -> bool:
        """Whether the peer has hung up its socket (then the link is closed as lost), looked at
        without reading it."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLRDHUP)
        if any(ev & (select.POLLHUP | select.POLLERR | select.POLLRDHUP) for _, ev in poller.poll(0)):
            self.close("its shared-memory socket closed (the process exited or was killed)", lost=True)
            return True
        return False

    # -- receiving --------------------------------------------------------------------------
    def read_now(self) -> bool:
        reader = self._reader
        if reader is None:
            return super().read_now()
        # The mailbox first: frames still in the socket were written after its message. The
        # socket only when the peer says it wrote a frame we have not read.
        news = reader.news(self._frames_in)
        if not news:  # (a spinning receive's usual look)
            return False
        mail = False
        if news & NEWS_MAIL:
            mail = self._take_mail()
        if news & NEWS_FRAMES:
            return super().read_now() or mail
        return mail

    def take_now(self, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | bool:
        reader = self._reader
        if reader is None:
            return super().take_now(tag, into)
        news = reader.news(self._frames_in)
        if news != NEWS_MAIL:  # nothing came, or frames did (read_now reads them)
            return news != 0
        n = len(into)
        seen = self._taken_heads.get((tag, n))
        if seen is None:
            message = self._mail(_unpack_mail)
        else:
            self._expected = (seen[0], into)
            message = self._mail(self._unpack_into)
            self._expected = _NOTHING_EXPECTED
            if message is _LANDED:
                return self.peer, dict(seen[1])
        if message is None:  # (reading is paused, or the link is closed: read_now's way)
            return True
        got, meta, body = message
        key = tuple(got)
        if key != tag or len(body) != n:
            self._matcher.deliver(self.peer, key, meta, body)
            return True
        into[:] = body
        # (msgpack packs a tag, meta and size the same way each time: the next message of them
        # has this head, packed again here once)
        if len(self._taken_heads) >= _HEADS_KEPT:
            self._taken_heads.clear()
        whole = self._packer.pack([got, meta, body])
        self._taken_heads[(tag, n)] = (whole[: len(whole) - n], meta)
        return self.peer, dict(meta)

    def write(self, views: list[memoryview]) -> asyncio.Future[None] | None:
        fut = super().write(views)
        writer = self._writer
        if writer is not None:
            writer.wrote(self.frames_out)
        return fut

    def peer_waits(self) -> bool:
        writer = self._writer
        return writer is not None and writer.peer_waits(self.frames_out)

    def watch(self, on: bool, in_place: bool = True) -> None:
        reader = self._reader
        if reader is None:
            return
        if not in_place:
            self._loop_watching = on
        if on:
            reader.start_polling(in_place)
        elif self._loop_watching:  # a spin ended; the loop's turns go on reading
            reader.start_polling(False)
        elif reader.stop_polling():  # it came as we stopped: its sender may not wake us
            self._take_mail()

    def resume_reading(self) -> None:
        if self._filling is not None:  # once the chunk being filled is copied (_fill_more)
            self._resume_after_fill = True
            return
        if self._reading or self.closed:
            return
        super().resume_reading()
        reader = self._reader
        if reader is not None and reader.has_mail():
            self._loop.call_soon(self._take_mail)  # (not from inside the matcher that resumed us)

    def _take_mail(self) -> bool:
        """Hand the mailbox's message over (to where the matcher says it goes, as a ring
        message's); True when there was one."""
        message = self._mail()
        if message is None:
            return False
        tag, meta, body = message
        self._matcher.deliver(self.peer, tuple(tag), meta, body)
        return True

    def _mail(self, unpack: Callable[[memoryview], Any] = _unpack_mail) -> Any:
        """The mailbox's message (its tag as a list, meta and payload) as ``unpack`` reads it,
        taken out; None when there is none, or when it is malformed (the link is then closed).
        Not while reading is paused: the mailbox is then the peer's to wait on, as a full socket
        would be. (``_unpack_into`` may answer ``_LANDED`` instead: the message is in place.)"""
        reader = self._reader
        if reader is None or not self._reading:
            return None
        try:
            message = reader.mail(unpack)
            if message is None or message is _LANDED:
                return message
            tag, meta, body = message
            if not (isinstance(tag, list) and isinstance(meta, dict) and type(body) is bytes):
                raise ValueError("a malformed mailbox message")
            if self._incoming is not None:
                raise ValueError("a mailbox message in the middle of a ring message")
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            self._broken(exc)
            return None
        return message

    def _sink(self, header: dict[str, Any], nbytes: int) -> memoryview | None:
        # A payload in its frame is claimed only when its frame is handed over, not when its
        # header is parsed: ring chunk frames read in the same batch are dispatched after the
        # parse, and a claim made first would bind a posted receive ahead of an earlier message.
        # Such payloads are small (_FRAME_BYTES), so the one extra copy costs nothing.
        return None if self._reader is not None else super()._sink(header, nbytes)

    def on_control(self, header: dict[str, Any]) -> bool:
        first = header.get("r")
        if first is not None:
            try:
                tag, meta, total, end, n = first
                incoming = self._begin(tag, meta, total, n == total)  # (one chunk: whole at once)
            except (TypeError, ValueError) as exc:
                self._broken(exc)
                return True
            self._take(incoming, end, n)
            return True
        more = header.get("c")
        if more is not None:
            current = self._incoming
            try:
                end, n = more
                if current is None:
                    raise ValueError("a chunk without its message")
            except (TypeError, ValueError) as exc:
                self._broken(exc)
                return True
            self._take(current, end, n)
            return True
        if "v" in header:
            self._read_direct(header["v"])
            return True
        if "vp" in header:
            self._frame({"vok": self._probe(header["vp"])})
            return True
        if "vok" in header:
            self._peer_reads_us = header["vok"] is True
            return True
        return False

    def _read_direct(self, offer: Any) -> None:
        """The peer offers a payload to read from its memory: copy it straight to where it goes
        (as a ring message's first chunk would be placed), tell the peer, hand the message over."""
        try:
            tag, meta, total, at, key = offer
            if not (isinstance(total, int) and isinstance(at, int) and isinstance(key, int)):
                raise ValueError("a malformed direct-read offer")
            incoming = self._begin(tag, meta, total, True)
        except (TypeError, ValueError) as exc:
            self._broken(exc)
            return
        reader = self._reader
        assert reader is not None  # (no probe, so no offer, without rings)
        try:
            dst = np.frombuffer(incoming.dst, np.uint8).ctypes.data
            vm_read_split(self._peer_pid, dst, at, total, split_min=0)  # (see the module header)
        except OSError as exc:
            self.close(f"its memory could not be read ({exc})", lost=True)
            return
        if not reader.still_offered(key):  # it let go of the payload while we read: not whole
            self.close("it withdrew a payload while it was being read (it closed the link)", lost=True)
            return
        self.direct_bytes_in += total
        if reader.report_read(key):
            with contextlib.suppress(OSError):
                os.eventfd_write(self._peer_efd, 1)
        self._hand_over(incoming)

    def _begin(self, tag: Any, meta: Any, total: Any, whole: bool) -> _Incoming:
        """A message's first frame (in the ring or offered from the peer's memory): where its
        payload goes, asked of the matcher as soon as its length is known.

        Raises:
            ValueError / TypeError: the frame is out of place or malformed.
        """
        key, dst = self._claim(tag, meta, total, whole)
        if dst is None:  # a small early message: our own memory, handed to the inbox
            return _Incoming(key, meta, memoryview(bytearray(total)), total, False)
        return _Incoming(key, meta, dst, total, True)

    def _claim(self, tag: Any, meta: Any, total: Any, whole: bool) -> tuple[Tag, memoryview | None]:
        """A message's tag, and where the matcher says its payload goes (None: keep it here);
        ``whole``: the payload is landed and handed over within this call (Matcher.claim).

        Raises:
            ValueError / TypeError: the header is out of place or malformed.
        """
        if not (isinstance(tag, list) and isinstance(meta, dict)) or self._incoming is not None:
            raise ValueError("a message header out of place")
        if not 0 < total <= self._max_payload:
            raise ValueError(f"a {total}-byte payload (at most {self._max_payload} are accepted)")
        key = tuple(tag)
        return key, self._matcher.claim(self.peer, key, total, whole)

    def _hand_over(self, incoming: _Incoming) -> None:
        """The message is whole: to the receive that claimed it, or to the inbox."""
        if incoming.claimed:
            self._matcher.landed(self.peer, incoming.tag, incoming.meta, incoming.dst)
        else:
            self._matcher.arrived(self.peer, incoming.tag, incoming.meta, incoming.dst)

    def _probe(self, probe: Any) -> bool:
        """Whether we can read the peer's memory: its arena's nonce, read from its address space
        at the address it gave, must equal what our mapping of its arena shows."""
        try:
            at, n = probe
            if not (isinstance(at, int) and n == NONCE_BYTES) or not _direct_allowed():
                return False
            seen = np.zeros(NONCE_BYTES, np.uint8)
            vm_read(self._peer_pid, seen.ctypes.data, at, NONCE_BYTES)
        except (TypeError, ValueError, OSError) as exc:
            log.debug("shm link to rank %d: no direct reads (%s)", self.peer, exc)
            return False
        return seen.tobytes() == self._peer_nonce

    def _take(self, incoming: _Incoming, end: Any, n: Any) -> None:
        """Copy one chunk out of the peer's ring into the message's memory, free it, and hand
        the message over once it is whole."""
        reader = self._reader
        try:
            if reader is None or not isinstance(end, int) or not isinstance(n, int):
                raise ValueError("a chunk frame on a link without rings")
            if n > incoming.total - incoming.got:
                raise ValueError(f"a {n}-byte chunk past the end of a {incoming.total}-byte payload")
            src = reader.chunk(end, n)
        except ValueError as exc:
            self._broken(exc)
            return
        got = incoming.got
        if reader.written() >= end:  # all of it has landed (a chunk of one piece always has)
            incoming.dst[got : got + n] = src
        else:
            fill = _Filling(incoming, end, src, incoming.dst[got : got + n])
            landed = self._copy_landed(fill, _FILL_IN_PLACE_S)
            if landed is None:
                self._park(fill)
                return
            if not landed:
                fill.release()
                return
        src.release()
        self._took(incoming, end, n)

    def _took(self, incoming: _Incoming, end: int, n: int) -> None:
        """One chunk of ``incoming`` (``n`` bytes up to ``end``) is copied out: free its room,
        hand the message over once it is whole."""
        reader = self._reader
        assert reader is not None
        incoming.got += n
        self.ring_bytes_in += n
        if reader.release(end):
            with contextlib.suppress(OSError):
                os.eventfd_write(self._peer_efd, 1)
        if incoming.got < incoming.total:
            self._incoming = incoming
            return
        self._incoming = None
        self._hand_over(incoming)

    def _copy_landed(self, fill: _Filling, for_s: float) -> bool | None:
        """Copy what has landed of the chunk the sender is filling (it sent the frame first),
        piece by piece, waiting in place for the next piece by the one wait policy and looking
        for a hang-up between spins, for at most ``for_s``. True once all of it is copied; False
        when the peer went meanwhile (the link is then closed as lost); None when the rest did
        not come in time (the sender is stopped or off its core: the event loop looks again)."""
        reader = self._reader
        assert reader is not None
        start, n = fill.end - len(fill.src), len(fill.src)
        budget = SpinBudget(min(for_s, _FILL_CHECK_S))
        clock = time.perf_counter
        stop = clock() + for_s
        while True:
            copied = fill.copied
            ready = min(reader.written() - start, n)
            if ready > copied:
                fill.dst[copied:ready] = fill.src[copied:ready]
                fill.copied = ready
                if ready == n:
                    return True
                continue
            if spin(functools.partial(_past, reader, start + copied), budget):
                continue
            if self._hung_up():
                return False
            if clock() >= stop:
                return None
            budget.now = budget.most

    def _park(self, fill: _Filling) -> None:
        """The sender has not filled the chunk in time: go on copying it from the event loop
        (every ``_FILL_POLL_S``), reading nothing more from this link meanwhile; the frames read
        after the chunk's wait in ``held`` for it, in order (so does the mailbox)."""
        self._filling = fill
        self.held = []
        if self._reading:
            self._resume_after_fill = True
            super().pause_reading()
        self._fill_timer = self._loop.call_later(_FILL_POLL_S, self._fill_more)

    def _fill_more(self) -> None:
        self._fill_timer = None
        fill = self._filling
        if fill is None or self.closed:
            return
        landed = self._copy_landed(fill, _FILL_LOOK_S)
        if landed is None:
            self._fill_timer = self._loop.call_later(_FILL_POLL_S, self._fill_more)
            return
        self._filling = None
        held, self.held = self.held, None
        fill.src.release()
        if not landed:  # (closed as lost)
            return
        self._took(fill.incoming, fill.end, len(fill.dst))
        if held and not self.closed:
            _on_frames(self, held)  # (may park again on a later chunk: then it holds the rest)
            self._count_dispatched()
        if self._filling is None and self._resume_after_fill and not self.closed:
            self._resume_after_fill = False
            self.resume_reading()

    def pause_reading(self) -> None:
        if self._filling is not None:  # paused already: stay so once the chunk is copied
            self._resume_after_fill = False
            return
        super().pause_reading()

    def _count_dispatched(self) -> None:
        """Tell the peer how many of its frames we dispatched (frames held behind a chunk still
        being filled are not yet: until they are, the peer does not use the mailbox)."""
        reader = self._reader
        if reader is not None:
            held = self.held
            reader.dispatched(self._frames_in - (len(held) if held else 0))

    def _broken(self, exc: BaseException) -> None:
        log.warning("shm link to rank %d: %s", self.peer, exc)
        self.close(f"protocol error on the shared-memory link: {exc}", lost=True)

    # -- closing ----------------------------------------------------------------------------
    def close(self, reason: str, *, lost: bool) -> None:
        if self.closed:
            return
        if not self._closing:
            self._closing = True
            # What the peer put in the mailbox before it went is delivered, as its frames are.
            self._take_mail()
            if self.closed:
                return
        self._stop_sleeping()
        if self._turn is not None:
            self._turn.cancel()
            self._turn = None
        if self._writer is not None:
            self._writer.offer(0)  # the receiver must not take a payload we let go of as whole
        waiting = list(self._sending)
        self._sending.clear()
        self._incoming = None
        if self._fill_timer is not None:
            self._fill_timer.cancel()
            self._fill_timer = None
        if self._filling is not None:
            self._filling.release()
            self._filling = None
            self.held = None
        super().close(reason, lost=lost)
        for out in waiting:
            if out.fut is not None and not out.fut.done():
                out.fut.set_exception(self._lost())
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._mail_counts = (self.mail_out, self.mail_in)
        for side in (self._writer, self._reader):
            if side is not None:
                side.close()
        self._writer = self._reader = None
        for mem in self._rings:
            if mem is not None:
                with contextlib.suppress(BufferError, ValueError):
                    mem.close()
        if self._space_efd >= 0:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._space_efd)
        for fd in (self._space_efd, self._peer_efd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._space_efd = self._peer_efd = -1

    async def aclose(self) -> None:
        if self.closed:
            return
        if self._sending:  # let what is queued reach the peer first (bounded)
            self._drained = self._loop.create_future()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._drained), _DRAIN_S)
        await super().aclose()

    def debug_state(self) -> dict[str, Any]:
        state = super().debug_state()
        if self._writer is not None:
            incoming = self._incoming
            state["ring"] = {
                "head": self._writer.head,
                "freed_by_peer": self._writer.freed,
                "queued_sends": len(self._sending),
                "asleep": self._asleep,
                "sleeps": self.ring_sleeps,
                "bytes_out": self.ring_bytes_out,
                "bytes_in": self.ring_bytes_in,
                "incoming": None if incoming is None else [incoming.got, incoming.total],
                "filling": None if self._filling is None else [self._filling.copied, len(self._filling.src)],
                "unread_by_peer": int(
                    bool(self._sending) and self._sending[0].direct and self._sending[0].sent > 0
                ),
                "direct_bytes_out": self.direct_bytes_out,
                "direct_bytes_in": self.direct_bytes_in,
                "mail_out": self.mail_out,
                "mail_in": self.mail_in,
                "mail_wakes": self.mail_wakes,
            }
        return state


def _past(reader: RingReader, at: int) -> bool:
    """Whether the sender has filled its ring past ``at``."""
    return reader.written() > at


def _on_shm_frames(link: PeerLink, frames: list[Frame]) -> None:
    """A shm link's frames, after the mailbox's message when there is one (it was put there
    before these frames were written: a sender uses the mailbox only once we have dispatched
    every frame it wrote); then we say how many frames we have dispatched."""
    assert isinstance(link, ShmLink)
    reader = link._reader
    if reader is not None and reader.has_mail():
        link._take_mail()
    _on_frames(link, frames)
    link._count_dispatched()


def _direct_allowed() -> bool:
    return env_text(DIRECT_ENV) != "0" and vm_read_available()
