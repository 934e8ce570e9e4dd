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
import json
import logging
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from aiocoll._env import env_seconds
from aiocoll.protocol._coordinator import HEARTBEAT_TIMEOUT, RESUME_GRACE, ROLE_BEAT

from ._collector import CollectorPacing
from ._connection import AbandonedHandshakes, Connection, Frame
from ._journal import Journal
from ._limits import open_descriptors, raise_descriptor_limit
from ._listener import Listener
from ._metrics import CoordinatorMetrics
from ._state import (
    DEFAULT_JOB_TTL,
    DEFAULT_MAX_KEYS_PER_JOB,
    DEFAULT_MAX_VALUE_BYTES,
    CoordinatorState,
    Send,
)
from ._turns import Turns

if TYPE_CHECKING:
    from ._http import Reply, Request

__all__ = ["Coordinator"]


def _json(status: int, body: dict[str, Any]) -> tuple[int, str, bytes]:
    """An HTTP route's JSON answer."""
    return status, "application/json", json.dumps(body).encode()


log = logging.getLogger("aiocoll.server")

MAX_PENDING_HANDSHAKES = 1024
# File descriptors kept free for what is not a connection (journal and snapshot files, HTTP).
DESCRIPTOR_RESERVE = 64
# An exhausted coordinator logs it, and tells the ranks waiting in forming rounds, this often.
CAPACITY_NOTICE_EVERY = 5.0
# Request payloads may carry several values (mset, cas): up to 4 values' worth plus slack.
_PAYLOAD_VALUES = 4
_PAYLOAD_SLACK = 64 * 1024
# Connections written to between two looks at the clock when many are answered at once.
_WRITES_PER_CHECK = 256


class Coordinator:
    """The aiocoll coordinator: key-value store and rendezvous for many jobs, embeddable.

    Args:
        host: address to listen on (an IP literal; "0.0.0.0" for every interface).
        port: TCP port; 0 picks a free one (read ``.port`` after ``start()``).
        token: shared secret every client must prove it holds; None means the empty secret.
        state_dir: directory for the durable journal and snapshots; None keeps state in memory.
        http_port: serve the web page (/), /healthz, /metrics, /auth and /jobs on this port (0: a
            free one); None: no HTTP. With a token, the page and /jobs show a job only to a
            client that proved it holds the token (docs/COORDINATOR.md, "Operations").
        http_host: address for the HTTP endpoints (default: ``host``).
        max_value_bytes: largest value a key may hold.
        max_keys_per_job: most keys in one job's key space.
        job_ttl: seconds after which a job with no connections and no activity is forgotten.
        handshake_timeout: seconds a new connection has to authenticate.
        heartbeat_timeout: seconds of silence (on both its connections) after which a member is
            declared lost; None: AIOCOLL_HEARTBEAT_TIMEOUT, else HEARTBEAT_TIMEOUT (10 s).
        resume_grace: seconds members get to reconnect after a restart from ``state_dir``.
        max_pending_handshakes: most connections allowed in their handshake at once (the oldest
            is closed beyond that); None: half the file descriptors the process may hold, at
            least 1,024.
        pace_collector: hold off Python's automatic full garbage collection while serving and
            run it every minute at a quiet moment instead (a process-wide setting, restored at
            stop; ``aiocoll coordinator`` turns it on). Without it, a coordinator holding a large
            job stalls for the length of a full collection each time its heap grows by a quarter.

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
        max_pending_handshakes: int | None = None,
        pace_collector: bool = False,
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
        # None: half the descriptors the process may hold (at least MAX_PENDING_HANDSHAKES), set
        # at start; a storm of thousands of hosts connecting at once must not be cut back.
        self._pending_handshakes_wanted = max_pending_handshakes
        self.max_pending_handshakes = max_pending_handshakes or MAX_PENDING_HANDSHAKES
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
            at_once=self.metrics.at_once,
            wall_clock=time.time,
        )
        self.port = 0
        self._loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start()
        self._listener: Listener | None = None
        self._http: Any = None
        self._conns: dict[int, Connection] = {}
        self._handshaking: collections.OrderedDict[Connection, None] = collections.OrderedDict()
        self.abandons = AbandonedHandshakes()
        self._journal: Journal | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._held: list[Send] = []
        self.turns = Turns()
        self._pace_collector = pace_collector
        self.collector: CollectorPacing | None = None
        # Frames decided but not yet written, per connection in order: a large answer is written
        # over several loop turns (see _write_unsent).
        self._unsent: collections.deque[tuple[int, list[Frame]]] = collections.deque()
        # Connections lost in this loop turn, forgotten together in the next (one announcement
        # of the members lost with them, however many went at once).
        self._lost: list[tuple[int, str]] = []
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
        # File descriptors: the most this process may hold, how many it held at start, and a
        # count of the connections' sockets (the rest of its descriptors stay as they were).
        self.descriptor_limit = 1 << 20
        self._descriptors_base = 0
        self.sockets = 0
        self.refused_for_descriptors = 0
        self._next_capacity_notice = 0.0

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
        self.turns.attach(self._loop)
        self._stopped = asyncio.Event()
        try:
            # State first, so that the first connection already sees every restored key.
            if self.state_dir is not None:
                await self._open_journal()
            self._listener = Listener(
                self._loop,
                self.host,
                self._requested_port,
                lambda: Connection(self),
                on_exhausted=self._accept_exhausted,
            )
            self.port = self._listener.port
            self.descriptor_limit = raise_descriptor_limit()
            self._descriptors_base = open_descriptors()
            if self._pending_handshakes_wanted is None:
                self.max_pending_handshakes = max(MAX_PENDING_HANDSHAKES, self.descriptor_limit // 2)
            # Tests and launchers parse this line to learn the port (with port 0).
            log.info("listening on %s", self.address)
            log.info(
                "file descriptors: %d in use, at most %d (about %d connections)",
                self._descriptors_base,
                self.descriptor_limit,
                self.descriptor_limit - self._descriptors_base - DESCRIPTOR_RESERVE,
            )
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
                from ._page import PAGE_PATHS
                from ._page_access import PageAccess

                self._page_access = PageAccess(self._token, time.monotonic)
                self._http = await start_http_server(
                    self.http_host,
                    self.http_port,
                    {
                        "/healthz": self._route_healthz,
                        "/metrics": self._route_metrics,
                        "/auth": self._route_auth,
                        "/jobs": self._route_jobs,
                        **{path: self._route_page for path in PAGE_PATHS},
                    },
                )
                self.http_port = self._http.port
        except BaseException:
            await self._teardown()
            raise
        if self._pace_collector:
            self.collector = CollectorPacing(self._loop, lambda: bool(self.turns.backlog or self._unsent))
            self.collector.start()
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
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._handshaking):
            conn.close("the coordinator is shutting down", abort=True, log_it=False)
        if self._journal is not None and self._flush_wanted is not None and self._flush_idle is not None:
            self._flush_wanted.set()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle(), max(0.0, deadline - self._loop.time()))
        self.turns.run_all()  # requests read and replies decided go out before the close
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
        if self.collector is not None:
            self.collector.stop()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._http is not None:
            with contextlib.suppress(Exception):
                await self._http.close()
            self._http = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
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

    # ------------------------------------------------------------------ capacity
    @property
    def descriptors_in_use(self) -> int:
        """File descriptors held: those at start (listeners, files) plus a socket per connection."""
        return self._descriptors_base + self.sockets

    def _accept_exhausted(self, exc: OSError) -> None:
        """accept() itself failed for lack of descriptors (something besides connections holds
        them): accepting pauses briefly, and it is told like a refused connection."""
        self._out_of_descriptors(
            f"the coordinator at {self.address} could not accept a connection ({exc}): raise its "
            f"limit (ulimit -n)"
        )

    def capacity_refusal(self) -> str | None:
        """Why a connection just accepted must be refused (None: it may stay). A coordinator
        out of file descriptors says so at once: in the log (once every few seconds), in
        /metrics, to the refused client, and to every rank waiting in a forming round."""
        spare = self.descriptor_limit - DESCRIPTOR_RESERVE - self.descriptors_in_use
        if spare >= 0:
            return None
        reason = (
            f"the coordinator at {self.address} is out of file descriptors "
            f"({self.descriptors_in_use} in use, limit {self.descriptor_limit}): raise its limit "
            f"(ulimit -n) or carry each host's ranks over one connection (CoordinatorSession.join_host)"
        )
        self._out_of_descriptors(reason)
        return reason

    def _out_of_descriptors(self, reason: str) -> None:
        self.metrics.refused("descriptors")
        self.refused_for_descriptors += 1
        now = self._loop.time()
        if now >= self._next_capacity_notice:
            self._next_capacity_notice = now + CAPACITY_NOTICE_EVERY
            log.error("event=out_of_descriptors refused=%d reason=%s", self.refused_for_descriptors, reason)
            self.state.out_of_capacity(reason)
            self._after_batch()

    # ------------------------------------------------------------------ the state machine's effects
    def forget_connection(self, conn_id: int, reason: str) -> None:
        """A connection closed: forgotten at the start of the next loop turn, with every other
        connection that closed in this one (a job whose hosts all died costs one announcement)."""
        lost = self._lost
        lost.append((conn_id, reason))
        if len(lost) == 1:
            self._loop.call_soon(self._forget_lost)

    def _forget_lost(self) -> None:
        lost, self._lost = self._lost, []
        try:
            self.state.disconnect_many(lost)
        except Exception:
            log.exception("event=internal_error while forgetting %d connection(s)", len(lost))
        self._after_batch()

    def _after_batch(self) -> None:
        """Deliver what the state machine decided; hold replies until their records are durable."""
        state = self.state
        out = state.outbox
        if out:
            state.outbox = []
            if self._journal is not None and (state.journal or self._held or self._writing):
                self._held.extend(out)
                self._kick_flush()
            elif len(out) == 1 and not self._unsent:  # the common store reply, without a call
                conn = self._conns.get(out[0][0])
                if conn is not None:
                    conn.send(out[0][1], out[0][2])
            else:
                self._deliver(out)
        elif state.journal and self._journal is not None:
            self._kick_flush()
        if state.closes:
            closes, state.closes = state.closes, []
            for conn_id, reason in closes:
                conn = self._conns.get(conn_id)
                if conn is not None:
                    # A beat connection's close follows its member's own change (lost, left, beats
                    # moved), logged where it happened; often a process that already left.
                    beat = conn.role == ROLE_BEAT
                    if beat:
                        log.info("job=%s event=beat_closed peer=%s reason=%s", conn.job, conn.peer, reason)
                    conn.close(reason, abort=True, log_it=not beat)
        if self._timer is None or state.timers_pushed != self._timers_seen:
            self._arm_timer()  # a deadline was added since it was armed, or none is armed

    def _deliver(self, out: list[Send]) -> None:
        # One write per connection for everything decided at once (in order per connection).
        by_conn: dict[int, list[Frame]] = {}
        for conn_id, header, payload in out:
            frames = by_conn.get(conn_id)
            if frames is None:
                by_conn[conn_id] = [(header, payload)]
            else:
                frames.append((header, payload))
        unsent = self._unsent
        if unsent:  # behind what an earlier turn left unwritten, to keep each connection's order
            unsent.extend(by_conn.items())
            return
        if len(by_conn) <= _WRITES_PER_CHECK:
            self._write(by_conn.items())
            return
        unsent.extend(by_conn.items())
        self._write_unsent()

    def _write(self, groups: Iterable[tuple[int, list[Frame]]]) -> None:
        conns = self._conns
        for conn_id, frames in groups:
            conn = conns.get(conn_id)
            if conn is not None:
                if len(frames) == 1:
                    conn.send(*frames[0])
                else:
                    conn.send_many(frames)

    def _write_unsent(self) -> None:
        """Write what is waiting, a slice at a time, until this turn's share is spent (answering
        a round of 12,500 hosts is 12,500 writes: the next turns write the rest)."""
        unsent, turns = self._unsent, self.turns
        while unsent and not turns.exhausted:
            began = time.perf_counter()
            count = min(len(unsent), _WRITES_PER_CHECK)
            self._write(unsent.popleft() for _ in range(count))
            turns.charge(time.perf_counter() - began)
        if unsent:
            turns.later(self._write_unsent)

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
        self.metrics.set_descriptors(self.descriptors_in_use, self.descriptor_limit)
        body, content_type = self.metrics.render()
        return 200, content_type, body

    async def _route_page(self, request: Request) -> Reply:
        from ._page import PAGE_HEADERS, asset

        content_type, body = asset(request.path)
        return 200, content_type, body, PAGE_HEADERS

    async def _route_auth(self, request: Request) -> Reply:
        """GET /auth: a nonce to answer (``{"token": true, "nonce"}``; ``{"token": false}`` when the
        coordinator has none); GET /auth?nonce=N&proof=P: a session value for /jobs, or 403."""
        from ._page_access import NONCE_SECONDS, SESSION_SECONDS

        access = self._page_access
        if access.open:
            return _json(200, {"token": False})
        nonce, proof = request.query.get("nonce"), request.query.get("proof")
        if nonce is None and proof is None:
            return _json(200, {"token": True, "nonce": access.challenge(), "expires_in": NONCE_SECONDS})
        session = access.answer(nonce or "", proof or "")
        if session is None:
            self.metrics.auth_failure()
            log.warning(
                "event=http_auth_failed peer=%s reason=a wrong proof for the page (a wrong token), "
                "or a nonce that is unknown, used or older than %gs",
                request.peer,
                NONCE_SECONDS,
            )
            return _json(
                403,
                {
                    "token": True,
                    "error": "proof refused: the token is not this coordinator's, or the nonce expired "
                    "or was used (ask GET /auth for a new one)",
                },
            )
        log.info("event=http_session peer=%s expires_in=%gs", request.peer, SESSION_SECONDS)
        return _json(200, {"token": True, "session": session, "expires_in": SESSION_SECONDS})

    async def _route_jobs(self, request: Request) -> Reply:
        access = self._page_access
        if not access.admits(request.headers.get("authorization")):
            body = {
                "token": True,
                "error": "this coordinator has a token: prove you hold it first (GET /auth for a nonce, "
                "GET /auth?nonce=N&proof=HEX(HMAC-SHA256(token, 'aiocoll page|' + N)) for a session, "
                "then send 'Authorization: Bearer SESSION'); the page at / does this for you",
            }
            return *_json(401, body), {"WWW-Authenticate": 'Bearer realm="aiocoll coordinator"'}
        payload = {"jobs": self.state.status(), "time": round(time.time(), 3), "token": not access.open}
        self._after_batch()  # the view asks the ranks holding a job back for their stacks
        return 200, "application/json", json.dumps(payload, indent=1).encode()
