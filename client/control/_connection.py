"""One authenticated link to the coordinator: the asyncio glue around the sans-IO protocol.

May import foundations only (protocol, _errors); never the public surface. An asyncio Protocol
that runs ClientHandshake, then FrameDecoder, and multiplexes requests over the link by id, so
that a long ``wait`` does not hold up a ``set`` behind it. Writes honour pause_writing /
resume_writing (bounded write buffer), TCP_NODELAY is set on connect, and the decoder caps
header and payload sizes. Reconnecting is the session's business (session.py): a link that
drops fails its pending requests with ``LinkLost`` and is never reused. ``open_link`` says how an
attempt failed: SilentServer when the server accepted and then sent nothing (whoever retries
counts those: client/control/_link_keeper.py), a TimeoutError naming the step that took too long.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable
from typing import Any, cast

import msgpack

from aiocoll._errors import AuthenticationError, ProtocolError
from aiocoll._net import host_port
from aiocoll.protocol import CONTROL_READ_SIZE, PREFIX, ClientHandshake, FrameDecoder
from aiocoll.protocol._handshake import SilentServer

__all__ = ["CoordinatorLink", "EventCallback", "LinkLost", "SettleCallback", "open_link"]

log = logging.getLogger("aiocoll.client")

# Write-buffer marks: above HIGH the transport pauses us and writers wait for it to drain.
_WRITE_HIGH = 1 << 20
_WRITE_LOW = 256 << 10
# The coordinator's own value limit is 16 MiB; an mget reply carries many values.
_MAX_PAYLOAD = 512 << 20
_MAX_HEADER = 16 << 20
# Bytes we hold while the handshake's frames arrive (they are tiny; more means not our protocol).
_HANDSHAKE_BUFFER = 64 << 10
# Payloads up to this size are copied into the frame's one write (one send call, no writev list).
_COPY_PAYLOAD = 16 << 10
_pack_prefix = PREFIX.pack
# Held-back frames (``send``) go out once this many are waiting, or this many bytes.
_CORK_FRAMES = 256
_CORK_BYTES = 64 << 10


class LinkLost(ConnectionError):
    """The link dropped while a request was pending.

    Attributes:
        sent: True when the request's bytes had been handed to the socket (the coordinator may
            have carried it out); False when it never left this process.
    """

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


EventCallback = Callable[[dict[str, Any]], None]
LostCallback = Callable[["CoordinatorLink", BaseException | None], None]
# Called with every compact reply (header list, payload) from the link's own callbacks; it must
# not raise but ProtocolError (which fails the link).
SettleCallback = Callable[[list[Any], bytes], None]


class CoordinatorLink(asyncio.Protocol):
    """A coordinator connection; build it with ``open_link``.

    Args:
        handshake: the ClientHandshake to run first.
        on_event: called with every unsolicited frame header (events have "ev", no "id").
        on_lost: called once when the link closes, with the cause (None for a clean close).
        next_id: gives each request made with ``request`` its id (the session's one counter,
            shared with its store requests, whose ids it assigns itself).
        on_settle: called with every compact (store) reply, header and payload, before the
            request it answers is woken: the session settles its mutations there.
        silence: seconds the server may take to send its first byte once connected (None: no
            limit); past them the link fails with SilentServer.
    """

    def __init__(
        self,
        handshake: ClientHandshake,
        on_event: EventCallback,
        on_lost: LostCallback,
        next_id: Callable[[], int] | None = None,
        on_settle: SettleCallback | None = None,
        silence: float | None = None,
    ) -> None:
        self._handshake = handshake
        self._silence = silence
        self._silence_timer: asyncio.TimerHandle | None = None
        self.heard = False  # the server sent at least one byte
        self._on_event = on_event
        self._on_lost = on_lost
        self._next_id = next_id if next_id is not None else itertools.count(1).__next__
        self._on_settle = on_settle
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._hs_buffer = bytearray()
        self._decoder: FrameDecoder | None = None
        self.loop = loop
        self._pending: dict[int, asyncio.Future[tuple[Any, bytes]]] = {}
        # Reply deadlines (loop time, timeout) of pending requests that have one, and one timer
        # for the earliest: no timer is made and cancelled per request (the store's hot path);
        # an entry leaves with its request, and the timer, when it fires, re-arms for what is left.
        self._expiry: dict[int, tuple[float, float]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        # Frames of requests that expect no reply (``send``: SET, APPEND, MSET) held back to go
        # out together at the end of the loop's turn: one send call for many.
        self._corked: list[bytes] = []  # one whole frame each
        self._corked_bytes = 0
        self._pack = msgpack.Packer(use_bin_type=True).pack  # one per link: no allocation per request
        self._can_write = asyncio.Event()
        self._can_write.set()
        # Open, connected and not paused by the transport: what ``writable`` says, kept as a
        # plain attribute because every request asks.
        self.can_send = False
        self._lost: BaseException | None = None
        self.closed = False
        self.peer = ""

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, so no isinstance check here.
        self._transport = cast(asyncio.Transport, transport)
        self.can_send = not self.closed
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        self._transport.write(self._handshake.start())
        if self._silence is not None:
            self._silence_timer = self.loop.call_later(self._silence, self._silent, self._silence)

    def _silent(self, seconds: float) -> None:
        self._silence_timer = None
        if not self.heard:
            self._fail(
                SilentServer(
                    f"{self._handshake.address} accepted the connection but sent nothing in answer "
                    f"to aiocoll's hello within {seconds:g}s"
                )
            )

    def data_received(self, data: bytes) -> None:
        if not self.heard:
            self.heard = True
            if self._silence_timer is not None:
                self._silence_timer.cancel()
                self._silence_timer = None
        try:
            if self._decoder is None:
                data = self._handshake_data(data)
                if self._decoder is None or not data:
                    return
            pending = self._pending
            settle = self._on_settle
            for header, payload in self._decoder.feed_messages(data):
                if type(header) is list:  # a store reply: [id, status, ...]
                    if settle is not None:
                        settle(header, payload)
                    req_id = header[0] if header else None
                else:
                    req_id = header.get("id")
                    if req_id is None:
                        self._dispatch_event(header)
                        continue
                fut = pending.pop(req_id, None) if type(req_id) is int else None
                if fut is not None and not fut.done():
                    self._expiry.pop(req_id, None)
                    fut.set_result((header, payload))
                # An unknown id is the late answer to a request whose caller gave up: nothing to do.
        except (ProtocolError, AuthenticationError) as exc:
            farewell = self._handshake.farewell
            if farewell and self._transport is not None:  # the server's proof failed: say so
                self._transport.write(farewell)
            self._fail(exc)

    def _handshake_data(self, data: bytes) -> bytes:
        """Feed the handshake one whole frame at a time; return bytes that follow its end.

        The coordinator may send its first event right behind WELCOME, in the same read, and
        those bytes belong to the frame decoder, not the handshake.
        """
        self._hs_buffer += data
        if len(self._hs_buffer) > _HANDSHAKE_BUFFER:
            raise ProtocolError(
                f"the server at {self.peer} sent {len(self._hs_buffer)} bytes during the handshake: "
                f"it is not an aiocoll coordinator"
            )
        assert self._transport is not None
        while len(self._hs_buffer) >= PREFIX.size:
            header_len, payload_len = PREFIX.unpack_from(self._hs_buffer)
            end = PREFIX.size + header_len + payload_len
            if payload_len or end > _HANDSHAKE_BUFFER:
                # Not a handshake frame; let the handshake's own decoder say what is wrong.
                self._handshake.receive_data(bytes(self._hs_buffer))
                raise ProtocolError(f"the server at {self.peer} broke the handshake grammar")
            if len(self._hs_buffer) < end:
                break
            frame = bytes(self._hs_buffer[:end])
            del self._hs_buffer[:end]
            reply = self._handshake.receive_data(frame)
            if reply:
                self._transport.write(reply)
            if self._handshake.done:
                self._decoder = FrameDecoder(
                    max_header=_MAX_HEADER, max_payload=_MAX_PAYLOAD, read_size=CONTROL_READ_SIZE, lists=True
                )
                rest = bytes(self._hs_buffer)
                self._hs_buffer = bytearray()
                if not self.ready.done():
                    self.ready.set_result(dict(self._handshake.server_info))
                return rest
        return b""

    def _dispatch_event(self, header: dict[str, Any]) -> None:
        if "ev" in header:
            self._on_event(header)
        else:
            log.warning("coordinator at %s sent a frame with neither id nor ev: %.200r", self.peer, header)

    def pause_writing(self) -> None:
        self._can_write.clear()
        self.can_send = False

    def resume_writing(self) -> None:
        self._can_write.set()
        self.can_send = not self.closed and self._transport is not None

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc, from_transport=True)

    # -- use -----------------------------------------------------------------------------
    async def request(
        self,
        header: dict[str, Any],
        payload: bytes | bytearray | memoryview = b"",
        timeout: float | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """Send one control request (a map header: join, hb, leave, status, table, progress)
        and wait up to ``timeout`` seconds (None: no limit) for its reply.

        ``header`` is the caller's to give away: its "id" field is set here (no copy is made).

        Raises:
            LinkLost: the link dropped (``sent`` says whether the request left this process).
            TimeoutError: no reply in time (a late reply is dropped).
        """
        if self.closed or self._transport is None:
            raise LinkLost(f"link to the coordinator at {self.peer} is closed", sent=False)
        if not self._can_write.is_set():
            await self._can_write.wait()
            if self.closed:
                raise LinkLost(f"link to the coordinator at {self.peer} is closed", sent=False)
        req_id = header["id"] = self._next_id()
        head = self._pack(header)
        size = len(payload)
        if size > _COPY_PAYLOAD:
            frame: bytes | list[Any] = [_pack_prefix(len(head), size) + head, payload]
        else:
            frame = b"".join((_pack_prefix(len(head), size), head, payload))
        fut = self.start(req_id, frame, timeout)
        try:
            return await fut
        finally:
            self.forget(req_id)

    def forget(self, req_id: int) -> None:
        """Drop what is kept for request ``req_id`` (its caller stopped waiting, or got the reply)."""
        if self._pending.pop(req_id, None) is not None:
            self._expiry.pop(req_id, None)

    def start(
        self, req_id: int, frame: bytes | list[Any], timeout: float | None = None
    ) -> asyncio.Future[tuple[Any, bytes]]:
        """Write request ``req_id``'s frame (bytes, or pieces for ``writelines``) now, behind any
        held-back frames, and return the future of its reply, without waiting.

        The caller must have checked that the link is open and writable (``can_send``). The
        future fails with LinkLost or TimeoutError (after ``timeout`` seconds; None: never); its
        entry leaves the link when it is answered, fails, or times out.
        """
        transport = self._transport
        assert transport is not None
        if timeout is not None:
            at = self.loop.time() + timeout
            self._expiry[req_id] = (at, timeout)
            if self._timer is None or at < self._timer_at:
                self._arm(at)
        fut: asyncio.Future[tuple[Any, bytes]] = self.loop.create_future()
        self._pending[req_id] = fut
        if type(frame) is bytes:
            if self._corked:  # what was held back goes first, in the same write: it may read it
                self._corked.append(frame)
                self._uncork()
            else:
                transport.write(frame)
        else:
            self._uncork()
            transport.writelines(frame)  # type: ignore[arg-type]
        return fut

    def send(self, frame: bytes) -> None:
        """Queue the frame of a request that expects no reply (SET, APPEND, MSET).

        It is held back, with the others queued in the same turn of the event loop, and written
        with them at the end of that turn (or before any later request, or once _CORK_FRAMES
        frames or _CORK_BYTES bytes are waiting): one send call for many. A large frame goes out
        at once, behind them. The caller must have checked ``can_send``; a link that closes
        drops what it held (the session sends its unsettled mutations again on the next link).
        """
        if len(frame) > _COPY_PAYLOAD:
            self._uncork()
            assert self._transport is not None
            self._transport.write(frame)
            return
        corked = self._corked
        if not corked:
            self.loop.call_soon(self._uncork)
        corked.append(frame)
        self._corked_bytes += len(frame)
        if len(corked) >= _CORK_FRAMES or self._corked_bytes >= _CORK_BYTES:
            self._uncork()

    def _uncork(self) -> None:
        """Write the held-back frames (a no-op when there are none, or the link is closed)."""
        corked = self._corked
        if not corked or self.closed or self._transport is None:
            return
        self._corked = []
        self._corked_bytes = 0
        self._transport.write(corked[0] if len(corked) == 1 else b"".join(corked))

    async def wait_writable(self) -> None:
        """Until the transport takes writes again (or the link closes)."""
        await self._can_write.wait()

    @property
    def writable(self) -> bool:
        """Open, and its transport is not asking writers to wait."""
        return self.can_send

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._expire_due)

    def _expire_due(self) -> None:
        self._timer = None
        now = self.loop.time()
        earliest = None
        for req_id, (at, timeout) in list(self._expiry.items()):
            if at <= now:
                del self._expiry[req_id]
                fut = self._pending.pop(req_id, None)
                if fut is not None and not fut.done():
                    fut.set_exception(TimeoutError(f"no reply from the coordinator within {timeout:.3g}s"))
            elif earliest is None or at < earliest:
                earliest = at
        if earliest is not None and not self.closed:
            self._arm(earliest)

    def close(self) -> None:
        """Close now (no goodbye); pending requests fail with LinkLost. Twice is fine."""
        self._fail(None)

    def _fail(self, exc: BaseException | None, *, from_transport: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.can_send = False
        self._lost = exc
        self._can_write.set()  # wake writers so they see the close
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None
        self._expiry.clear()
        if self._transport is not None and not from_transport:
            self._transport.abort()
        if not self.ready.done():
            if isinstance(exc, (AuthenticationError, ProtocolError, SilentServer)):
                self.ready.set_exception(exc)
            else:
                self.ready.set_exception(
                    ConnectionResetError(
                        f"the coordinator at {self.peer} closed the connection during the handshake"
                        + (f": {exc}" if exc else "")
                    )
                )
            self.ready.exception()  # mark retrieved: the opener may already have given up
        reason = f": {exc}" if exc else ""
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(
                    LinkLost(f"link to the coordinator at {self.peer} was lost{reason}", sent=True)
                )
        self._pending.clear()
        self._corked = []
        self._corked_bytes = 0
        self._on_lost(self, exc)


async def open_link(
    host: str,
    port: int,
    handshake: ClientHandshake,
    *,
    on_event: EventCallback,
    on_lost: LostCallback,
    timeout: float,
    next_id: Callable[[], int] | None = None,
    on_settle: SettleCallback | None = None,
    silence: float | None = None,
) -> tuple[CoordinatorLink, dict[str, Any]]:
    """Connect, authenticate and return (link, the server's handshake info).

    Args:
        silence: seconds the server may take to send its first byte once connected (None: up
            to ``timeout``).

    Raises:
        OSError: the TCP connection failed (refused, unreachable); the caller may retry.
        AuthenticationError, ProtocolError: the other side is not our coordinator or holds
            another token; retrying will not help (the message names the address).
        SilentServer: it accepted the connection and sent nothing within ``silence``.
        TimeoutError: connecting or the handshake took longer than ``timeout`` (the message says
            which).
    """
    loop = asyncio.get_running_loop()
    link: CoordinatorLink | None = None
    address = host_port(host, port)
    handshake.name_server(address)

    def factory() -> CoordinatorLink:
        nonlocal link
        link = CoordinatorLink(handshake, on_event, on_lost, next_id, on_settle, silence)
        return link

    async def connect_and_authenticate() -> dict[str, Any]:
        await loop.create_connection(factory, host, port)
        assert link is not None
        return await link.ready

    try:
        info = await asyncio.wait_for(connect_and_authenticate(), timeout)
    except SilentServer:  # a TimeoutError too, but the caller counts these
        assert link is not None
        link.close()
        raise
    except asyncio.TimeoutError:
        if link is not None:
            link.close()
        if link is None:
            raise TimeoutError(f"connecting to {address} took longer than {timeout:.3g}s") from None
        if not link.heard:
            raise TimeoutError(
                f"{address} accepted the connection but sent nothing in answer to aiocoll's hello "
                f"within {timeout:.3g}s"
            ) from None
        raise TimeoutError(f"the handshake with {address} did not finish within {timeout:.3g}s") from None
    except BaseException:
        if link is not None:
            link.close()
        raise
    assert link is not None
    return link, info
