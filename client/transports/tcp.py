"""The TCP transport: authenticated peer links between the workers of one job, and message matching.

Imports only foundations (aiocoll._errors, aiocoll.protocol, aiocoll.algorithms._transport) and
client/_peer.py; never the public surface. It implements the Transport ABC that the algorithm
executor and the engine run over, so a shared-memory or CUDA transport can replace it per peer
without touching either.

Topology: every worker listens on an ephemeral port of the interface that routes to the
coordinator (127.0.0.1 on loopback) and advertises it through rendezvous; the link between two
ranks is dialled by the higher rank, so there is exactly one per pair and no tie to break. Each
link authenticates (token, job, rank) before any frame is parsed.

Wire format after the handshake: frames (aiocoll.protocol) whose header is ``{"t": tag, "m": meta}``
for a message and ``{"k": "bye"}`` for an orderly goodbye. A message whose recv is already posted
is received straight into the recv's buffer; others wait in a bounded per-peer inbox (the link
stops reading while it is full). The bound is backpressure by design: a rank that runs more than
``inbox_messages`` messages (or ``inbox_bytes``) ahead of a peer waits for it, and an application
whose ranks wait on each other beyond that bound gets a CollectiveTimeout, not unbounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

from aiocoll._deadline import Deadline
from aiocoll._errors import (
    AuthenticationError,
    DistError,
    MismatchError,
    PeerLostError,
    ProtocolError,
    RendezvousError,
)
from aiocoll.algorithms._transport import LostPeerHandler, RecvCallback, Tag, Transport
from aiocoll.protocol import PREFIX, Frame

from .._peer import PeerLink, client_handshake, server_handshake

__all__ = ["StrayHandler", "TcpTransport", "route_interface"]

log = logging.getLogger("aiocoll.client.tcp")

_HANDSHAKE_TIMEOUT = 10.0
_MAX_PENDING_HANDSHAKES = 64
_DISCARD_MEMORY = 4096
_UNZEROED_MIN = 64 * 1024
_BYE = PREFIX.pack(len(msgpack.packb({"k": "bye"})), 0) + msgpack.packb({"k": "bye"})
_EMPTY = memoryview(b"")

StrayHandler = Callable[[int, Tag, dict[str, Any]], None]


def route_interface(host: str, port: int = 9) -> str:
    """The local IP address the kernel would use to reach ``host`` (no packet is sent, no DNS
    reverse lookup); loopback for a loopback host.

    Args:
        host: an IP literal or a name (resolved forwards only).
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(addr)
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1" if family == socket.AF_INET else "::1"


class _Notify:
    """A posted receive whose outcome goes straight to a callback, from inside the read callback
    (``post_recv``); it answers the few Future methods the matching code calls."""

    __slots__ = ("_callback", "_done")

    def __init__(self, callback: RecvCallback) -> None:
        self._callback = callback
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, result: Any) -> None:  # (src, meta): post_recv never asks for in_place
        self._hand_over(result, None)

    def set_exception(self, exc: BaseException) -> None:
        self._hand_over(None, exc)

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
        except Exception:  # the reader's state must survive a faulty callback
            log.exception("a receive callback failed")


class _Recv:
    """A posted receive. ``in_place``: its result names the memory holding the payload (``into``,
    or the buffer an early payload already landed in, which is then not copied)."""

    __slots__ = ("fut", "in_place", "into", "order", "src", "tag")

    def __init__(
        self,
        src: int | None,
        tag: Tag,
        into: memoryview,
        fut: asyncio.Future[Any] | _Notify,
        order: int,
        in_place: bool = False,
    ):
        self.src = src
        self.tag = tag
        self.into = into
        self.fut = fut
        self.order = order
        self.in_place = in_place


class _Mismatched:
    """A receive bound to a message of another size (it fails once the message is read)."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: _Recv) -> None:
        self.waiter = waiter


class _Msg:
    """A message that arrived before its receive."""

    __slots__ = ("meta", "payload", "src")

    def __init__(self, src: int, meta: dict[str, Any], payload: memoryview):
        self.src = src
        self.meta = meta
        self.payload = payload


def _consume_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _take_matching(posted: dict[Any, deque[_Recv]], matches: Callable[[Any], bool]) -> list[_Recv]:
    """Remove the queues of ``posted`` whose key ``matches``; their receives, in order."""
    return [waiter for key in [k for k in posted if matches(k)] for waiter in posted.pop(key)]


def _as_bytes_view(buf: memoryview) -> memoryview:
    if buf.format == "B" and buf.ndim == 1:
        return buf
    return buf.cast("B")


def _length_mismatch(src: int, tag: Tag, got: int, want: int, meta: dict[str, Any]) -> MismatchError:
    err = MismatchError(
        f"rank {src} sent {got} bytes for message {tag!r} but this rank expected {want}: the ranks "
        f"called the operation with different sizes or dtypes (sender's signature: {meta!r})",
        ranks=[src],
    )
    err.remote_meta = meta  # type: ignore[attr-defined]
    return err


class TcpTransport(Transport):
    """Authenticated TCP links to every other rank of a job.

    Use: ``addr = await t.listen(host)``; publish ``addr`` through rendezvous; then
    ``await t.connect(addrs_by_rank, deadline)``.

    Args:
        rank, world_size: this process's global rank and the job's size.
        token: shared secret (None: the empty secret). job: the job id every peer must name.
        inbox_bytes, inbox_messages: per-peer bounds on messages buffered before their recv.
        max_payload: the largest single message accepted from a peer.
    """

    def __init__(
        self,
        rank: int | None,
        world_size: int | None,
        *,
        token: str | bytes | None,
        job: str,
        inbox_bytes: int = 64 * 1024 * 1024,
        inbox_messages: int = 8192,
        max_payload: int = 1 << 40,
    ) -> None:
        self.rank = -1
        self.world_size = 0
        self._identity: asyncio.Future[None] | None = None
        if rank is not None and world_size is not None:
            self.assign(rank, world_size)
        self._token = token
        self._job = job
        self._inbox_bytes = inbox_bytes
        self._inbox_messages = inbox_messages
        self._max_payload = max_payload
        self._loop: asyncio.AbstractEventLoop | None = None
        self._links: dict[int, PeerLink] = {}
        self._link_ready: dict[int, asyncio.Future[None]] = {}
        self._lost: dict[int, str] = {}
        self._handlers: list[LostPeerHandler] = []
        # Matching state, shared by every link.
        self._posted: dict[tuple[int, Tag], deque[_Recv]] = {}
        self._posted_any: dict[Tag, deque[_Recv]] = {}
        self._inbox: dict[Tag, deque[_Msg]] = {}
        self._inbox_count: dict[int, int] = {}
        self._inbox_size: dict[int, int] = {}
        # Receives whose buffer the decoder is filling (or has filled within the current read),
        # in stream order: one read may complete several frames before they are dispatched.
        self._filling: dict[int, deque[_Recv | _Mismatched | None]] = {}
        self._order = 0
        # Prefixes of finished operations (by length): late messages under them are dropped, or
        # reported as strays when the operation finished successfully (see ``retire``).
        self._discarded: dict[int, dict[Tag, bool]] = {}
        self._discard_fifo: deque[Tag] = deque()
        self._stray_handlers: list[StrayHandler] = []
        self._packer = msgpack.Packer(use_bin_type=True)
        # Listening side.
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] | None = None
        self.rejected = 0  # incoming connections refused (bad bytes, wrong token or job)
        # Diagnostics: payloads received straight into their recv's buffer vs. through the inbox.
        self.received_direct = 0
        self.received_buffered = 0
        self._closed = False

    # -- setup -----------------------------------------------------------------------------
    def assign(self, rank: int, world_size: int) -> None:
        """Fix this process's rank once rendezvous has assigned it (before ``connect``).

        Raises:
            ValueError: rank outside 0..world_size-1.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        self.rank = rank
        self.world_size = world_size
        if self._identity is not None and not self._identity.done():
            self._identity.set_result(None)

    async def _known_identity(self) -> None:
        if self.world_size:
            return
        if self._identity is None:
            self._identity = self._get_loop().create_future()
        await asyncio.shield(self._identity)

    async def listen(self, host: str = "127.0.0.1") -> tuple[str, int]:
        """Start accepting peer links on an ephemeral port of ``host``; returns (host, port)."""
        self._loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((host, 0))
            lsock.listen(max(128, self.world_size or 0))
            lsock.setblocking(False)
        except OSError:
            lsock.close()
            raise
        self._listener = lsock
        self.address = (host, int(lsock.getsockname()[1]))
        self._accept_task = self._loop.create_task(self._accept_loop(lsock))
        return self.address

    async def connect(
        self, addrs: Mapping[int, Sequence[Sequence[Any]]], deadline: Deadline | None = None
    ) -> None:
        """Dial every lower rank and wait until every higher rank has dialled us.

        Args:
            addrs: rank -> [(host, port), ...] as advertised in rendezvous.
            deadline: the rendezvous budget.
        Raises:
            RendezvousError: a link could not be made within the deadline (names the ranks).
            AuthenticationError: a peer refused our token.
        """
        deadline = deadline or Deadline(None)
        loop = self._get_loop()
        for peer in range(self.world_size):
            if peer != self.rank:
                self._ready_future(peer)
        dials = [loop.create_task(self._dial(p, addrs.get(p, ()), deadline)) for p in range(self.rank)]
        waits = [self._link_ready[p] for p in range(self.world_size) if p != self.rank]
        try:
            if waits:
                done, pending = await asyncio.wait(
                    waits, timeout=deadline.remaining(), return_when=asyncio.FIRST_EXCEPTION
                )
                for fut in done:
                    fut.result()
                if pending:
                    missing = [
                        p for p in range(self.world_size) if p != self.rank and not self._link_ready[p].done()
                    ]
                    raise RendezvousError(
                        f"rank {self.rank}: no peer link with rank(s) {missing} within the rendezvous "
                        f"timeout; check that they run, share the token and job, and can reach each "
                        f"other's advertised addresses"
                    )
        finally:
            for task in dials:
                task.cancel()

    def _ready_future(self, peer: int) -> asyncio.Future[None]:
        fut = self._link_ready.get(peer)
        if fut is None:
            fut = self._get_loop().create_future()
            self._link_ready[peer] = fut
        return fut

    async def _dial(self, peer: int, addrs: Sequence[Sequence[Any]], deadline: Deadline) -> None:
        loop = self._get_loop()
        last: BaseException | None = None
        delay = 0.01
        while True:
            for addr in addrs:
                host, port = str(addr[0]), int(addr[1])
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    await loop.sock_connect(sock, (host, port))
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await asyncio.wait_for(
                        client_handshake(sock, token=self._token, job=self._job, rank=self.rank, peer=peer),
                        min(_HANDSHAKE_TIMEOUT, deadline.remaining() or _HANDSHAKE_TIMEOUT),
                    )
                except AuthenticationError as exc:
                    sock.close()
                    fut = self._ready_future(peer)
                    if not fut.done():
                        fut.set_exception(
                            AuthenticationError(
                                f"rank {peer} at {host}:{port} refused rank {self.rank}: {exc}"
                            )
                        )
                    return
                except (OSError, ProtocolError, asyncio.TimeoutError) as exc:
                    sock.close()
                    last = exc
                    continue
                self._add_link(sock, peer)
                return
            if deadline.expired():
                fut = self._ready_future(peer)
                if not fut.done():
                    fut.set_exception(
                        RendezvousError(
                            f"rank {self.rank} could not reach rank {peer} at {list(addrs)}: {last}"
                        )
                    )
                return
            await asyncio.sleep(min(delay, deadline.remaining() or delay))
            delay = min(delay * 2, 0.5)

    async def _accept_loop(self, lsock: socket.socket) -> None:
        loop = self._get_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(lsock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("rank %d: accept failed (%s); pausing briefly", self.rank, exc)
                    await asyncio.sleep(0.1)
                    continue
                if self._closed:
                    return
                raise
            if len(self._handshakes) >= _MAX_PENDING_HANDSHAKES:
                log.warning("rank %d: too many unfinished peer handshakes; closing %s", self.rank, addr)
                sock.close()
                self.rejected += 1
                continue
            task = loop.create_task(self._accept_one(sock, addr))
            self._handshakes.add(task)
            task.add_done_callback(self._handshakes.discard)

    async def _accept_one(self, sock: socket.socket, addr: Any) -> None:
        sock.setblocking(False)
        try:
            hello = await asyncio.wait_for(server_handshake(sock, token=self._token), _HANDSHAKE_TIMEOUT)
            # A peer may dial before our own join reply arrived: wait (bounded) to learn our rank.
            await asyncio.wait_for(self._known_identity(), _HANDSHAKE_TIMEOUT)
            peer = hello.get("rank")
            if hello.get("job") != self._job:
                raise ProtocolError(f"peer names job {hello.get('job')!r}, this rank serves {self._job!r}")
            if not isinstance(peer, int) or not self.rank < peer < self.world_size:
                raise ProtocolError(
                    f"peer claims rank {peer!r}; only ranks {self.rank + 1}..{self.world_size - 1} "
                    f"dial rank {self.rank}"
                )
            if hello.get("to", self.rank) != self.rank:
                raise ProtocolError(f"peer meant to reach rank {hello.get('to')!r}, this is rank {self.rank}")
            if peer in self._links or peer in self._lost:
                raise ProtocolError(f"rank {peer} already has (or had) a link to rank {self.rank}")
        except (AuthenticationError, ProtocolError, OSError, asyncio.TimeoutError) as exc:
            why = (
                "handshake timed out"
                if isinstance(exc, asyncio.TimeoutError)
                else str(exc) or type(exc).__name__
            )
            log.warning("rank %d: refused a peer connection from %s: %s", self.rank, addr, why)
            self.rejected += 1
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        self._add_link(sock, peer)

    def _add_link(self, sock: socket.socket, peer: int) -> None:
        if self._closed:
            sock.close()
            return
        link = PeerLink(
            sock,
            peer,
            sink=lambda header, n: self._sink(peer, header, n),
            on_frames=self._on_frames,
            on_close=self._on_link_close,
            max_payload=self._max_payload,
        )
        self._links[peer] = link
        self._inbox_count.setdefault(peer, 0)
        self._inbox_size.setdefault(peer, 0)
        self._filling[peer] = deque()
        link.resume_reading()
        fut = self._ready_future(peer)
        if not fut.done():
            fut.set_result(None)

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # -- Transport -------------------------------------------------------------------------
    async def send(self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> None:
        """Send one message; returns when ``payload`` may be reused.

        Raises:
            PeerLostError: ``dst`` is gone.
        """
        if dst == self.rank:
            self._deliver(dst, tag, meta, memoryview(bytes(payload)))
            return
        link = self._links.get(dst)
        if link is None:
            link = await self._wait_link(dst)
        fut = self._write(link, dst, tag, payload, meta)
        if fut is not None:
            await self._finish_write(link, dst, fut)

    def send_nowait(
        self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> Awaitable[None] | None:
        """Start ``send`` without a coroutine: None when the kernel took the whole message at
        once (the common case for small messages), else an awaitable that finishes the send.

        Raises:
            PeerLostError: ``dst`` is gone (at once, when its link is known to be closed).
        """
        link = self._links.get(dst)
        if link is None or dst == self.rank:
            return self.send(dst, tag, payload, meta)
        fut = self._write(link, dst, tag, payload, meta)
        if fut is None:
            return None
        return self._finish_write(link, dst, fut)

    def _write(
        self, link: PeerLink, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> asyncio.Future[None] | None:
        head = self._packer.pack({"t": tag, "m": meta})
        try:
            if len(payload):
                body = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
                return link.write([memoryview(PREFIX.pack(len(head), len(body)) + head), body])
            return link.write([memoryview(PREFIX.pack(len(head), 0) + head)])
        except ConnectionError as exc:
            raise self._lost_error(dst) from exc

    async def _finish_write(self, link: PeerLink, dst: int, fut: asyncio.Future[None]) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            if not link.drop_unsent(fut):
                # Already on the wire: it completes for the stream's sake, unawaited; its outcome
                # (a closed link, say) must not be reported as never retrieved.
                fut.add_done_callback(_consume_outcome)
            raise
        except ConnectionError as exc:
            raise self._lost_error(dst) from exc

    async def _wait_link(self, dst: int) -> PeerLink:
        if dst in self._lost:
            raise self._lost_error(dst)
        if not 0 <= dst < self.world_size:
            raise ValueError(f"rank {dst} is outside the world of size {self.world_size}")
        if self._closed:
            raise DistError("the transport is closed")
        await asyncio.shield(self._ready_future(dst))
        link = self._links.get(dst)
        if link is None:
            raise self._lost_error(dst)
        return link

    def _lost_error(self, rank: int) -> PeerLostError:
        return PeerLostError(rank, self._lost.get(rank, "the link is closed"))

    async def recv(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        """Receive the next message ``tag`` from ``src`` (None: any rank) into ``into``.

        Raises:
            PeerLostError, MismatchError (wrong length; the message is consumed).
        """
        into = _as_bytes_view(into) if len(into) else _EMPTY
        got = self._take_buffered(src, tag, into)
        if got is not None:
            return got
        result: tuple[int, dict[str, Any]] = await self._posted_result(src, tag, into, in_place=False)
        return result

    async def recv_landed(
        self, src: int | None, tag: Tag, into: memoryview
    ) -> tuple[int, dict[str, Any], memoryview]:
        """``recv`` that may leave the payload where it arrived (see Transport.recv_landed): a
        message that came before its receive is not copied into ``into``."""
        into = _as_bytes_view(into) if len(into) else _EMPTY
        msg = self._pop_buffered(src, tag, len(into))
        if msg is not None:
            return msg.src, msg.meta, msg.payload
        landed: tuple[int, dict[str, Any], memoryview]
        landed = await self._posted_result(src, tag, into, in_place=True)
        return landed

    async def _posted_result(self, src: int | None, tag: Tag, into: memoryview, *, in_place: bool) -> Any:
        """Post a receive for a message not here yet and wait for its result (unposted again
        if the wait is cancelled)."""
        fut: asyncio.Future[Any] = self._get_loop().create_future()
        waiter = self._post(src, tag, into, fut, in_place=in_place)
        try:
            return await fut
        except asyncio.CancelledError:
            self._unpost(waiter)
            raise

    def post_recv(self, src: int | None, tag: Tag, into: memoryview, callback: RecvCallback) -> None:
        """``recv`` with its outcome handed to ``callback`` right where the message is read (no
        task, no extra loop iteration); see Transport.post_recv."""
        into = _as_bytes_view(into) if len(into) else _EMPTY
        try:
            got = self._take_buffered(src, tag, into)
            if got is None:
                self._post(src, tag, into, _Notify(callback))
                return
        except (DistError, MismatchError) as exc:
            callback(None, exc)
            return
        callback(got, None)

    def _pop_buffered(self, src: int | None, tag: Tag, want: int) -> _Msg | None:
        """Take a message that arrived before its receive (None: none yet).

        Raises:
            MismatchError: its payload is not ``want`` bytes long (it is consumed all the same).
        """
        queue = self._inbox.get(tag)
        if queue:
            for i, msg in enumerate(queue):
                if src is None or msg.src == src:
                    del queue[i]
                    if not queue:
                        del self._inbox[tag]
                    self._unbuffer(msg)
                    if len(msg.payload) != want:
                        raise _length_mismatch(msg.src, tag, len(msg.payload), want, msg.meta)
                    return msg
        return None

    def _take_buffered(
        self, src: int | None, tag: Tag, into: memoryview
    ) -> tuple[int, dict[str, Any]] | None:
        """Copy a message that arrived before its receive into ``into`` (None: none yet)."""
        msg = self._pop_buffered(src, tag, len(into))
        if msg is None:
            return None
        if len(into):
            into[:] = msg.payload
        return msg.src, msg.meta

    def _post(
        self,
        src: int | None,
        tag: Tag,
        into: memoryview,
        fut: asyncio.Future[Any] | _Notify,
        *,
        in_place: bool = False,
    ) -> _Recv:
        """Post a receive for a message not here yet.

        Raises:
            PeerLostError: ``src`` is gone. DistError: the transport is closed.
        """
        if src is not None and src in self._lost:
            raise self._lost_error(src)
        if self._closed:
            raise DistError("the transport is closed")
        self._order += 1
        waiter = _Recv(src, tag, into, fut, self._order, in_place)
        if src is None:
            self._posted_any.setdefault(tag, deque()).append(waiter)
        else:
            self._posted.setdefault((src, tag), deque()).append(waiter)
        return waiter

    def _unpost(self, waiter: _Recv) -> None:
        if waiter.src is None:
            anyq = self._posted_any.get(waiter.tag)
            if anyq is not None:
                with contextlib.suppress(ValueError):
                    anyq.remove(waiter)
                if not anyq:
                    del self._posted_any[waiter.tag]
            return
        key = (waiter.src, waiter.tag)
        queue = self._posted.get(key)
        if queue is not None:
            with contextlib.suppress(ValueError):
                queue.remove(waiter)
            if not queue:
                del self._posted[key]

    def _unbuffer(self, msg: _Msg) -> None:
        if msg.src == self.rank:
            return
        self._inbox_count[msg.src] -= 1
        self._inbox_size[msg.src] -= len(msg.payload)
        link = self._links.get(msg.src)
        if (
            link is not None
            and not link.reading
            and self._inbox_count[msg.src] < self._inbox_messages
            and self._inbox_size[msg.src] < self._inbox_bytes
        ):
            link.resume_reading()

    def discard(self, tag_prefix: Tag) -> None:
        """Drop buffered messages and cancel posted recvs under ``tag_prefix``; late ones are dropped too."""
        self._forget(tag_prefix, report=False)

    def retire(self, tag_prefix: Tag) -> None:
        """Mark an operation that completed successfully: any message under ``tag_prefix`` still
        buffered, or arriving later, was sent by a rank that disagrees about the operation, and is
        handed to the stray handlers (the engine turns it into a MismatchError)."""
        self._forget(tag_prefix, report=True)

    def on_stray(self, handler: StrayHandler) -> None:
        """Register ``handler(src, tag, meta)`` for messages under a retired prefix."""
        self._stray_handlers.append(handler)

    def _forget(self, tag_prefix: Tag, *, report: bool) -> None:
        n = len(tag_prefix)
        strays: list[tuple[int, Tag, dict[str, Any]]] = []
        if self._inbox:
            for tag in [t for t in self._inbox if t[:n] == tag_prefix]:
                for msg in self._inbox.pop(tag):
                    self._unbuffer(msg)
                    strays.append((msg.src, tag, msg.meta))
        if report:
            # A finished operation has no receives left: only late messages need watching for.
            self._remember(tag_prefix, report)
            for src, tag, meta in strays:
                self._stray(src, tag, meta)
            return
        # Unpost every matching receive before cancelling any: a cancelled receive may call back
        # into its operation (post_recv), which may discard other prefixes right away.
        waiters = _take_matching(self._posted, lambda key: key[1][:n] == tag_prefix)
        waiters += _take_matching(self._posted_any, lambda tag: tag[:n] == tag_prefix)
        self._remember(tag_prefix, report)
        for waiter in waiters:
            if not waiter.fut.done():
                waiter.fut.cancel()

    def _remember(self, tag_prefix: Tag, report: bool) -> None:
        bucket = self._discarded.get(len(tag_prefix))
        if bucket is None:
            bucket = self._discarded[len(tag_prefix)] = {}
        if tag_prefix not in bucket:
            self._discard_fifo.append(tag_prefix)
            if len(self._discard_fifo) > _DISCARD_MEMORY:
                old = self._discard_fifo.popleft()
                self._discarded[len(old)].pop(old, None)
        bucket[tag_prefix] = report

    def _stray(self, src: int, tag: Tag, meta: dict[str, Any]) -> None:
        for handler in list(self._stray_handlers):
            try:
                handler(src, tag, meta)
            except Exception:
                log.exception("stray-message handler failed")

    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        self._handlers.append(handler)

    def mark_lost(self, rank: int, reason: str) -> None:
        """Treat ``rank`` as gone (the coordinator said so): close its link, fail its receives."""
        link = self._links.get(rank)
        if link is not None:
            link.close(reason, lost=True)
        elif rank not in self._lost and rank != self.rank:
            self._lost[rank] = reason
            self._fail_from(rank, reason)

    def debug_state(self) -> dict[str, Any]:
        """A snapshot of matching and link state, for diagnosing a stuck operation."""
        return {
            "rank": self.rank,
            "posted": {repr(k): len(v) for k, v in self._posted.items()},
            "posted_any": {repr(k): len(v) for k, v in self._posted_any.items()},
            "inbox": {repr(k): [(m.src, len(m.payload)) for m in v] for k, v in self._inbox.items()},
            "filling": {p: [repr(getattr(w, "tag", w)) for w in q] for p, q in self._filling.items()},
            "links": {
                p: {"reading": link.reading, "write_backlog": link.write_backlog, "mid_frame": link.mid_frame}
                for p, link in self._links.items()
            },
            "lost": dict(self._lost),
        }

    @property
    def lost_peers(self) -> dict[int, str]:
        return dict(self._lost)

    def _stop_accepting(self) -> bool:
        """Mark the transport closed and stop taking peers; False when it already was."""
        if self._closed:
            return False
        self._closed = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in list(self._handshakes):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        return True

    def abort(self) -> None:
        """Close every link and the listener at once, without goodbye: peers see what a crash
        looks like (PeerLostError naming this rank). Pending receives fail; twice is fine."""
        if not self._stop_accepting():
            return
        for link in list(self._links.values()):
            link.close("this rank aborted its transport", lost=False)
        self._fail_all(DistError(f"rank {self.rank}'s transport was aborted"))

    async def aclose(self) -> None:
        """Say goodbye on every link, close them and the listener. Twice is fine."""
        if not self._stop_accepting():
            return
        links = list(self._links.values())
        for link in links:
            link.write_nowait([memoryview(_BYE)])
        for link in links:
            await link.flush(1.0)
        for link in links:
            link.close("this rank closed its transport", lost=False)
        self._fail_all(DistError(f"rank {self.rank}'s transport is closed"))
        if self._accept_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._accept_task

    def _fail_all(self, err: BaseException) -> None:
        waiters = [w for q in self._posted.values() for w in q]
        waiters += [w for q in self._posted_any.values() for w in q]
        self._posted.clear()
        self._posted_any.clear()
        for waiter in waiters:
            if not waiter.fut.done():
                waiter.fut.set_exception(err)
        for fut in self._link_ready.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()

    # -- receiving -------------------------------------------------------------------------
    def _match(self, src: int, tag: Tag) -> _Recv | None:
        specific = self._posted.get((src, tag))
        anyq = self._posted_any.get(tag)
        if specific and (not anyq or specific[0].order < anyq[0].order):
            waiter = specific.popleft()
            if not specific:
                del self._posted[(src, tag)]
            return waiter
        if anyq:
            waiter = anyq.popleft()
            if not anyq:
                del self._posted_any[tag]
            return waiter
        return None

    def _sink(self, src: int, header: dict[str, Any], nbytes: int) -> memoryview | None:
        tag = header.get("t")
        if not isinstance(tag, list):
            return None
        key = tuple(tag)
        waiter = self._peek(src, key)
        if waiter is not None and len(waiter.into) not in (0, nbytes) and not waiter.fut.done():
            # The receive that is next in line expects another size: this message is its
            # (mismatched) one. Bind it now, in stream order, or a later message of the right
            # size in the same read would overtake it. (A zero-length receive is left to
            # dispatch time, since zero-length messages never reach this sink.)
            self._match(src, key)
            self._filling[src].append(_Mismatched(waiter))
            return np.empty(nbytes, np.uint8).data
        if waiter is None or len(waiter.into) != nbytes or waiter.fut.done():
            if nbytes < _UNZEROED_MIN:
                return None  # small: the decoder's own allocation is as cheap
            # Early (or mis-sized) large payload: land it in uninitialised memory, since zeroing a
            # buffer that is about to be overwritten costs as much as receiving it.
            self._filling[src].append(None)
            return np.empty(nbytes, np.uint8).data
        self._match(src, key)
        self._filling[src].append(waiter)
        self.received_direct += 1
        return waiter.into

    def _peek(self, src: int, tag: Tag) -> _Recv | None:
        specific = self._posted.get((src, tag))
        anyq = self._posted_any.get(tag)
        if specific and (not anyq or specific[0].order < anyq[0].order):
            return specific[0]
        return anyq[0] if anyq else None

    def _on_frames(self, link: PeerLink, frames: list[Frame]) -> None:
        src = link.peer
        for frame in frames:
            header = frame.header
            tag = header.get("t")
            if tag is None:
                if header.get("k") == "bye":
                    link.close(f"rank {src} left (closed its process group)", lost=False)
                    return
                log.warning("rank %d: ignoring an unknown control frame from rank %d", self.rank, src)
                continue
            meta = header.get("m")
            if not isinstance(tag, list) or not isinstance(meta, dict):
                link.close("malformed message header", lost=True)
                return
            key = tuple(tag)
            if frame.in_sink:
                waiter = self._filling[src].popleft()
                if waiter is None:
                    self._deliver(src, key, meta, frame.payload)
                elif isinstance(waiter, _Mismatched):
                    w = waiter.waiter
                    if not w.fut.done():
                        w.fut.set_exception(_length_mismatch(src, key, len(frame.payload), len(w.into), meta))
                elif not waiter.fut.done():
                    waiter.fut.set_result((src, meta, waiter.into) if waiter.in_place else (src, meta))
            else:
                self._deliver(src, key, meta, frame.payload)
            if link.closed:
                return  # a receive's callback sent on this link and the send failed: nothing more
        if link.closed:
            return
        if (
            self._inbox_count.get(src, 0) >= self._inbox_messages
            or self._inbox_size.get(src, 0) >= self._inbox_bytes
        ):
            link.pause_reading()

    def _deliver(self, src: int, tag: Tag, meta: dict[str, Any], payload: memoryview) -> None:
        if self._discarded:
            for n, bucket in self._discarded.items():
                report = bucket.get(tag[:n])
                if report is not None:
                    if report:
                        self._stray(src, tag, meta)
                    return
        while True:
            waiter = self._match(src, tag)
            if waiter is None:
                break
            if waiter.fut.done():
                continue
            if len(payload) != len(waiter.into):
                waiter.fut.set_exception(_length_mismatch(src, tag, len(payload), len(waiter.into), meta))
            elif waiter.in_place:
                waiter.fut.set_result((src, meta, payload))
            else:
                if len(payload):
                    waiter.into[:] = payload
                waiter.fut.set_result((src, meta))
            return
        self._inbox.setdefault(tag, deque()).append(_Msg(src, meta, payload))
        self.received_buffered += 1
        if src != self.rank:
            self._inbox_count[src] += 1
            self._inbox_size[src] += len(payload)

    # -- loss ------------------------------------------------------------------------------
    def _on_link_close(self, link: PeerLink, reason: str, lost: bool) -> None:
        peer = link.peer
        if self._links.get(peer) is link:
            del self._links[peer]
        if peer in self._lost:
            return
        self._lost[peer] = reason
        self._fail_from(peer, reason)
        if lost and not self._closed:
            exc = PeerLostError(peer, reason)
            log.warning("rank %d lost its link to rank %d: %s", self.rank, peer, reason)
            for handler in list(self._handlers):
                try:
                    handler(peer, exc)
                except Exception:
                    log.exception("peer-lost handler failed")

    def _fail_from(self, peer: int, reason: str) -> None:
        # Take every receive bound to ``peer`` out first, then fail them: failing one may call
        # back into its operation (post_recv) and on into discard() of other prefixes.
        waiters: list[_Recv] = []
        filling = self._filling.get(peer)
        if filling:
            for entry in filling:
                waiter = entry.waiter if isinstance(entry, _Mismatched) else entry
                if waiter is not None:
                    waiters.append(waiter)
            filling.clear()
        waiters += _take_matching(self._posted, lambda key: key[0] == peer)
        for waiter in waiters:
            if not waiter.fut.done():
                waiter.fut.set_exception(PeerLostError(peer, reason))
        fut = self._link_ready.get(peer)
        if fut is None:
            fut = self._ready_future(peer)
        if not fut.done():
            fut.set_exception(PeerLostError(peer, reason))
            fut.exception()
