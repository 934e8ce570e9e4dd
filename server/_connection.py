"""One client connection of the coordinator: the sans-IO handshake, then frames read straight
from the socket's buffer into the state machine, replies written back with backpressure, and every
way a connection is refused or closed (bad bytes, a failed handshake, a client that does not read,
no file descriptor to spare) with a logged reason. May import aiocoll foundations and the server's
_model, _state, _turns and _metrics; the Coordinator (_coordinator.py) owns the connections and
is handed to each as its ``Host`` (never imported here).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import socket
import time
from time import perf_counter
from typing import Any, Protocol, cast

import msgpack

from aiocoll._errors import AuthenticationError, ProtocolError
from aiocoll.protocol import CONTROL_READ_SIZE, PREFIX, FrameDecoder, ServerHandshake
from aiocoll.protocol._coordinator import ROLE_ADMIN, ROLE_BEAT, ROLE_STORE, ROLE_WORKER

from ._metrics import CoordinatorMetrics
from ._model import EncodedHeader
from ._state import CoordinatorState
from ._turns import Turns

__all__ = ["MAX_HEADER", "WRITE_STALL_TIMEOUT", "Connection", "Frame", "Header", "Host"]

log = logging.getLogger("aiocoll.server")

MAX_HEADER = 64 * 1024
# A reader slower than this many seconds with a full output buffer is treated as not reading.
WRITE_STALL_TIMEOUT = 30.0
_HIGH_WATER = 4 * 1024 * 1024
_LOW_WATER = 1024 * 1024
_HS_READ = 4096
_ROLES = frozenset({ROLE_WORKER, ROLE_STORE, ROLE_ADMIN, ROLE_BEAT})
_conn_ids = itertools.count(1)
# Reply payloads up to this size are copied into the frame's one write.
_COPY_PAYLOAD = 16 * 1024
# One packer for every reply header (the coordinator runs on one thread).
_pack = msgpack.Packer(use_bin_type=True).pack
pack_prefix = PREFIX.pack  # the bound method itself: one call less per reply
# A reply or event header: a map, a compact list, or one encoded ahead for many recipients.
Header = dict[str, Any] | list[Any] | EncodedHeader
# One frame to write: its header and payload.
Frame = tuple[Header, bytes | bytearray | memoryview]


def _error_category(exc: BaseException) -> str:
    """A short, stable metric label for a protocol error (the full message goes to the log)."""
    text = str(exc)
    for needle, label in (
        ("magic", "bad_magic"),
        ("header of", "header_size"),
        ("payload of", "payload_size"),
        ("undecodable", "bad_header"),
        ("must be a map", "bad_header"),
        ("version", "version"),
        ("role", "bad_role"),
        ("job", "bad_hello"),
        ("nonce", "bad_hello"),
        ("unexpected", "handshake_sequence"),
    ):
        if needle in text:
            return label
    return "other"


# Past the cap on connections in their handshake, the oldest is closed only when it has been
# waiting on its client this long (or half the handshake timeout, if less); otherwise the newcomer.
EVICT_AFTER = 1.0

# Handshakes abandoned after the challenge: this many within the window are said as a warning.
ABANDON_WINDOW = 10.0
ABANDON_BURST = 20


class AbandonedHandshakes:
    """Counts handshakes abandoned after the coordinator's challenge, to tell a burst of them."""

    def __init__(self) -> None:
        self._times: collections.deque[float] = collections.deque()  # at most ABANDON_BURST

    def note(self, now: float) -> int:
        """Count one at ``now``; the count when the window holds a burst (then start over), else 0."""
        times = self._times
        times.append(now)
        while now - times[0] > ABANDON_WINDOW:
            times.popleft()
        if len(times) < ABANDON_BURST:
            return 0
        times.clear()
        return ABANDON_BURST


class Host(Protocol):
    """What a connection needs of the coordinator that owns it (the Coordinator is one): its
    settings, the state machine and its shares of the loop, the connections it counts, and the
    calls that hand a connection's work back to it."""

    _token: str | bytes | None
    _loop: asyncio.AbstractEventLoop
    _handshaking: collections.OrderedDict[Connection, None]
    _conns: dict[int, Connection]
    _draining: bool
    _stopping: bool
    _all_closed: asyncio.Event | None
    sockets: int
    abandons: AbandonedHandshakes
    state: CoordinatorState
    metrics: CoordinatorMetrics
    turns: Turns
    handshake_timeout: float
    max_pending_handshakes: int
    max_payload: int
    max_output_bytes: int

    def capacity_refusal(self) -> str | None: ...

    def forget_connection(self, conn_id: int, reason: str) -> None: ...

    def _after_batch(self) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One client connection: handshake first, then frames into the state machine."""

    def __init__(self, coord: Host) -> None:
        self.coord = coord
        self.id = next(_conn_ids)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.hs: ServerHandshake | None = ServerHandshake(
            coord._token, roles=_ROLES, info={"server": "aiocoll-coordinator"}
        )
        self.hs_buf: bytearray | None = bytearray(_HS_READ)
        self.decoder: FrameDecoder | None = None
        self.job = ""
        self.role = ""
        self.authenticated = False
        self.closing = False
        self.paused = False
        self.hs_timer: asyncio.TimerHandle | None = None
        self.stall_timer: asyncio.TimerHandle | None = None
        self.refusal: str | None = None  # why it is refused (no descriptor to spare), if it is
        self.held: list[Any] | None = None  # requests read, waiting for a later loop turn
        self.queued = False  # its handshake waits for a later loop turn (not the client's delay)
        self.accepted = 0.0  # the loop's time when it was accepted
        # Events produced before the client's first request (resume): sent after that request.
        self.early: list[Frame] | None = []

    # -- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but provide its methods.
        self.transport = cast(asyncio.Transport, transport)
        coord = self.coord
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.peer = f"{peer[0]}:{peer[1]}"  # the numeric address: never a reverse lookup
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=_HIGH_WATER, low=_LOW_WATER)
        coord.metrics.connection_opened()
        coord.sockets += 1
        if coord._draining:
            self.close("the coordinator is shutting down", abort=True)
            return
        self.refusal = coord.capacity_refusal()  # sent in answer to the hello, not before it
        pending = coord._handshaking
        pending[self] = None
        now = coord._loop.time()
        self.accepted = now
        if len(pending) > coord.max_pending_handshakes:
            oldest = next(iter(pending))
            if oldest.queued or now - oldest.accepted < min(EVICT_AFTER, coord.handshake_timeout / 2):
                # The oldest is young, or waits for us rather than for its client: a herd of
                # hosts connecting faster than we authenticate them, not connections left
                # hanging. Closing it would throw away a handshake half done (its client would
                # start again at the back of the queue); this newcomer goes instead, and retries.
                coord.metrics.refused("handshakes_queued")
                log.debug(
                    "event=refused peer=%s reason=more than %d connections are still in their "
                    "handshake, the oldest for %.1fs; closing this new one",
                    self.peer,
                    coord.max_pending_handshakes,
                    now - oldest.accepted,
                )
                self.close("too many connections in their handshake", abort=True, log_it=False)
                return
            oldest.close(
                f"more than {coord.max_pending_handshakes} connections are still in their "
                f"handshake; closing the oldest",
                abort=True,
            )
            coord.metrics.protocol_error("handshake_overflow")
        self.hs_timer = coord._loop.call_later(coord.handshake_timeout, self._handshake_expired)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.decoder is not None:
            return self.decoder.get_buffer(sizehint)
        assert self.hs_buf is not None
        return memoryview(self.hs_buf)

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        decoder = self.decoder
        if decoder is None:
            turns = self.coord.turns
            hs = self.hs
            if turns.exhausted and hs is not None and hs.hello and hs.hello.get("role") != ROLE_ADMIN:
                # A storm of hosts connecting at once: past its hello (read at once, to learn
                # who it is), a worker's handshake waits its turn like its requests will.
                assert self.transport is not None
                self.transport.pause_reading()
                self.queued = True
                turns.later(lambda: self._handshake_held(nbytes))
                return
            began = perf_counter()
            self._handshake_bytes(nbytes)
            turns.charge(perf_counter() - began)
            return
        try:
            messages = decoder.buffer_updated_messages(nbytes)
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        if not messages:
            return  # a frame is still arriving: nothing was decided
        turns = self.coord.turns
        if turns.exhausted and self.role != ROLE_ADMIN:
            # This turn's time for requests is spent: these wait their turn, and the socket is not
            # read meanwhile (the decoder's buffer holds them until then). An operator's status
            # request goes ahead of the queue.
            assert self.transport is not None
            self.held = messages
            self.transport.pause_reading()
            turns.later(self._handle_held)
            return
        self._handle(messages)

    def _handle(self, messages: list[Any]) -> None:
        began = perf_counter()
        coord = self.coord
        if self.early is not None:
            early, self.early = self.early, None
            self.send_many(early)
        try:
            coord.state.requests(self.id, messages)
        except ValueError as exc:
            self._protocol_error(exc)
        except Exception:
            log.exception("job=%s event=internal_error peer=%s", self.job, self.peer)
            self.close("internal error handling a request (see the traceback above)", abort=True)
        coord._after_batch()
        coord.turns.charge(perf_counter() - began)

    def _handshake_held(self, nbytes: int) -> None:
        self.queued = False
        if self.closing or self.transport is None or self.hs is None:
            return
        began = perf_counter()
        self._handshake_bytes(nbytes)
        self.coord.turns.charge(perf_counter() - began)
        self._resume_reading()

    def _handle_held(self) -> None:
        messages, self.held = self.held, None
        if messages is None or self.closing:
            return  # handled when the connection was lost, or closed by us meanwhile
        self._handle(messages)
        self._resume_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None and not (self.closing or self.paused or self.held is not None):
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        coord = self.coord
        self.transport = None  # nothing more goes out; work put off for it finds nothing to do
        if self.held is not None and not self.closing and not coord._stopping:
            # Requests read before the connection went (a leave, then a close): they count.
            messages, self.held = self.held, None
            self._handle(messages)
        coord.sockets -= 1
        for timer in (self.hs_timer, self.stall_timer):
            if timer is not None:
                timer.cancel()
        coord._handshaking.pop(self, None)
        coord.metrics.connection_closed()
        if not self.authenticated:
            if self.hs is not None and self.hs.state != "magic" and not self.closing:
                # Gone in the middle of its handshake without a verdict: a client whose tokens
                # differ says so first (MISMATCH), so this one exited or gave up (a rank that
                # ends right after it started, its beat thread still connecting). Counted apart
                # from auth failures; a burst of them after our challenge is said loudly, since
                # collecting proofs and hanging up is how an offline guess at a weak token starts.
                stage = "after_challenge" if self.hs.state == "auth" else "after_first_bytes"
                coord.metrics.handshake_abandoned(stage)
                burst = stage == "after_challenge" and coord.abandons.note(time.monotonic())
                (log.warning if burst else log.info)(
                    "event=handshake_abandoned peer=%s job=%s reason=the client closed the connection "
                    "in the middle of its handshake (%s)%s",
                    self.peer,
                    self.hs.hello.get("job"),
                    "after our challenge" if stage == "after_challenge" else "after its first bytes",
                    f"; {burst} such connections within {ABANDON_WINDOW:g} s: a client collecting the "
                    "coordinator's proofs? check who reaches this port"
                    if burst
                    else "",
                )
            return
        reason = "closed by the client" if exc is None else f"connection error: {exc}"
        if self.decoder is not None and self.decoder.mid_frame and not self.closing:
            reason = "closed by the client in the middle of a frame (truncated)"
            log.warning("job=%s event=protocol_error peer=%s reason=%s", self.job, self.peer, reason)
            coord.metrics.protocol_error("truncated")
        coord._conns.pop(self.id, None)
        if coord._stopping:
            if not coord._conns and coord._all_closed is not None:
                coord._all_closed.set()
            return  # shutting down: members will resume after the restart, not be declared lost
        coord.forget_connection(self.id, reason)

    def pause_writing(self) -> None:
        # The client reads slower than we answer: stop reading its requests until it catches up,
        # and if it never does, it is not reading at all.
        self.paused = True
        if self.transport is not None:
            self.transport.pause_reading()
        if self.stall_timer is None:
            self.stall_timer = self.coord._loop.call_later(WRITE_STALL_TIMEOUT, self._stalled)

    def resume_writing(self) -> None:
        self.paused = False
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        self._resume_reading()

    # -- handshake
    def _handshake_bytes(self, nbytes: int) -> None:
        hs, buf, transport = self.hs, self.hs_buf, self.transport
        assert hs is not None and buf is not None and transport is not None
        if self.refusal is not None:
            # Read (and dropped) before refusing: closing with unread bytes would reset the
            # connection and the client would never see why.
            transport.write(ServerHandshake.reject_bytes(self.refusal, busy=True))
            self.close("refused: " + self.refusal, log_it=False)
            return
        try:
            out = hs.receive_data(bytes(buf[:nbytes]))
        except AuthenticationError as exc:
            self.coord.metrics.auth_failure()
            if hs.mismatch:  # the client checked our proof first, and it failed
                differs = (
                    "it holds another token than ours, or none"
                    if hs.has_token
                    else "it holds a token and this coordinator has none"
                )
                log.warning(
                    "event=auth_failed peer=%s job=%s reason=the client found our proof wrong (%s)",
                    self.peer,
                    hs.hello.get("job"),
                    differs,
                )
                why = f"it found the coordinator's proof wrong: {differs}"
            else:
                log.warning("event=auth_failed peer=%s reason=%s", self.peer, exc)
                why = "it failed authentication (a wrong token)"
                transport.write(ServerHandshake.reject_bytes("authentication failed: wrong token"))
            self.close("authentication failed", log_it=False)
            self._tell_refused(hs, why)
            return
        except ProtocolError as exc:
            self._protocol_error(exc, reject=True)
            return
        if out:
            transport.write(out)
        if hs.done:
            self._authenticated()

    def _tell_refused(self, hs: ServerHandshake, why: str) -> None:
        """A worker naming a job failed authentication: its members waiting to form a round hear of
        it (a notice only: the hello is unauthenticated; see CoordinatorState.refused_connection)."""
        job = hs.hello.get("job")
        if isinstance(job, str):
            self.coord.state.refused_connection(job, hs.hello.get("role"), self.peer, why)
            self.coord._after_batch()

    def _authenticated(self) -> None:
        coord = self.coord
        assert self.hs is not None
        hello = self.hs.hello
        self.hs = None
        self.hs_buf = None
        if self.hs_timer is not None:
            self.hs_timer.cancel()
            self.hs_timer = None
        coord._handshaking.pop(self, None)
        self.job, self.role = hello["job"], hello["role"]
        self.decoder = FrameDecoder(
            max_header=MAX_HEADER, max_payload=coord.max_payload, read_size=CONTROL_READ_SIZE, lists=True
        )
        self.authenticated = True
        coord._conns[self.id] = self
        log.debug("job=%s event=connected role=%s peer=%s", self.job, self.role, self.peer)
        coord.state.connect(
            self.id, self.job, self.role, peer=self.peer, session=hello.get("session"), cid=hello.get("cid")
        )
        coord._after_batch()

    def _handshake_expired(self) -> None:
        self.hs_timer = None
        if self.queued:  # the wait is ours, not the client's: give it the time again
            self.hs_timer = self.coord._loop.call_later(self.coord.handshake_timeout, self._handshake_expired)
            return
        if not self.authenticated and not self.closing:
            self.coord.metrics.protocol_error("handshake_timeout")
            self.close(f"handshake not finished within {self.coord.handshake_timeout:g}s", abort=True)

    def _stalled(self) -> None:
        self.stall_timer = None
        if self.paused and not self.closing:
            self.close(f"the client has not read its replies for {WRITE_STALL_TIMEOUT:g}s", abort=True)

    # -- output and closing
    def send(self, header: Header, payload: bytes | bytearray | memoryview) -> None:
        """Write one frame (a reply or an event)."""
        transport = self.transport
        if transport is None or self.closing:
            return
        if self.early is not None:
            # Nothing follows the WELCOME frame until the client's first request: a client's
            # handshake decoder would swallow (and choke on) an event sent in the same segment.
            self.early.append((header, payload))
            return
        if type(header) is not EncodedHeader:
            head = _pack(header)
            size = len(payload)
            if size > _COPY_PAYLOAD:
                transport.writelines([pack_prefix(len(head), size) + head, payload])
            else:  # one buffer, one send call: the common store reply
                transport.write(b"".join((pack_prefix(len(head), size), head, payload)))
        else:
            assert isinstance(header, EncodedHeader)
            transport.writelines([pack_prefix(header.size, len(payload)), *header.parts, payload])
        if self.paused:
            self._check_backlog(transport)

    def send_many(self, frames: list[Frame]) -> None:
        """Write several frames, in order, with one write: the replies to the requests that
        arrived in one read (pipelined sets) cost one send call instead of one each."""
        transport = self.transport
        if transport is None or self.closing:
            return
        if self.early is not None:
            self.early.extend(frames)
            return
        parts: list[bytes | bytearray | memoryview] = []
        small = True
        for header, payload in frames:
            size = len(payload)
            if type(header) is not EncodedHeader:
                head = _pack(header)
                parts.append(pack_prefix(len(head), size) + head)
            else:
                assert isinstance(header, EncodedHeader)
                parts.append(pack_prefix(header.size, size))
                parts.extend(header.parts)
                small = False
            if size:
                parts.append(payload)
                if size > _COPY_PAYLOAD:
                    small = False
        if small:
            transport.write(b"".join(parts))
        else:
            transport.writelines(parts)
        if self.paused:
            self._check_backlog(transport)

    def _check_backlog(self, transport: asyncio.Transport) -> None:
        if transport.get_write_buffer_size() > self.coord.max_output_bytes:
            self.close(
                f"more than {self.coord.max_output_bytes} bytes of replies are waiting for the "
                f"client to read them",
                abort=True,
            )

    def _protocol_error(self, exc: BaseException, *, reject: bool = False) -> None:
        self.coord.metrics.protocol_error(_error_category(exc))
        if reject and self.transport is not None:
            self.transport.write(ServerHandshake.reject_bytes(str(exc)))
        self.close(f"protocol error: {exc}", event="protocol_error")

    def close(self, reason: str, *, abort: bool = False, log_it: bool = True, event: str = "closed") -> None:
        if self.closing:
            return
        self.closing = True
        # Out of the handshake count now, not when the loop reports the close: a burst of new
        # connections must each evict a different (live) one.
        self.coord._handshaking.pop(self, None)
        if log_it:
            log.warning("job=%s event=%s peer=%s reason=%s", self.job or "-", event, self.peer, reason)
        transport = self.transport
        if transport is None:
            return
        if abort:
            transport.abort()
        else:
            transport.close()
            # close() waits for the output buffer to drain; a client that never reads would keep
            # the socket forever, so abort after a short grace.
            self.coord._loop.call_later(2.0, transport.abort)
