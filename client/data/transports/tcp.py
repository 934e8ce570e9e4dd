"""The tcp link kind: authenticated peer links between the workers of one job.

Imports only foundations (aiocoll._errors, aiocoll.protocol, aiocoll._matching via _link) and
client/data/_peer.py, client/data/transports/_link.py; never the public surface. TcpLink is a Link (see
_link_interface.py) and TcpTransport the process's LinkTransport with the tcp connector (listener and
dialler); matching is the process's one Matcher (aiocoll/_matching.py), fed by every link.

Topology: every worker listens on an ephemeral port of the interface that routes to the
coordinator (127.0.0.1 on loopback) and advertises it through rendezvous; the link between two
ranks is dialled by the higher rank, so there is exactly one per pair and no tie to break. Each
link authenticates (token, job, rank) before any frame is parsed.

Wire format after the handshake: frames (aiocoll.protocol) whose header is ``{"t": tag, "m": meta}``
for a message and ``{"k": "bye"}`` for an orderly goodbye. A message whose recv is already posted
is received straight into the recv's buffer; others wait in a bounded per-peer inbox (the
matcher pauses the link while it is full). The bound is backpressure by design: a rank that runs more than
``inbox_messages`` messages (or ``inbox_bytes``) ahead of a peer waits for it, and an application
whose ranks wait on each other beyond that bound gets a CollectiveTimeout, not unbounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from collections.abc import Awaitable, Collection, Mapping, Sequence
from typing import Any

import msgpack

from aiocoll._deadline import Deadline
from aiocoll._errors import AuthenticationError, PeerLostError, ProtocolError, RendezvousError
from aiocoll._net import host_port
from aiocoll.algorithms._transport import StrayHandler, Tag
from aiocoll.protocol import PREFIX, Frame

from .._peer import PeerLink, client_handshake, dialler_rank, server_handshake
from ._link import Link, LinkHost, LinkTransport

__all__ = ["StrayHandler", "TcpLink", "TcpTransport", "route_interface"]

log = logging.getLogger("aiocoll.client.tcp")

_HANDSHAKE_TIMEOUT = 10.0
_MAX_PENDING_HANDSHAKES = 64
_BYE = PREFIX.pack(len(msgpack.packb({"k": "bye"})), 0) + msgpack.packb({"k": "bye"})


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


class TcpLink(PeerLink, Link):
    """The tcp kind of Link: one authenticated socket to ``peer`` (bytes and framing in
    PeerLink), carrying messages as frames whose header is ``{"t": tag, "m": meta}``.

    Payloads land where the host's matcher says (``claim``): straight into a posted receive's
    buffer when one is waiting."""

    kind = "tcp"

    def __init__(self, sock: socket.socket, peer: int, host: LinkHost, *, max_payload: int) -> None:
        self._host = host
        self._matcher = host.matcher
        self._packer = msgpack.Packer(use_bin_type=True)
        super().__init__(
            sock,
            peer,
            sink=self._sink,
            on_frames=_on_frames,
            on_close=_on_close,
            max_payload=max_payload,
        )

    def _sink(self, header: dict[str, Any], nbytes: int) -> memoryview | None:
        tag = header.get("t")
        if not isinstance(tag, list):
            return None
        return self._matcher.claim(self.peer, tuple(tag), nbytes)

    def send_nowait(self, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> Awaitable[None] | None:
        head = self._packer.pack({"t": tag, "m": meta})
        try:
            if len(payload):
                body = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
                fut = self.write([memoryview(PREFIX.pack(len(head), len(body)) + head), body])
            else:
                fut = self.write([memoryview(PREFIX.pack(len(head), 0) + head)])
        except ConnectionError as exc:
            raise self._lost() from exc
        if fut is None:
            return None
        return self._finish_write(fut)

    async def _finish_write(self, fut: asyncio.Future[None]) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            if not self.drop_unsent(fut):
                # Already on the wire: it completes for the stream's sake, unawaited; its outcome
                # (a closed link, say) must not be reported as never retrieved.
                fut.add_done_callback(_consume_outcome)
            raise
        except ConnectionError as exc:
            raise self._lost() from exc

    def on_control(self, header: dict[str, Any]) -> bool:
        """A frame that is not a message nor a goodbye: False (unknown). Link kinds that say
        more over the socket (the shm kind's ring chunks) take theirs here, in stream order."""
        return False

    def _lost(self) -> PeerLostError:
        return PeerLostError(self.peer, self.close_reason or "the link is closed")

    async def aclose(self) -> None:
        if self.closed:
            return
        self.write_nowait([memoryview(_BYE)])
        await self.flush(1.0)
        self.close("this rank closed its transport", lost=False)

    def debug_state(self) -> dict[str, Any]:
        return {"reading": self.reading, "write_backlog": self.write_backlog, "mid_frame": self.mid_frame}


def _on_close(link: PeerLink, reason: str, lost: bool) -> None:
    assert isinstance(link, TcpLink)
    link._host.link_closed(link, reason, lost)


def _on_frames(link: PeerLink, frames: list[Frame]) -> None:
    assert isinstance(link, TcpLink)
    src = link.peer
    matcher = link._matcher
    for i, frame in enumerate(frames):
        header = frame.header
        tag = header.get("t")
        if tag is None:
            if header.get("k") == "bye":
                link.close(f"rank {src} left (closed its process group)", lost=False)
                return
            if not link.on_control(header):
                log.warning("rank %d: ignoring an unknown control frame from rank %d", matcher.rank, src)
            if link.closed:
                return
            held = link.held
            if held is not None:  # the frame's work goes on later (a chunk still being filled)
                held.extend(frames[i + 1 :])  # and so do the frames after it, in order
                return
            continue
        meta = header.get("m")
        if not isinstance(tag, list) or not isinstance(meta, dict):
            link.close("malformed message header", lost=True)
            return
        if frame.in_sink:
            matcher.landed(src, tuple(tag), meta, frame.payload)
        else:
            matcher.arrived(src, tuple(tag), meta, frame.payload)
        if link.closed:
            return  # a receive's callback sent on this link and the send failed: nothing more


def _consume_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class TcpTransport(LinkTransport):
    """The process's transport with authenticated TCP links (the tcp link kind's connector:
    listener and dialler); links of other kinds may be attached beside them.

    Use: ``addr = await t.listen(host)``; publish ``addr`` through rendezvous; then
    ``await t.connect(addrs_by_rank, deadline)`` (or client/data/transports/_factory.py's
    ``connect_links``, which picks each peer's link kind).

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
        super().__init__(rank, world_size, inbox_bytes=inbox_bytes, inbox_messages=inbox_messages)
        self._token = token
        self._job = job
        self._max_payload = max_payload
        # Listening side.
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] | None = None
        self.rejected = 0  # incoming connections refused (bad bytes, wrong token or job)

    @property
    def max_payload(self) -> int:
        """The largest single message accepted from a peer."""
        return self._max_payload

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
        self,
        addrs: Mapping[int, Sequence[Sequence[Any]]],
        deadline: Deadline | None = None,
        peers: Collection[int] | None = None,
    ) -> None:
        """Dial every lower rank and wait until every higher rank has dialled us.

        Args:
            addrs: rank -> [(host, port), ...] as advertised in rendezvous.
            deadline: the rendezvous budget.
            peers: the ranks to link over tcp (default: every other rank).
        Raises:
            RendezvousError: a link could not be made within the deadline (names the ranks).
            AuthenticationError: a peer refused our token.
        """
        deadline = deadline or Deadline(None)
        loop = self._get_loop()
        wanted = (
            sorted(p for p in range(self.world_size) if p != self.rank) if peers is None else sorted(peers)
        )
        for peer in wanted:
            self._ready_future(peer)
        dials = [loop.create_task(self._dial(p, addrs.get(p, ()), deadline)) for p in wanted if p < self.rank]
        try:
            await self.wait_links(wanted, deadline)
        finally:
            for task in dials:
                task.cancel()

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
                        client_handshake(
                            sock,
                            token=self._token,
                            job=self._job,
                            rank=self.rank,
                            peer=peer,
                            address=host_port(host, port),
                        ),
                        min(_HANDSHAKE_TIMEOUT, deadline.remaining() or _HANDSHAKE_TIMEOUT),
                    )
                except AuthenticationError as exc:
                    sock.close()
                    self.fail_link(peer, exc)  # it names the peer, its address and what to do
                    return
                except (OSError, ProtocolError, asyncio.TimeoutError) as exc:
                    sock.close()
                    last = exc
                    continue
                self._add_link(sock, peer)
                return
            if deadline.expired():
                self.fail_link(
                    peer,
                    RendezvousError(f"rank {self.rank} could not reach rank {peer} at {list(addrs)}: {last}"),
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
            peer = dialler_rank(hello, job=self._job, rank=self.rank, world_size=self.world_size)
            if self.has_link(peer):
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
        self.attach(TcpLink(sock, peer, self, max_payload=self._max_payload))

    def _begin_close(self) -> bool:
        """Mark the transport closed and stop taking peers; False when it already was."""
        if not super()._begin_close():
            return False
        if self._accept_task is not None:
            self._accept_task.cancel()
        for task in list(self._handshakes):
            task.cancel()
        if self._listener is not None:
            self._listener.close()
        return True

    async def aclose(self) -> None:
        """Say goodbye on every link, close them and the listener. Twice is fine."""
        await super().aclose()
        if self._accept_task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._accept_task
