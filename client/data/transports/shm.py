"""The shm link kind: peers on this host, joined by an authenticated Unix socket that also
handed over each side's shared-memory arena and point-to-point rings (client.data._shm).

Imports foundations, client.data._peer, client.data._shm, client.data._shm_ring and this package's
_link, tcp, _shm_inbound and _shm_outbound; never the public surface.

Messages between two ranks of one host (point-to-point, and collectives that do not run over the
arenas: reduce, gather, scatter, all_to_all, the driver's schedules) keep the tcp kind's framing
on the Unix socket for their headers, but their payload bytes never cross it: the sender copies
each payload once into its ring towards the peer (client.data._shm_ring), as one chunk when it
fits in the ring, else in chunks of half the ring, and sends one small frame per chunk saying
where it lies (``{"r": [tag, meta, total, end, length]}`` for the first, ``{"c": [end, length]}``
for the rest); the receiver copies each chunk out once, straight to where the matcher says the
payload goes, while the sender fills the next. Payloads larger than the ring skip it where the
receiver may read the sender's memory: one frame says where the payload lies in the sender's
address space (``{"v": [tag, meta, total, address, key]}``) and the receiver reads it from there
(process_vm_readv). Whether the peer may read our memory is asked once, when the link is made:
each side sends where its arena's probe nonce lies in its own address space (``{"vp": [address,
length]}``), the other reads it there, compares, and answers ``{"vok": bool}``. The sending side
(queue, pump, pieces, offers, waiting for room) is the link's ShmOutbound
(client.data.transports._shm_outbound); the receiving side (claims, chunk copies, a chunk its
sender is slow to fill, direct reads, the probe's answer) its ShmInbound
(client.data.transports._shm_inbound). Zero-length messages are plain frames, and so are
payloads of at most ``FRAME_BYTES`` (the frame crosses the socket anyway, and for so few bytes
the ring's bookkeeping costs more than the kernel's copy), unless they take the straight path
below.

The straight path for a small message, which this module keeps: when nothing else is in flight
on the link (no send queued, the peer has taken our last mailbox message and dispatched every
frame we wrote, as it says in the ring's header), a payload of at most ``_MAIL_MAX`` bytes goes
packed with its tag and meta (msgpack) into the ring's one-message mailbox
(client.data._shm_ring), with no frame. A receive that polls its link in place
(LinkTransport.recv_now; ``watch`` raises the ring's polling flag) takes it from there; a
receiver that does not poll is woken through our eventfd (the flag and a fence on each side make
sure one of the two happens). A receive polling in place with nothing in the matcher before it
(``take_now``) copies a payload of its tag and size straight into its buffer (one whose msgpack
head is that of the last it took so, unpacked not at all); anything else goes to the matcher
whole (``Matcher.deliver``). A receive spinning for its peer's message stops once the peer's own
polling flag says that it waits in place for us (``peer_waits``). Order holds: the sender uses
the mailbox only once every frame before it was dispatched, and the receiver takes the mailbox's
message before it dispatches any frame it reads later, when woken, when polling, and when the
link closes (a message put there before the peer went is delivered). A polling receiver reads the
socket only when the peer's header says it wrote a frame not yet read. While the receiver's
reading is paused (full inbox) the mailbox is not taken. ``AIOCOLL_SHM_MAILBOX=0`` keeps a rank
from sending through the mailbox.

The link's end-of-file is the peer's loss (a killed rank's socket is closed by the kernel). The
rings are anonymous memory the link owns and closes with its eventfds: nothing is left behind.

How the links are made (the kind, the process's host and its arena): client.data.transports._shm_kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import select
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import numpy as np

from aiocoll._env import env_text
from aiocoll.algorithms._transport import Tag
from aiocoll.protocol import PREFIX, Frame

from .._peer import PeerLink
from .._shm import NONCE_BYTES, PROBE_OFFSET, ShmPeer
from .._shm_ring import NEWS_FRAMES, NEWS_MAIL, RingReader, RingWriter
from ._link import LinkHost, as_bytes_view
from ._shm_inbound import ShmInbound, direct_reads_allowed
from ._shm_outbound import FRAME_BYTES, RING_SPIN_S, ShmOutbound
from .tcp import TcpLink, _on_frames

__all__ = ["SHM_MAILBOX_ENV", "ShmLink"]

log = logging.getLogger("aiocoll.client.shm")
# a mailbox message, read where it lies (what it returns is a copy: the peer may write the
# mailbox again once we counted the message taken)
_unpack_mail = functools.partial(msgpack.unpackb, max_ext_len=0, strict_map_key=False)
_LANDED = object()  # a mailbox message taken straight into its receive's buffer (_unpack_into)
_NOTHING_EXPECTED = (b"", memoryview(b""))
_HEADS_KEPT = 64  # mailbox heads kept per link (tags and sizes received in place)

SHM_MAILBOX_ENV = "AIOCOLL_SHM_MAILBOX"
_MAIL_MAX = 2048  # payloads up to this size go through the mailbox, where they fit packed


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
        spin_s: float = RING_SPIN_S,
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
        self._outbound = ShmOutbound(self, capacity, spin_s)
        self._sending = self._outbound.queue  # (the straight path looks whether it is empty)
        peer_nonce = bytes(shm.mem[PROBE_OFFSET : PROBE_OFFSET + NONCE_BYTES])
        self._inbound = ShmInbound(self, shm.pid, peer_nonce)
        if own_arena is not None and self._writer is not None and direct_reads_allowed():
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
        if not queue and n <= FRAME_BYTES:  # in its frame, in order: nothing is queued ahead
            return super().send_nowait(tag, payload, meta)
        return self._outbound.send(tag, meta, body)

    # a message frame (a queued small message goes in one, in order: ShmOutbound._push)
    _send_in_frame = TcpLink.send_nowait

    def _unpack_into(self, view: memoryview) -> Any:
        """``take_now``'s reading of a mailbox message: one whose head is the one expected
        (``_expected``: the head taken last for this tag and size) goes straight into the
        receive's buffer (``_LANDED``); any other is unpacked."""
        head, into = self._expected
        k = len(head)
        if len(view) == k + len(into) and self._inbound.incoming is None and view[:k] == head:
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

    @property
    def ring_bytes_out(self) -> int:
        """Payload bytes we put in the ring so far."""
        return self._outbound.bytes_out

    @property
    def ring_bytes_in(self) -> int:
        """Payload bytes we took out of the peer's ring so far."""
        return self._inbound.bytes_in

    @property
    def direct_bytes_out(self) -> int:
        """Payload bytes we offered the peer to read from our memory so far."""
        return self._outbound.direct_bytes_out

    @property
    def direct_bytes_in(self) -> int:
        """Payload bytes we read from the peer's memory so far."""
        return self._inbound.direct_bytes_in

    @property
    def ring_sleeps(self) -> int:
        """Times a send slept on a full ring so far."""
        return self._outbound.sleeps

    def _frame(self, head: dict[str, Any]) -> None:
        """Send a header-only frame (a chunk's place, an offer, a probe; a failed send closes
        the link)."""
        packed = self._packer.pack(head)
        with contextlib.suppress(ConnectionError):
            self.write_nowait([memoryview(PREFIX.pack(len(packed), 0) + packed)])

    def _on_efd(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self._space_efd)
        reader = self._reader
        if reader is not None and reader.has_mail():
            self._take_mail()
        if self._outbound.asleep:
            self._outbound.on_space()

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
        if self._inbound.defer_reading(True):  # once the chunk being filled is copied
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
            if self._inbound.incoming is not None:
                raise ValueError("a mailbox message in the middle of a ring message")
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            self._broken(exc)
            return None
        return message

    def _sink(self, header: dict[str, Any], nbytes: int) -> memoryview | None:
        # A payload in its frame is claimed only when its frame is handed over, not when its
        # header is parsed: ring chunk frames read in the same batch are dispatched after the
        # parse, and a claim made first would bind a posted receive ahead of an earlier message.
        # Such payloads are small (FRAME_BYTES), so the one extra copy costs nothing.
        return None if self._reader is not None else super()._sink(header, nbytes)

    def on_control(self, header: dict[str, Any]) -> bool:
        if self._inbound.on_control(header):  # a ring message's chunk, an offer to read
            return True
        if "vp" in header:
            self._frame({"vok": self._inbound.probe(header["vp"])})
            return True
        if "vok" in header:
            self._outbound.peer_reads_us = header["vok"] is True
            return True
        return False

    def pause_reading(self) -> None:
        if self._inbound.defer_reading(False):  # paused already: stays so once the chunk is copied
            return
        super().pause_reading()

    def _count_dispatched(self) -> None:
        """Tell the peer how many of its frames we dispatched (frames held behind a chunk still
        being filled are not yet: until they are, the peer does not use the mailbox)."""
        reader = self._reader
        if reader is not None:
            held = self.held
            reader.dispatched(self._frames_in - (len(held) if held else 0))

    def _dispatch(self, frames: list[Frame]) -> None:
        """Dispatch frames that were held behind a chunk now copied (ShmInbound._fill_more)."""
        _on_frames(self, frames)
        self._count_dispatched()

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
        waiting = self._outbound.stop()
        self._inbound.close()
        super().close(reason, lost=lost)
        self._outbound.fail(waiting)
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
        await self._outbound.drain()  # what is queued reaches the peer first (bounded)
        await super().aclose()

    def debug_state(self) -> dict[str, Any]:
        state = super().debug_state()
        if self._writer is not None:
            state["ring"] = {
                "head": self._writer.head,
                "freed_by_peer": self._writer.freed,
                **self._outbound.debug_state(),
                **self._inbound.debug_state(),
                "mail_out": self.mail_out,
                "mail_in": self.mail_in,
                "mail_wakes": self.mail_wakes,
            }
        return state


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
