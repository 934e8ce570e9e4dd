"""One direction of a point-to-point byte ring in shared memory: the shm link kind's data path.

Imports only the standard library and client.data._shm (the ring header size, the memory fence);
never asyncio, sockets or the public surface. The link (client/data/transports/shm.py, with its
sending side in _shm_outbound.py and its receiving side in _shm_inbound.py) decides what to put in a
ring and when, and says where each chunk lies in a frame over its Unix socket; this module only
allocates, copies, checks bounds and keeps the two counters.

A ring is a memfd of ``RING_HEADER + capacity`` bytes made by the *sender* (client.data._shm hands it
to the receiver with the arena). Its first page holds four counters, on their own cache lines:

    0    freed     absolute count of ring bytes the receiver has released (only it writes this)
    64   waiting   1 while the sender waits for space or a read (only the sender writes this)
    128  read      the key of the last payload offered outside the ring that the receiver has
                   copied out of the sender's memory (only the receiver writes this)
    192  offered   the key of the payload the sender offers outside the ring now, 0 when none
                   (only the sender writes this; it clears it before it lets go of the payload)
    256  mailed    how many messages the sender has put in the mailbox (only it writes this)
    320  taken     how many of them the receiver has taken out (only it writes this)
    384  polling   1 while the receiver polls the mailbox in place (a receive waits for it),
                   2 while its event loop's turns poll it; else 0 (only the receiver writes this)
    448  dispatched  how many of the link's socket frames the receiver has dispatched (only it
                   writes this)
    512  the mailbox's message: its length; then how many socket frames the link has written
                   (only the sender writes these)
    640  written   absolute end of the bytes copied into the data so far (only the sender
                   writes this)
    1024 mailbox   the message (msgpack: its tag, meta and payload), ``MAIL_BYTES`` at most
    4096 data      ``capacity`` bytes, used in order

Positions are absolute byte counts (they never wrap; the offset in the data is the position
modulo the capacity). A chunk is contiguous: one that would cross the end starts at the
beginning instead, and the bytes skipped count as used; a chunk written while the ring is empty
(the receiver has freed all that was written) starts at the beginning too (its first pages stay
warm). Chunks start on 64-byte boundaries. Chunks are released in the order they were written
(the link's socket is FIFO), so one counter says what is free: the sender may write while
``position + length - freed`` stays within the capacity, or anywhere once the ring is empty.
That bound is the backpressure: a receiver that stops reading stops the sender once the ring is
full, and nothing is ever dropped or reordered.

A chunk is reserved whole (``reserve``) and then filled in pieces (``fill``), each counted in
``written`` once copied, so the receiver may copy a chunk out while the sender still copies it
in, and learn where its bytes end without a message per piece. The sender fills a reserved
chunk to its end without waiting for anything of the receiver's (its room is already there).

Waking the sender: after releasing (or reporting a read), the receiver issues a full fence
(client.data._shm.fence) and reads ``waiting``; a sender about to sleep sets ``waiting``, fences,
and checks the space (or the read) once more before it sleeps. One of the two always sees the
other, so a wake-up is never lost. Reads are reported here rather than over the link's socket so
that a sender whose own reading is paused (its inbox full) still learns of them.

The mailbox holds one small message at a time (the link decides when it may be used): a
receiver that polls in place takes it without a frame on the socket or a wake-up. The sender
writes the message, fences, counts it in ``mailed``, fences, and reads ``polling``; the receiver
that stops polling clears ``polling``, fences, and looks at ``mailed`` once more. (The fences
that only keep stores in order among themselves, or loads among themselves, are left out on
x86, whose processors never reorder those: only a store followed by a load needs one there.) One of the two
always sees the other: either the receiver takes the message in its last look, or the sender
sees that nobody polls and wakes the receiver (its eventfd). The receiver copies the message out
before it counts it in ``taken``, and the sender writes the mailbox only once ``taken`` has
caught up with ``mailed``. ``wrote`` lets a polling receiver skip reading a socket that holds
no frame.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import TypeVar

from ._shm import RING_HEADER, STORES_IN_ORDER, fence, fence_enter, fence_leave

__all__ = ["MAIL_BYTES", "NEWS_FRAMES", "NEWS_MAIL", "RingReader", "RingWriter"]

_FREED, _WAITING, _READ, _OFFERED = 0, 8, 16, 24  # int64 indexes into the header page
_MAILED, _TAKEN, _POLLING, _DISPATCHED, _MAIL_LEN, _WROTE = 32, 40, 48, 56, 64, 66
_WRITTEN = 80
_MAIL_AT = 1024
MAIL_BYTES = RING_HEADER - _MAIL_AT  # a mailbox message, packed (its tag, meta and payload)
NEWS_MAIL, NEWS_FRAMES = 1, 2  # RingReader.news's bits
_ALIGN = 64
_P = TypeVar("_P")
_T = TypeVar("_T")


class _RingSide:
    """Views of a ring's counters and data (either side)."""

    __slots__ = ("_ctl", "_data", "_mail", "capacity")

    def __init__(self, mem: mmap.mmap) -> None:
        whole = memoryview(mem)
        self.capacity = len(mem) - RING_HEADER
        self._ctl = whole[:RING_HEADER].cast("q")
        self._mail = whole[_MAIL_AT:RING_HEADER]
        self._data = whole[RING_HEADER:]
        whole.release()

    def close(self) -> None:
        """Drop our views of the memory (the mapping can then be closed)."""
        self._ctl.release()
        self._mail.release()
        self._data.release()


class RingWriter(_RingSide):
    """The sending side of a ring (in our own memory)."""

    __slots__ = ("_end", "_mailed", "head")

    def __init__(self, mem: mmap.mmap) -> None:
        super().__init__(mem)
        self.head = 0  # absolute position where the next chunk may start
        self._end = 0  # absolute end of the last chunk written
        self._mailed = 0  # messages put in the mailbox so far

    def _place(self, n: int) -> int:
        """Where a chunk of ``n`` bytes (at most the capacity) would start (absolute), or -1
        when it does not fit yet.

        A ring the receiver has emptied takes the chunk at its first byte: request-reply
        traffic then keeps reusing the first pages, warm in both processes' caches and already
        faulted in, instead of walking through all of the ring's memory; and any chunk up to
        the capacity fits there. Otherwise a chunk that would cross the end starts over at the
        beginning, and the bytes skipped stay counted until the receiver frees past them."""
        cap = self.capacity
        pos = self.head
        off = pos % cap
        freed = self._ctl[_FREED]
        if freed == self._end:  # empty: everything written has been read
            return pos + cap - off if off else pos
        if off + n > cap:
            pos += cap - off
        return pos if pos + n - freed <= cap else -1

    def has_room(self, n: int) -> bool:
        return self._place(n) >= 0

    def reserve(self, n: int) -> int:
        """Take room for a chunk of ``n`` bytes (at most the capacity), to be filled next;
        returns the chunk's absolute end, or -1 when there is no room for it yet."""
        pos = self._place(n)
        if pos < 0:
            return -1
        end = self._end = pos + n
        self.head = (end + _ALIGN - 1) & -_ALIGN
        return end

    def fill(self, end: int, n: int, at: int, src: memoryview) -> None:
        """Copy ``src`` to byte ``at`` of the reserved ``n``-byte chunk that ends at ``end``
        (pieces in order, up to its end), and count it in ``written``."""
        start = end - n + at
        off = start % self.capacity
        k = len(src)
        self._data[off : off + k] = src
        if not STORES_IN_ORDER:
            fence()  # the bytes are there before they are counted
        self._ctl[_WRITTEN] = start + k

    def write(self, src: memoryview) -> int:
        """Copy ``src`` (at most the capacity) into the ring as one chunk; returns the chunk's
        absolute end, or -1 when there is no room for it yet (nothing written)."""
        n = len(src)
        end = self.reserve(n)
        if end >= 0:
            self.fill(end, n, 0, src)
        return end

    def sleep_unless_room(self, n: int) -> bool:
        """Say we wait for space; True when there still is none (sleep until woken), False when
        some was freed meanwhile (the flag is taken back)."""
        return self._sleep_unless(lambda: self.has_room(n))

    def _sleep_unless(self, ready: Callable[[], bool]) -> bool:
        self._ctl[_WAITING] = 1
        fence()  # the flag is visible before we look once more (at ``freed`` or ``read``)
        if ready():
            self._ctl[_WAITING] = 0
            return False
        return True

    def woken(self) -> None:
        self._ctl[_WAITING] = 0

    def offer(self, key: int) -> None:
        """Say that the payload of ``key`` may be read from our memory (0: none may any more)."""
        self._ctl[_OFFERED] = key
        fence()  # withdrawn before the payload is let go; offered before its frame is sent

    def was_read(self, key: int) -> bool:
        return bool(self._ctl[_READ] >= key)

    def sleep_unless_read(self, key: int) -> bool:
        """Say we wait for the read of ``key``; True when it has not happened (sleep until
        woken), False when it has meanwhile (the flag is taken back)."""
        return self._sleep_unless(lambda: self.was_read(key))

    @property
    def freed(self) -> int:
        return int(self._ctl[_FREED])

    @property
    def mailed(self) -> int:
        """How many messages we have put in the mailbox."""
        return self._mailed

    def mail_open(self, frames: int) -> bool:
        """Whether the receiver has taken our last message out of the mailbox and has dispatched
        all ``frames`` socket frames we wrote so far: a message put in the mailbox now is the
        next it takes, whichever way it looks first."""
        ctl = self._ctl
        return ctl[_TAKEN] == self._mailed and ctl[_DISPATCHED] == frames

    def peer_waits(self, frames: int) -> bool:
        """Whether the receiver says it polls the mailbox in place (it waits for a message) and
        ``mail_open(frames)``: it has taken in all we sent."""
        return self._ctl[_POLLING] == 1 and self.mail_open(frames)

    def wrote(self, frames: int) -> None:
        """Say that the link has written ``frames`` socket frames so far."""
        self._ctl[_WROTE] = frames

    def mail(self, frames: int, pack: Callable[[_P], bytes], parts: _P) -> bool | None:
        """Put ``pack(parts)`` in the mailbox when ``mail_open(frames)`` says so and it fits
        (``MAIL_BYTES`` at most), packed only then: None when not (send it another way); else
        True when the receiver still polls, False when it stopped meanwhile (it may not have
        seen the message: wake it)."""
        ctl = self._ctl
        if ctl[_TAKEN] != self._mailed or ctl[_DISPATCHED] != frames:
            return None
        message = pack(parts)
        n = len(message)
        if n > MAIL_BYTES:
            return None
        self._mail[:n] = message
        ctl[_MAIL_LEN] = n
        if not STORES_IN_ORDER:
            fence()  # the message is whole before it is counted
        mailed = self._mailed = self._mailed + 1
        ctl[_MAILED] = mailed
        fence_enter()  # (fence: counted before we look whether the receiver still polls)
        fence_leave()
        return ctl[_POLLING] != 0


class RingReader(_RingSide):
    """The receiving side of a ring (in the peer's memory, mapped here)."""

    __slots__ = ("_taken", "consumed")

    def __init__(self, mem: mmap.mmap) -> None:
        super().__init__(mem)
        self.consumed = 0  # absolute end of the last chunk released
        self._taken = 0  # mailbox messages taken out so far

    def chunk(self, end: int, n: int) -> memoryview:
        """The ``n`` bytes of the chunk that ends at absolute position ``end`` (as a frame said).

        Raises:
            ValueError: the chunk is not where the next one can be (a peer that breaks the
                protocol must not make us read outside the ring or ahead of its writes).
        """
        cap = self.capacity
        start = end - n
        # After the last chunk read, the next starts at most a skip (to the ring's start) and
        # an alignment further on.
        if not (0 < n <= cap and self.consumed <= start < self.consumed + cap + _ALIGN):
            raise ValueError(f"a chunk of {n} bytes ending at {end} does not follow position {self.consumed}")
        off = start % cap
        if off + n > cap:
            raise ValueError(f"a chunk of {n} bytes at ring offset {off} crosses the end of the ring")
        return self._data[off : off + n]

    def written(self) -> int:
        """The absolute end of the bytes the sender has copied into the data so far (those
        before it may be read)."""
        written = int(self._ctl[_WRITTEN])
        if not STORES_IN_ORDER:
            fence()  # the bytes are read after their count
        return written

    def still_offered(self, key: int) -> bool:
        """Whether the sender still offers the payload of ``key`` (it had not let go of it
        before our read of it ended)."""
        fence()  # our read is complete before we look
        return bool(self._ctl[_OFFERED] == key)

    def report_read(self, key: int) -> bool:
        """Say the payload of ``key`` was copied out; True when the sender waits and must be
        woken."""
        self._ctl[_READ] = key
        fence()  # ``read`` is visible before we look whether the sender sleeps
        return bool(self._ctl[_WAITING])

    def release(self, end: int) -> bool:
        """Free the ring up to ``end`` (every chunk before it was copied out); True when the
        sender waits for space and must be woken."""
        self.consumed = end
        self._ctl[_FREED] = end
        fence()  # ``freed`` is visible before we look whether the sender sleeps
        return bool(self._ctl[_WAITING])

    def start_polling(self, in_place: bool = True) -> None:
        """Say that we poll the mailbox, in place or in the event loop's turns (a sender that
        does not see it yet only wakes us)."""
        self._ctl[_POLLING] = 1 if in_place else 2

    def stop_polling(self) -> bool:
        """Say that we stopped polling; True when a message came meanwhile (take it: its sender
        may have seen us polling, and then does not wake us)."""
        self._ctl[_POLLING] = 0
        fence_enter()  # (fence: visible before we look at the mailbox once more)
        fence_leave()
        return self._ctl[_MAILED] != self._taken

    def dispatched(self, frames: int) -> None:
        """Say that the link's first ``frames`` socket frames from the sender were dispatched."""
        self._ctl[_DISPATCHED] = frames

    @property
    def taken(self) -> int:
        """How many mailbox messages we have taken out."""
        return self._taken

    def has_mail(self) -> bool:
        return self._ctl[_MAILED] != self._taken

    def news(self, frames: int) -> int:
        """What the sender left for us in one look: ``NEWS_MAIL`` set when the mailbox holds a
        message we have not taken, ``NEWS_FRAMES`` when it says it wrote socket frames beyond
        the first ``frames``; 0 when neither."""
        ctl = self._ctl
        return (ctl[_MAILED] != self._taken) | (ctl[_WROTE] != frames) << 1

    def frames_written(self) -> int:
        """How many socket frames the sender says it wrote."""
        return int(self._ctl[_WROTE])

    def mail(self, unpack: Callable[[memoryview], _T]) -> _T | None:
        """The mailbox's message when there is one we have not taken, as ``unpack`` reads it
        where it lies (it must copy what it keeps), then counted as taken (the sender may write
        the mailbox again); None when there is none.

        Raises:
            ValueError: the counters or the length are not what the protocol allows.
        """
        ctl = self._ctl
        mailed = ctl[_MAILED]
        taken = self._taken
        if mailed == taken:
            return None
        if not STORES_IN_ORDER:
            fence()  # the message is read after its count
        n = ctl[_MAIL_LEN]
        if mailed != taken + 1 or not 0 < n <= MAIL_BYTES:
            raise ValueError(f"a mailbox message #{mailed} of {n} bytes after message #{taken}")
        message = unpack(self._mail[:n])
        if not STORES_IN_ORDER:
            fence()  # the message is read before the sender may write the mailbox again
        self._taken = mailed
        ctl[_TAKEN] = mailed
        return message
