"""The receiving side of a shm link (client.data.transports.shm) beyond its mailbox: messages
whose payload comes through the peer's ring in chunks, or is read straight from the peer's
memory; where each goes (the matcher's claim), the copies, the hand-over, and the answer to the
peer's probe of whether we may read its memory.

Imports foundations, client.data._shm, client.data._shm_ring, client.data._vm_read and
client.data._waiting; never the public surface, and never the link's own module (the link owns
this object; ``_Link`` says what this side uses of it).

A message's first frame (the frame formats: the link's module header) asks the process's matcher
where the payload goes (``claim``: a posted receive's own buffer, the one of a receive polling in
place when the first chunk is the whole payload, the landing memory of a large early message,
or, for a small early one, memory of the link's own); every chunk is copied out of the ring once,
straight there, and freed at once; the last reports the message (``landed`` / ``arrived``), so
posted and polling receives get exactly one copy and ``recv_landed`` reduces from where the
payload landed. The sender sends a chunk's frame before its first piece: the receiver copies
each piece out as it lands (the ring's ``written``), waiting in place for the next (the sender
reserved the chunk's room first, so its copy waits for nothing of ours and the wait usually lasts
the rest of that copy; it looks for the peer's hang-up between spins). A sender that has not
filled the chunk within ``_FILL_IN_PLACE_S`` is stopped or off its core: the receiver then hands
its event loop back (heartbeats and timers go on) and copies the rest from there, reading nothing
more from the link until it is whole; the frames read behind the chunk wait for it, in order
(``PeerLink.held``). Between chunks, the receiver copies chunk k out while the sender writes
chunk k+1.

Direct reads: an offer (``{"v": [tag, meta, total, address, key]}``) is claimed as a ring
message's first chunk would be, copied straight to its destination with process_vm_readv
(client.data._vm_read: one copy per byte where the ring takes two; in two halves on two threads
where the cores allow) and reported read in the ring's header (not over the socket, whose reading
the sender may have paused), waking the sender if it sleeps: that completes the send. An offer
found withdrawn after the read is not delivered; one that cannot be read (the sender died) closes
the link as lost. The probe: the peer sends where its arena's nonce lies in its address space
(``{"vp": [address, length]}``); we read it there, compare it with our mapping of its arena, and
the link answers ``{"vok": bool}``. ``AIOCOLL_SHM_DIRECT=0`` on either side keeps every payload
in the rings.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from typing import Any, Protocol

import numpy as np

from aiocoll._env import env_text
from aiocoll._matching import Matcher
from aiocoll.algorithms._transport import Tag
from aiocoll.protocol import Frame

from .._shm import NONCE_BYTES
from .._shm_ring import RingReader
from .._vm_read import DIRECT_ENV, vm_read, vm_read_available, vm_read_split
from .._waiting import SpinBudget, spin

__all__ = ["ShmInbound", "direct_reads_allowed"]

log = logging.getLogger("aiocoll.client.shm")

_FILL_CHECK_S = 1e-3  # a receiver waiting for a chunk's pieces looks for a hang-up this often
# A receiver waits in place for a chunk's pieces at most this long (the sender's copy of a whole
# ring takes a fraction of it); a sender still not done is stopped or off its core, and the
# receiver's event loop, which its heartbeats and timers need, looks again every _FILL_POLL_S,
# for _FILL_LOOK_S each time.
_FILL_IN_PLACE_S = 5e-3
_FILL_POLL_S = 1e-3
_FILL_LOOK_S = 1e-4


def direct_reads_allowed() -> bool:
    """Whether this process takes part in direct reads (``AIOCOLL_SHM_DIRECT``, and the kernel
    offers process_vm_readv)."""
    return env_text(DIRECT_ENV) != "0" and vm_read_available()


class _Link(Protocol):
    """What the receiving side uses of its link (client.data.transports.shm.ShmLink)."""

    peer: int
    closed: bool
    held: list[Frame] | None
    _loop: asyncio.AbstractEventLoop
    _matcher: Matcher
    _reader: RingReader | None
    _peer_efd: int
    _max_payload: int

    @property
    def reading(self) -> bool: ...

    def close(self, reason: str, *, lost: bool) -> None: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def _broken(self, exc: BaseException) -> None: ...

    def _hung_up(self) -> bool: ...

    def _dispatch(self, frames: list[Frame]) -> None: ...


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


class ShmInbound:
    """The messages a shm link receives through the peer's ring or from the peer's memory (see
    the module header), taken in stream order from the link's frames (``on_control``)."""

    def __init__(self, link: _Link, peer_pid: int, peer_nonce: bytes) -> None:
        self._link = link
        self.incoming: _Incoming | None = None  # a ring message not yet whole
        # a chunk whose pieces the event loop waits for (_park), and whether reading resumes then
        self.filling: _Filling | None = None
        self._fill_timer: asyncio.TimerHandle | None = None
        self._resume_after_fill = False
        self._peer_pid = peer_pid
        self._peer_nonce = peer_nonce  # what our mapping of the peer's arena shows (_probe)
        # diagnostics: payload bytes through the ring and read from the peer's memory
        self.bytes_in = 0
        self.direct_bytes_in = 0

    def on_control(self, header: dict[str, Any]) -> bool:
        """A ring message's chunk frame or an offer to read: taken (True); False for any other
        frame (the link answers the probe's own)."""
        first = header.get("r")
        if first is not None:
            try:
                tag, meta, total, end, n = first
                incoming = self._begin(tag, meta, total, n == total)  # (one chunk: whole at once)
            except (TypeError, ValueError) as exc:
                self._link._broken(exc)
                return True
            self._take(incoming, end, n)
            return True
        more = header.get("c")
        if more is not None:
            current = self.incoming
            try:
                end, n = more
                if current is None:
                    raise ValueError("a chunk without its message")
            except (TypeError, ValueError) as exc:
                self._link._broken(exc)
                return True
            self._take(current, end, n)
            return True
        if "v" in header:
            self._read_direct(header["v"])
            return True
        return False

    def defer_reading(self, resume: bool) -> bool:
        """While a chunk is being filled the link reads nothing (``_park``): a pause or resume
        asked meanwhile takes effect once the chunk is copied (True); False when none is."""
        if self.filling is None:
            return False
        self._resume_after_fill = resume
        return True

    def _read_direct(self, offer: Any) -> None:
        """The peer offers a payload to read from its memory: copy it straight to where it goes
        (as a ring message's first chunk would be placed), tell the peer, hand the message over."""
        link = self._link
        try:
            tag, meta, total, at, key = offer
            if not (isinstance(total, int) and isinstance(at, int) and isinstance(key, int)):
                raise ValueError("a malformed direct-read offer")
            incoming = self._begin(tag, meta, total, True)
        except (TypeError, ValueError) as exc:
            link._broken(exc)
            return
        reader = link._reader
        assert reader is not None  # (no probe, so no offer, without rings)
        try:
            dst = np.frombuffer(incoming.dst, np.uint8).ctypes.data
            vm_read_split(self._peer_pid, dst, at, total, split_min=0)  # (see the module header)
        except OSError as exc:
            link.close(f"its memory could not be read ({exc})", lost=True)
            return
        if not reader.still_offered(key):  # it let go of the payload while we read: not whole
            link.close("it withdrew a payload while it was being read (it closed the link)", lost=True)
            return
        self.direct_bytes_in += total
        if reader.report_read(key):
            with contextlib.suppress(OSError):
                os.eventfd_write(link._peer_efd, 1)
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
        link = self._link
        if not (isinstance(tag, list) and isinstance(meta, dict)) or self.incoming is not None:
            raise ValueError("a message header out of place")
        if not 0 < total <= link._max_payload:
            raise ValueError(f"a {total}-byte payload (at most {link._max_payload} are accepted)")
        key = tuple(tag)
        return key, link._matcher.claim(link.peer, key, total, whole)

    def _hand_over(self, incoming: _Incoming) -> None:
        """The message is whole: to the receive that claimed it, or to the inbox."""
        link = self._link
        if incoming.claimed:
            link._matcher.landed(link.peer, incoming.tag, incoming.meta, incoming.dst)
        else:
            link._matcher.arrived(link.peer, incoming.tag, incoming.meta, incoming.dst)

    def probe(self, probe: Any) -> bool:
        """Whether we can read the peer's memory: its arena's nonce, read from its address space
        at the address it gave, must equal what our mapping of its arena shows."""
        try:
            at, n = probe
            if not (isinstance(at, int) and n == NONCE_BYTES) or not direct_reads_allowed():
                return False
            seen = np.zeros(NONCE_BYTES, np.uint8)
            vm_read(self._peer_pid, seen.ctypes.data, at, NONCE_BYTES)
        except (TypeError, ValueError, OSError) as exc:
            log.debug("shm link to rank %d: no direct reads (%s)", self._link.peer, exc)
            return False
        return seen.tobytes() == self._peer_nonce

    def _take(self, incoming: _Incoming, end: Any, n: Any) -> None:
        """Copy one chunk out of the peer's ring into the message's memory, free it, and hand
        the message over once it is whole."""
        reader = self._link._reader
        try:
            if reader is None or not isinstance(end, int) or not isinstance(n, int):
                raise ValueError("a chunk frame on a link without rings")
            if n > incoming.total - incoming.got:
                raise ValueError(f"a {n}-byte chunk past the end of a {incoming.total}-byte payload")
            src = reader.chunk(end, n)
        except ValueError as exc:
            self._link._broken(exc)
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
        link = self._link
        reader = link._reader
        assert reader is not None
        incoming.got += n
        self.bytes_in += n
        if reader.release(end):
            with contextlib.suppress(OSError):
                os.eventfd_write(link._peer_efd, 1)
        if incoming.got < incoming.total:
            self.incoming = incoming
            return
        self.incoming = None
        self._hand_over(incoming)

    def _copy_landed(self, fill: _Filling, for_s: float) -> bool | None:
        """Copy what has landed of the chunk the sender is filling (it sent the frame first),
        piece by piece, waiting in place for the next piece by the one wait policy and looking
        for a hang-up between spins, for at most ``for_s``. True once all of it is copied; False
        when the peer went meanwhile (the link is then closed as lost); None when the rest did
        not come in time (the sender is stopped or off its core: the event loop looks again)."""
        reader = self._link._reader
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
            if self._link._hung_up():
                return False
            if clock() >= stop:
                return None
            budget.now = budget.most

    def _park(self, fill: _Filling) -> None:
        """The sender has not filled the chunk in time: go on copying it from the event loop
        (every ``_FILL_POLL_S``), reading nothing more from this link meanwhile; the frames read
        after the chunk's wait in ``held`` for it, in order (so does the mailbox)."""
        link = self._link
        link.held = []
        if link.reading:
            link.pause_reading()  # (before ``filling`` is set, which defers pauses)
            self._resume_after_fill = True
        self.filling = fill
        self._fill_timer = link._loop.call_later(_FILL_POLL_S, self._fill_more)

    def _fill_more(self) -> None:
        self._fill_timer = None
        link = self._link
        fill = self.filling
        if fill is None or link.closed:
            return
        landed = self._copy_landed(fill, _FILL_LOOK_S)
        if landed is None:
            self._fill_timer = link._loop.call_later(_FILL_POLL_S, self._fill_more)
            return
        self.filling = None
        held, link.held = link.held, None
        fill.src.release()
        if not landed:  # (closed as lost)
            return
        self._took(fill.incoming, fill.end, len(fill.dst))
        if held and not link.closed:
            link._dispatch(held)  # (may park again on a later chunk: then it holds the rest)
        if self.filling is None and self._resume_after_fill and not link.closed:
            self._resume_after_fill = False
            link.resume_reading()

    def close(self) -> None:
        """The link is closing: a message not yet whole is dropped, a chunk being filled let go
        (the frames held behind it with it)."""
        self.incoming = None
        if self._fill_timer is not None:
            self._fill_timer.cancel()
            self._fill_timer = None
        if self.filling is not None:
            self.filling.release()
            self.filling = None
            self._link.held = None

    def debug_state(self) -> dict[str, Any]:
        incoming, filling = self.incoming, self.filling
        return {
            "bytes_in": self.bytes_in,
            "incoming": None if incoming is None else [incoming.got, incoming.total],
            "filling": None if filling is None else [filling.copied, len(filling.src)],
            "direct_bytes_in": self.direct_bytes_in,
        }


def _past(reader: RingReader, at: int) -> bool:
    """Whether the sender has filled its ring past ``at``."""
    return reader.written() > at
