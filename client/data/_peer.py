"""One authenticated worker-to-worker link: socket I/O, the peer handshake, framing.

Imports only foundations (aiocoll._errors, aiocoll.protocol); never the public surface. It exists
so that the TCP transport (client/data/transports/tcp.py) deals in messages and matching while this
module deals in bytes: a non-blocking socket driven by the loop's add_reader/add_writer, with

- zero-copy sends: ``sendmsg`` straight from the caller's memoryviews; what the kernel does not
  take at once stays queued *as views* and the sender waits until it is handed off, so a send
  returns only when its payload may be reused (and that wait is the backpressure);
- zero-copy receives: ``recv_into`` the FrameDecoder's buffer, which for a matched message is the
  destination tensor's memory (the decoder's payload sink);
- pause/resume of reading, so a full inbox stops the link instead of growing without bound.

We own the socket rather than using an asyncio Transport because a Transport copies whatever the
kernel does not accept at once (and, before Python 3.12, joins writelines into one bytes object).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from aiocoll._env import env_float, env_int
from aiocoll._errors import AuthenticationError, ProtocolError
from aiocoll.protocol import (
    HANDSHAKE_MAX_HEADER,
    MAGIC,
    PREFIX,
    ClientHandshake,
    Frame,
    FrameDecoder,
    PayloadSink,
    ServerHandshake,
)

__all__ = ["PEER_ROLE", "PeerLink", "client_handshake", "dialler_rank", "server_handshake"]

log = logging.getLogger("aiocoll.client.peer")

PEER_ROLE = "peer"
# recv_into calls per readable event: enough to drain a large payload without starving the loop.
_READS_PER_EVENT = 64
# SO_RCVLOWAT inside large payloads (see PeerLink._wake_after).
_LOWAT_MIN = 128 * 1024
_LOWAT_MAX = 1024 * 1024
_IOV_MAX = 64


def _spin_seconds() -> float:
    """AIOCOLL_SPIN_US (opt-in, default 0: off): how long to busy-poll inside a large payload."""
    value = env_float("AIOCOLL_SPIN_US") or 0.0
    if value < 0:
        raise ValueError(f"environment variable AIOCOLL_SPIN_US={value} must be 0 or more microseconds")
    return value / 1e6


_SPIN_SECONDS = _spin_seconds()


def _tune(sock: socket.socket) -> None:
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = env_int("AIOCOLL_SOCKBUF")
    if size:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise ConnectionError("the connection closed during the peer handshake")
        got += k
    return bytes(buf)


async def _recv_frame_bytes(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """Read exactly one header-only handshake frame, so no byte after it is consumed here."""
    prefix = await _recv_exactly(loop, sock, PREFIX.size)
    header_len, payload_len = PREFIX.unpack(prefix)
    if header_len == 0 or header_len > HANDSHAKE_MAX_HEADER or payload_len != 0:
        raise ProtocolError(
            f"handshake frame announces {header_len} header bytes and {payload_len} payload bytes; "
            f"not an aiocoll peer"
        )
    return prefix + await _recv_exactly(loop, sock, header_len)


async def client_handshake(
    sock: socket.socket,
    *,
    token: str | bytes | None,
    job: str,
    rank: int,
    peer: int,
    address: str | None = None,
) -> None:
    """Authenticate an outgoing link as ``rank`` of ``job`` (role "peer") to ``peer`` at ``address``
    (HOST:PORT, for the errors).

    Raises:
        AuthenticationError: the tokens differ or the peer refused us (naming the peer).
        ProtocolError / ConnectionError: the other end is not an aiocoll peer, or went away.
    """
    loop = asyncio.get_running_loop()
    hs = ClientHandshake(token, role=PEER_ROLE, job=job, extra={"rank": rank, "to": peer})
    where = address or f"rank {peer}'s address"
    hs.name_server(where, f"rank {peer} at {address}" if address else f"rank {peer}")
    await loop.sock_sendall(sock, hs.start())
    while not hs.done:
        # One frame at a time, so no byte after the last one is consumed here. The handshake sees
        # the prefix first: on the first frame it names what answered when that is not a peer.
        prefix = await _recv_exactly(loop, sock, PREFIX.size)
        hs.receive_data(prefix)
        header_len, _ = PREFIX.unpack(prefix)
        out = hs.receive_data(await _recv_exactly(loop, sock, header_len))
        if out:
            await loop.sock_sendall(sock, out)


def dialler_rank(hello: dict[str, Any], *, job: str, rank: int, world_size: int | None) -> int:
    """The rank an authenticated dialler claims in its hello, once the claim fits this listener.

    Every link kind accepts the same way: higher ranks dial lower ones (below ``world_size`` where
    the listener knows it), naming this job and this rank. Whether that rank is already linked is
    the caller's to check, per link kind.

    Raises:
        ProtocolError: naming what in the claim was wrong.
    """
    peer = hello.get("rank")
    if hello.get("job") != job:
        raise ProtocolError(f"peer names job {hello.get('job')!r}, this rank serves {job!r}")
    if not isinstance(peer, int) or peer <= rank or (world_size is not None and peer >= world_size):
        span = f"{rank + 1}..{world_size - 1}" if world_size is not None else f"above {rank}"
        raise ProtocolError(f"peer claims rank {peer!r}; only ranks {span} dial rank {rank}")
    if hello.get("to") != rank:
        raise ProtocolError(f"peer meant to reach rank {hello.get('to')!r}, this is rank {rank}")
    return peer


async def server_handshake(sock: socket.socket, *, token: str | bytes | None) -> dict[str, Any]:
    """Authenticate an incoming link; returns the peer's hello (job, rank, ...).

    On failure a REJECT frame is sent when the peer spoke our protocol, then the error propagates.

    Raises:
        AuthenticationError, ProtocolError, ConnectionError.
    """
    loop = asyncio.get_running_loop()
    hs = ServerHandshake(token, roles={PEER_ROLE})
    try:
        hs.receive_data(await _recv_exactly(loop, sock, len(MAGIC)))
        while not hs.done:
            out = hs.receive_data(await _recv_frame_bytes(loop, sock))
            if out:
                await loop.sock_sendall(sock, out)
    except AuthenticationError as exc:
        try:
            sock.send(ServerHandshake.reject_bytes(str(exc)))
        except OSError:
            pass
        raise
    return hs.hello


class PeerLink:
    """The byte-level side of one authenticated link to ``peer``.

    Args:
        sock: a connected, authenticated socket (made non-blocking here).
        peer: the other end's global rank.
        sink: where payloads land (see FrameDecoder).
        on_frames: called with the frames completed by one read, in order.
        on_close: called once with the reason when the link breaks or is closed.
        max_payload: the largest payload accepted from this (authenticated) peer.
    """

    # Frames of a read that wait behind one whose work goes on later (``on_frames`` stops at
    # that one and appends the rest here; the link kind that set it dispatches them, in order,
    # when that work is done): None while nothing waits so. The tcp kind never sets it.
    held: list[Frame] | None = None

    def __init__(
        self,
        sock: socket.socket,
        peer: int,
        *,
        sink: PayloadSink,
        on_frames: Callable[[PeerLink, list[Frame]], None],
        on_close: Callable[[PeerLink, str, bool], None],
        max_payload: int,
    ) -> None:
        _tune(sock)
        self.sock = sock
        self.peer = peer
        self._fd = sock.fileno()
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(max_header=64 * 1024, max_payload=max_payload, sink=sink)
        self._on_frames = on_frames
        self._on_close = on_close
        # Each entry: (remaining views, future resolved when they are all handed to the kernel).
        self._wqueue: deque[tuple[list[memoryview], asyncio.Future[None] | None]] = deque()
        self._writing = False
        self._reading = False
        self._lowat = 1
        self._frames_in = 0  # frames completed so far (read_now tells whether one came)
        self.frames_out = 0  # frames written (or queued to be) so far, less those withdrawn
        self.closed = False
        self.close_reason = ""

    # -- reading ---------------------------------------------------------------------------
    def resume_reading(self) -> None:
        if not self._reading and not self.closed:
            self._reading = True
            self._loop.add_reader(self._fd, self._on_readable)

    def pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    @property
    def reading(self) -> bool:
        return self._reading

    def _on_readable(self) -> None:
        self._read_some()
        if _SPIN_SECONDS and not self.closed:
            self._spin()
        if not self.closed:
            self._wake_after(self._decoder.payload_remaining)

    def _spin(self) -> None:
        """Inside a large payload, poll the socket (and push our own queued sends) for a bounded
        time before going back to the loop, whose idle wait is a sleep: under CPU load every
        sleep costs a scheduling delay before this process runs again. The bound restarts
        whenever bytes arrive. Only this link's queued sends are pushed meanwhile; other links
        wait for the loop (so a ring pipelines less)."""
        decoder = self._decoder
        clock = time.perf_counter
        deadline = clock() + _SPIN_SECONDS
        while self._reading and not self.closed and decoder.mid_frame:
            if self._wqueue:
                self._on_writable()
            remaining = decoder.payload_remaining
            self._read_some()
            if decoder.payload_remaining != remaining:
                deadline = clock() + _SPIN_SECONDS
            elif clock() > deadline:
                return

    def read_now(self) -> bool:
        """Read what the socket holds now, as the loop's reader does; True when a frame came."""
        before = self._frames_in
        self._read_some()
        return self._frames_in != before

    def _read_some(self) -> None:
        decoder = self._decoder
        recv_into = self.sock.recv_into
        for _ in range(_READS_PER_EVENT):
            if not self._reading:
                return
            target = decoder.get_buffer()
            try:
                n = recv_into(target)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"connection error: {exc}", lost=True)
                return
            if n == 0:
                why = "closed the connection mid-frame" if decoder.mid_frame else "closed the connection"
                self.close(why, lost=True)
                return
            try:
                frames = decoder.buffer_updated(n)
            except ProtocolError as exc:
                log.warning("peer link to rank %d: %s", self.peer, exc)
                self.close(f"protocol error: {exc}", lost=True)
                return
            if frames:
                self._frames_in += len(frames)
                self._on_frames(self, frames)
            if n < len(target) and not decoder.mid_frame:
                # Drained between frames: skip the read that would only say EAGAIN. (Inside a
                # large payload keep reading: more has usually arrived by now.)
                return

    def _wake_after(self, remaining: int) -> None:
        """Inside a large payload, ask the kernel to report the socket readable only once a
        good part of the rest has arrived (SO_RCVLOWAT, never more than the rest, so the rest
        always satisfies it): each wake-up costs a loop iteration and a read, and a peer
        streaming megabytes would otherwise wake us per 64 KiB. Between frames (and for small
        remainders) any byte wakes us again. Set after every read callback, whatever ended it,
        so a pause or a frame boundary never leaves a mark that small frames cannot reach."""
        lowat = min(remaining, _LOWAT_MAX) if remaining >= _LOWAT_MIN else 1
        if lowat != self._lowat:
            self._lowat = lowat
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, lowat)

    # -- writing ---------------------------------------------------------------------------
    def write(self, views: list[memoryview]) -> asyncio.Future[None] | None:
        """Hand ``views`` (one frame) to the kernel; returns None when done at once, else a future.

        The frame's bytes are never reordered with other frames and never copied.
        """
        self.frames_out += 1
        if not self._wqueue:
            try:
                sent = self.sock.sendmsg(views)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self.close(f"send failed: {exc}", lost=True)
                raise ConnectionError(self.close_reason) from exc
            views = _advance(views, sent)
            if not views:
                return None
        fut: asyncio.Future[None] = self._loop.create_future()
        self._wqueue.append((views, fut))
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._fd, self._on_writable)
        return fut

    def write_nowait(self, views: list[memoryview]) -> None:
        """Queue a small frame nobody waits for (control messages)."""
        fut = self.write(views)
        if fut is not None:
            fut.add_done_callback(_consume_exception)

    def _on_writable(self) -> None:
        queue = self._wqueue
        while queue:
            views, fut = queue[0]
            batch = views[:_IOV_MAX]
            try:
                sent = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self.close(f"send failed: {exc}", lost=True)
                return
            rest = _advance(views, sent)
            if rest:
                queue[0] = (rest, fut)
                if sent < sum(len(v) for v in batch):
                    return  # the kernel is full; wait for the next writable event
                continue
            queue.popleft()
            if fut is not None and not fut.done():
                fut.set_result(None)
        self._writing = False
        self._loop.remove_writer(self._fd)

    def drop_unsent(self, fut: asyncio.Future[None]) -> bool:
        """Forget a queued frame none of whose bytes have left yet; False if it has started."""
        for i, (_views, f) in enumerate(self._wqueue):
            if f is fut:
                if i == 0:
                    return False  # possibly partly sent: the frame must complete for the stream's sake
                del self._wqueue[i]
                self.frames_out -= 1
                return True
        return True

    @property
    def mid_frame(self) -> bool:
        return self._decoder.mid_frame

    @property
    def write_backlog(self) -> int:
        return len(self._wqueue)

    # -- closing ---------------------------------------------------------------------------
    def close(self, reason: str, *, lost: bool) -> None:
        """Close at once (pending writes fail); ``lost`` says whether it was unexpected."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)
        if self._writing:
            self._writing = False
            self._loop.remove_writer(self._fd)
        err = ConnectionError(f"link to rank {self.peer} closed: {reason}")
        while self._wqueue:
            _, fut = self._wqueue.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(err)
        try:
            self.sock.close()
        except OSError:
            pass
        self._on_close(self, reason, lost)

    async def flush(self, timeout: float) -> None:
        """Wait (bounded) until every queued frame has left."""
        if self._wqueue:
            last = self._wqueue[-1][1]
            if last is not None:
                try:
                    await asyncio.wait_for(asyncio.shield(last), timeout)
                except (asyncio.TimeoutError, ConnectionError):
                    pass


def _advance(views: list[memoryview], sent: int) -> list[memoryview]:
    """Drop ``sent`` bytes from the front of ``views`` (slicing, never copying)."""
    i = 0
    while i < len(views) and sent >= len(views[i]):
        sent -= len(views[i])
        i += 1
    if i == len(views):
        return []
    rest = views[i:]
    if sent:
        rest[0] = rest[0][sent:]
    return rest


def _consume_exception(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()
