"""The coordinator's asyncio shell: a TCP listener, one BufferedProtocol per connection running the
sans-IO handshake then the frame decoder, the durable journal's group commit, timers, and the
optional HTTP endpoints. Every decision is the state machine's (_state.py); this module only moves
bytes, time and files. May import aiocoll foundations and server modules; never aiocoll.client
or the public surface.

Bad input never reaches the state machine: garbage, oversized prefixes, truncated frames and
failed handshakes close that one connection with a logged reason, and connections still in their
handshake are capped in number and in time, so half-open sockets cannot grow memory without bound.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import msgpack

from aiocoll._errors import AuthenticationError, ProtocolError
from aiocoll.protocol import PREFIX, FrameDecoder, ServerHandshake
from aiocoll.protocol._coordinator import (
    HEARTBEAT_TIMEOUT,
    RESUME_GRACE,
    ROLE_ADMIN,
    ROLE_BEAT,
    ROLE_STORE,
    ROLE_WORKER,
    env_seconds,
)

from ._journal import Journal
from ._metrics import CoordinatorMetrics
from ._state import (
    DEFAULT_JOB_TTL,
    DEFAULT_MAX_KEYS_PER_JOB,
    DEFAULT_MAX_VALUE_BYTES,
    CoordinatorState,
    EncodedHeader,
    Send,
)

__all__ = ["Coordinator"]

log = logging.getLogger("aiocoll.server")

MAX_HEADER = 64 * 1024
MAX_PENDING_HANDSHAKES = 1024
# Request payloads may carry several values (mset, cas): up to 4 values' worth plus slack.
_PAYLOAD_VALUES = 4
_PAYLOAD_SLACK = 64 * 1024
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


class _Connection(asyncio.BufferedProtocol):
    """One client connection: handshake first, then frames into the state machine."""

    def __init__(self, coord: Coordinator) -> None:
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
        # Events produced before the client's first request (resume): sent after that request.
        self.early: list[tuple[Header, bytes | bytearray | memoryview]] | None = []

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
        if coord._draining:
            self.close("the coordinator is shutting down", abort=True)
            return
        pending = coord._handshaking
        pending[self] = None
        if len(pending) > coord.max_pending_handshakes:
            oldest = next(iter(pending))
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
            self._handshake_bytes(nbytes)
            return
        try:
            messages = decoder.buffer_updated_messages(nbytes)
        except ProtocolError as exc:
            self._protocol_error(exc)
            return
        if not messages:
            return  # a frame is still arriving: nothing was decided
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

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: BaseException | None) -> None:
        coord = self.coord
        for timer in (self.hs_timer, self.stall_timer):
            if timer is not None:
                timer.cancel()
        coord._handshaking.pop(self, None)
        coord.metrics.connection_closed()
        if not self.authenticated:
            if self.hs is not None and self.hs.state == "auth" and not self.closing:
                # The client verifies our proof first: one that holds another token hangs up here.
                coord.metrics.auth_failure()
                log.warning(
                    "event=auth_failed peer=%s job=%s reason=the client closed after our challenge "
                    "(its token differs from ours, or it gave up)",
                    self.peer,
                    self.hs.hello.get("job"),
                )
                self._tell_refused(
                    self.hs, "it hung up after the coordinator's challenge: its token differs (most likely)"
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
        try:
            coord.state.disconnect(self.id, reason)
        except Exception:
            log.exception(
                "job=%s event=internal_error peer=%s while forgetting a connection", self.job, self.peer
            )
        coord._after_batch()

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
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()

    # -- handshake
    def _handshake_bytes(self, nbytes: int) -> None:
        hs, buf, transport = self.hs, self.hs_buf, self.transport
        assert hs is not None and buf is not None and transport is not None
        try:
            out = hs.receive_data(bytes(buf[:nbytes]))
        except AuthenticationError as exc:
            self.coord.metrics.auth_failure()
            log.warning("event=auth_failed peer=%s reason=%s", self.peer, exc)
            transport.write(ServerHandshake.reject_bytes("authentication failed: wrong token"))
            self.close("authentication failed", log_it=False)
            self._tell_refused(hs, "it failed authentication (a wrong token)")
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
            max_header=MAX_HEADER, max_payload=coord.max_payload, read_size=16 * 1024, lists=True
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

    def send_many(self, frames: list[tuple[Header, bytes | bytearray | memoryview]]) -> None:
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


class Coordinator:
    """The aiocoll coordinator: key-value store and rendezvous for many jobs, embeddable.

    Args:
        host: address to listen on (an IP literal; "0.0.0.0" for every interface).
        port: TCP port; 0 picks a free one (read ``.port`` after ``start()``).
        token: shared secret every client must prove it holds; None means the empty secret.
        state_dir: directory for the durable journal and snapshots; None keeps state in memory.
        http_port: serve /healthz, /metrics and /jobs on this port (0: a free one); None: no HTTP.
        http_host: address for the HTTP endpoints (default: ``host``).
        max_value_bytes: largest value a key may hold.
        max_keys_per_job: most keys in one job's key space.
        job_ttl: seconds after which a job with no connections and no activity is forgotten.
        handshake_timeout: seconds a new connection has to authenticate.
        heartbeat_timeout: seconds of silence (on both its connections) after which a member is
            declared lost; None: AIOCOLL_HEARTBEAT_TIMEOUT, else HEARTBEAT_TIMEOUT (10 s).
        resume_grace: seconds members get to reconnect after a restart from ``state_dir``.
        max_pending_handshakes: most connections allowed in their handshake at once (the oldest
            is closed beyond that).

    Use ``async with Coordinator(...) as c:`` or ``await c.start()`` / ``await c.stop()``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 29500,
        *,
        token: str | bytes | None = None,
        state_dir: str | None = None,
        http_port: int | None = None,
        http_host: str | None = None,
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_keys_per_job: int = DEFAULT_MAX_KEYS_PER_JOB,
        job_ttl: float = DEFAULT_JOB_TTL,
        handshake_timeout: float = 5.0,
        heartbeat_timeout: float | None = None,
        resume_grace: float = RESUME_GRACE,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        if max_value_bytes < 1:
            raise ValueError(f"max_value_bytes must be positive, got {max_value_bytes}")
        if heartbeat_timeout is None:
            heartbeat_timeout = env_seconds("AIOCOLL_HEARTBEAT_TIMEOUT", HEARTBEAT_TIMEOUT)
        if job_ttl <= 0 or handshake_timeout <= 0 or heartbeat_timeout <= 0:
            raise ValueError("job_ttl, handshake_timeout and heartbeat_timeout must be positive")
        self.host = host
        self._requested_port = port
        self._token = token
        self.state_dir = state_dir
        self.http_port = http_port
        self.http_host = http_host if http_host is not None else host
        self.max_value_bytes = max_value_bytes
        self.max_payload = max_value_bytes * _PAYLOAD_VALUES + _PAYLOAD_SLACK
        self.max_output_bytes = 2 * self.max_payload + 64 * 1024 * 1024
        self.handshake_timeout = handshake_timeout
        self.max_pending_handshakes = max_pending_handshakes
        self.metrics = CoordinatorMetrics()
        self.state = CoordinatorState(
            clock=time.monotonic,
            max_value_bytes=max_value_bytes,
            max_keys_per_job=max_keys_per_job,
            job_ttl=job_ttl,
            heartbeat_timeout=heartbeat_timeout,
            resume_grace=resume_grace,
            durable=state_dir is not None,
            observe=self.metrics.observe_op,
            observe_at_once=self.metrics.observe_at_once,
            wall_clock=time.time,
        )
        self.port = 0
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._server: asyncio.Server | None = None
        self._http: Any = None
        self._conns: dict[int, _Connection] = {}
        self._handshaking: collections.OrderedDict[_Connection, None] = collections.OrderedDict()
        self._journal: Journal | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._held: list[Send] = []
        self._writing = False
        self._flush_wanted: asyncio.Event | None = None
        self._flush_idle: asyncio.Event | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = float("inf")
        self._timers_seen = -1
        self._draining = False
        self._stopping = False
        self._started = False
        self._stopped: asyncio.Event | None = None
        self._fatal: BaseException | None = None
        self._all_closed: asyncio.Event | None = None  # set by the last connection to close in stop()

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> str:
        """``host:port`` the coordinator listens on (after ``start()``)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def serving(self) -> bool:
        """True between ``start()`` and the beginning of ``stop()``."""
        return self._started and not self._draining

    async def start(self) -> None:
        """Bind, restore state from ``state_dir`` if any, and start serving.

        Raises:
            OSError: the address cannot be bound. ValueError: the state directory is unreadable.
            RuntimeError: started twice.
        """
        if self._started:
            raise RuntimeError("Coordinator.start() called twice")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        try:
            # State first, so that the first connection already sees every restored key.
            if self.state_dir is not None:
                await self._open_journal()
            self._server = await self._loop.create_server(
                lambda: _Connection(self),
                self.host,
                self._requested_port,
                reuse_address=True,
                backlog=4096,
            )
            sockets = self._server.sockets or ()
            self.port = sockets[0].getsockname()[1] if sockets else self._requested_port
            # Tests and launchers parse this line to learn the port (with port 0).
            log.info("listening on %s", self.address)
            if self._journal is not None:
                log.info(
                    "state directory %s: %d job(s), %d key(s), %d member(s) to resume within %gs",
                    self._journal.path,
                    len(self.state.jobs),
                    sum(len(j.kv) for j in self.state.jobs.values()),
                    self.state.member_count(),
                    self.state.resume_grace,
                )
            if self.http_port is not None:
                from ._http import start_http_server

                self._http = await start_http_server(
                    self.http_host,
                    self.http_port,
                    {
                        "/healthz": self._route_healthz,
                        "/metrics": self._route_metrics,
                        "/jobs": self._route_jobs,
                    },
                )
                self.http_port = self._http.port
        except BaseException:
            await self._teardown()
            raise
        self._arm_timer()

    async def _open_journal(self) -> None:
        assert self.state_dir is not None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiocoll-journal")
        journal = Journal(self.state_dir)
        snap, records = await self._loop.run_in_executor(self._executor, journal.load)
        self.state.restore(snap, records)
        self._journal = journal
        self._flush_wanted = asyncio.Event()
        self._flush_idle = asyncio.Event()
        self._flush_idle.set()
        self._flusher = self._loop.create_task(self._flush_loop(), name="aiocoll-coordinator-journal")

    async def serve_forever(self) -> None:
        """Serve until ``stop()`` is called (from a signal handler, say); start first if needed."""
        if not self._started:
            await self.start()
        assert self._stopped is not None
        await self._stopped.wait()
        if self._fatal is not None:
            raise RuntimeError(f"the coordinator stopped: {self._fatal}") from self._fatal

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Drain and stop: stop accepting, persist and send what is pending, close connections.

        Calling it twice is fine. Members are not declared lost: with ``state_dir`` they resume
        when a new coordinator starts on the same directory.
        """
        if not self._started or self._draining:
            if self._stopped is not None:
                await self._stopped.wait()
            return
        self._draining = True
        deadline = self._loop.time() + drain_timeout
        log.info("draining: no new connections; finishing in-flight replies (up to %gs)", drain_timeout)
        if self._server is not None:
            self._server.close()
        for conn in list(self._handshaking):
            conn.close("the coordinator is shutting down", abort=True, log_it=False)
        if self._journal is not None and self._flush_wanted is not None and self._flush_idle is not None:
            self._flush_wanted.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle(), max(0.0, deadline - self._loop.time()))
        self._stopping = True
        conns = list(self._conns.values())
        for conn in conns:
            conn.closing = True
            if conn.transport is not None:
                conn.transport.close()  # flushes what is buffered, then closes
        if self._conns:
            self._all_closed = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), max(0.0, deadline - self._loop.time()))
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.abort()
        await self._teardown(final_snapshot=True)
        log.info("stopped")

    async def _idle(self) -> None:
        assert self._flush_idle is not None
        while self.state.journal or self._held or self._writing:
            self._flush_idle.clear()
            assert self._flush_wanted is not None
            self._flush_wanted.set()
            await self._flush_idle.wait()

    async def _teardown(self, *, final_snapshot: bool = False) -> None:
        self._draining = True
        self._stopping = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.close()
            self._http = None
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(BaseException):
                await self._flusher
            self._flusher = None
        journal, self._journal = self._journal, None
        if journal is not None and self._executor is not None:
            try:
                if final_snapshot and self._fatal is None:
                    records = self.state.take_journal()
                    data = journal.encode(records) if records else b""
                    blob = journal.encode_snapshot(self.state.snapshot())
                    if data:
                        await self._loop.run_in_executor(self._executor, journal.write, data)
                    await self._loop.run_in_executor(self._executor, journal.install_snapshot, blob)
            except OSError as exc:
                log.error(
                    "event=snapshot_failed reason=%s (the journal still holds every acknowledged mutation)",
                    exc,
                )
            finally:
                journal.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        if self._stopped is not None:
            self._stopped.set()

    async def __aenter__(self) -> Coordinator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ the state machine's effects
    def _after_batch(self) -> None:
        """Deliver what the state machine decided; hold replies until their records are durable."""
        state = self.state
        if state.outbox:
            out = state.outbox
            state.outbox = []
            if self._journal is not None and (state.journal or self._held or self._writing):
                self._held.extend(out)
                self._kick_flush()
            else:
                self._deliver(out)
        elif state.journal and self._journal is not None:
            self._kick_flush()
        if state.closes:
            closes, state.closes = state.closes, []
            for conn_id, reason in closes:
                conn = self._conns.get(conn_id)
                if conn is not None:
                    conn.close(reason, abort=True)
        self._arm_timer()

    def _deliver(self, out: list[Send]) -> None:
        conns = self._conns
        if len(out) == 1:
            conn_id, header, payload = out[0]
            conn = conns.get(conn_id)
            if conn is not None:
                conn.send(header, payload)
            return
        # One write per connection for everything decided at once (in order per connection).
        by_conn: dict[int, list[tuple[Header, bytes | bytearray | memoryview]]] = {}
        for conn_id, header, payload in out:
            frames = by_conn.get(conn_id)
            if frames is None:
                by_conn[conn_id] = [(header, payload)]
            else:
                frames.append((header, payload))
        for conn_id, frames in by_conn.items():
            conn = conns.get(conn_id)
            if conn is not None:
                if len(frames) == 1:
                    conn.send(*frames[0])
                else:
                    conn.send_many(frames)

    def _kick_flush(self) -> None:
        if self._flush_wanted is not None:
            self._flush_wanted.set()

    async def _flush_loop(self) -> None:
        """Group commit: everything mutated while one fsync runs is written by the next one."""
        assert self._journal is not None and self._flush_wanted is not None and self._flush_idle is not None
        journal, state, loop = self._journal, self.state, self._loop
        while True:
            await self._flush_wanted.wait()
            self._flush_wanted.clear()
            while state.journal or self._held:
                records = state.take_journal()
                sends, self._held = self._held, []
                data = journal.encode(records) if records else b""
                blob = (
                    journal.encode_snapshot(state.snapshot()) if records and journal.snapshot_due() else None
                )
                if data:
                    self._writing = True
                    try:
                        await loop.run_in_executor(self._executor, journal.write, data)
                    except OSError as exc:
                        self._writing = False
                        self._fail(exc)
                        return
                    self._writing = False
                self._deliver(sends)
                if blob is not None:
                    try:
                        await loop.run_in_executor(self._executor, journal.install_snapshot, blob)
                        log.info("event=snapshot path=%s bytes=%d", journal.path, len(blob))
                    except OSError as exc:
                        log.error("event=snapshot_failed reason=%s (the journal keeps growing)", exc)
            self._flush_idle.set()

    def _fail(self, exc: BaseException) -> None:
        """The journal cannot be written: acknowledging anything more would be a lie, so stop."""
        log.critical(
            "event=journal_write_failed reason=%s; stopping without acknowledging the pending mutations", exc
        )
        self._fatal = exc
        self._held.clear()
        for conn in list(self._conns.values()):
            conn.close("the coordinator cannot persist its state", abort=True, log_it=False)
        self._loop.create_task(self.stop(drain_timeout=0.0))

    # ------------------------------------------------------------------ timers
    def _arm_timer(self) -> None:
        if self._stopping:
            return
        state = self.state
        if self._timer is not None and state.timers_pushed == self._timers_seen:
            return  # armed, and no deadline was added since: the common store request
        self._timers_seen = state.timers_pushed
        when = state.next_deadline()
        if self._timer is not None:
            if when >= self._timer_when:
                return
            self._timer.cancel()
        self._timer_when = when
        # The state's clock is time.monotonic; the loop's clock may have another origin (uvloop).
        self._timer = self._loop.call_later(max(0.0, when - self.state.clock()), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_when = float("inf")
        try:
            self.state.tick()
        except Exception:  # never let one bad tick stop every future timeout
            log.exception("event=internal_error in the coordinator's timer")
        self.metrics.set_jobs(len(self.state.jobs))
        self.metrics.set_members(self.state.member_count())
        self._after_batch()

    # ------------------------------------------------------------------ views
    def status(self, job: str | None = None) -> list[dict[str, Any]]:
        """Jobs, rounds, members and liveness, as the ``status`` operation returns them."""
        return self.state.status(job)

    async def _route_healthz(self) -> tuple[int, str, bytes]:
        if self.serving:
            return 200, "text/plain; charset=utf-8", b"ok\n"
        return 503, "text/plain; charset=utf-8", b"draining\n"

    async def _route_metrics(self) -> tuple[int, str, bytes]:
        self.metrics.set_jobs(len(self.state.jobs))
        self.metrics.set_members(self.state.member_count())
        body, content_type = self.metrics.render()
        return 200, content_type, body

    async def _route_jobs(self) -> tuple[int, str, bytes]:
        body = json.dumps({"jobs": self.state.status()}, indent=1).encode()
        return 200, "application/json", body
