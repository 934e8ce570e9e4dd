"""The coordinator's state machine: a thin dispatcher over its parts. No sockets, no asyncio, no
threads; time comes from an injected clock. Imports the server's parts (_kv, _rendezvous,
_liveness, _dedupe, _progress_part, _quorum, _persistence) and aiocoll foundations; never client/
or the public surface.

It exists so that every decision the coordinator makes can be tested without a network and
replayed from the durable journal: the asyncio shell (_coordinator.py) feeds it requests,
connection openings and closings and clock ticks, and drains what it decided (``Effects``):
``outbox`` (frames to send, per connection), ``closes`` (connections to drop, with a reason) and
``journal`` (records of acknowledged mutations, for the durable log).

The parts, each with one concern and its own data in each job (``_model.Job``): the key-value
store and its waiters (_kv), rounds and membership (_rendezvous), heartbeats and silence
(_liveness), exactly-once mutations (_dedupe), the progress cross-check (_progress_part), the
replicas' quorums (_quorum), and snapshot and replay (_persistence). A request is looked up in
one command table (op -> the part's handler); a numbered mutation passes through the dedupe part
on its way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiocoll.protocol._coordinator import (
    CONTROL_OPS,
    ERR_INVALID,
    ERR_UNKNOWN_OP,
    EV_REFUSED,
    HEARTBEAT_TIMEOUT,
    OPS,
    RESUME_GRACE,
    ROLE_ADMIN,
    ROLE_BEAT,
    ROLE_WORKER,
)
from aiocoll.protocol._store import MUTATIONS, NO_REPLY, OK, OP_NAMES

from . import _persistence, _views
from ._dedupe import CLIENT_SWEEP_INTERVAL, AlreadyAnswered, Dedupe
from ._kv import DEFAULT_MAX_KEYS_PER_JOB, DEFAULT_MAX_VALUE_BYTES, KeyValue
from ._liveness import Liveness
from ._membership import Membership
from ._model import (
    DONE,
    PARKED,
    ROLE_OPS,
    Conn,
    Effects,
    EncodedHeader,
    Job,
    Record,
    Refused,
    Send,
    StoreHandler,
)
from ._progress_part import Progress
from ._quorum import Quorum
from ._rendezvous import Rendezvous
from ._stacks import Stacks

__all__ = [
    "CLIENT_SWEEP_INTERVAL",
    "DEFAULT_JOB_TTL",
    "DEFAULT_MAX_KEYS_PER_JOB",
    "DEFAULT_MAX_VALUE_BYTES",
    "CoordinatorState",
    "EncodedHeader",
    "Send",
]

log = logging.getLogger("aiocoll.server")

DEFAULT_JOB_TTL = 3600.0

Handler = Callable[[Conn, int, dict[str, Any], memoryview], None]
_NO_REPLY_NAMES = frozenset(OP_NAMES[code] for code in NO_REPLY)


class CoordinatorState(Effects):
    """Everything the coordinator knows, and every decision it makes.

    Args:
        clock: monotonic seconds (the shell passes loop.time; tests pass a fake).
        max_value_bytes: largest value (also the largest result of append).
        max_keys_per_job: most keys one job may hold.
        job_ttl: seconds after which a job with no connections and no activity is dropped.
        heartbeat_timeout: silence after which a member is declared lost.
        resume_grace: seconds members get to re-attach after a restore.
        client_ttl: seconds a client's dedupe memory is kept once it has no connection (None:
            job_ttl). Keep it above the clients' reconnect timeout.
        durable: record acknowledged mutations in ``journal`` (the shell persists them).
        observe: optional hook ``(op, seconds, ok)`` called when a request is answered.
        at_once: a dict the metrics own, of store requests answered successfully at once (no
            time spent), by operation name: each one is counted into it as it is answered, and
            the metrics read it when they are read. Without it, ``observe`` is called for each.
        wall_clock: seconds since 1970 (time.time), for the progress view's timestamps.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
        max_keys_per_job: int = DEFAULT_MAX_KEYS_PER_JOB,
        job_ttl: float = DEFAULT_JOB_TTL,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        resume_grace: float = RESUME_GRACE,
        client_ttl: float | None = None,
        durable: bool = False,
        observe: Callable[[str, float, bool], None] | None = None,
        wall_clock: Callable[[], float] | None = None,
        at_once: dict[str, int] | None = None,
    ) -> None:
        super().__init__(clock, wall_clock, durable, observe)
        # Store requests answered at once, by op: the metrics' own dict, or, without one, those
        # of the current read, handed to ``observe`` at its end.
        self._answered: dict[str, int] = {} if at_once is None else at_once
        self._hand_over = at_once is None
        self.job_ttl = job_ttl
        self.jobs: dict[str, Job] = {}
        self.conns: dict[int, Conn] = {}
        self.kv = KeyValue(self, max_value_bytes=max_value_bytes, max_keys_per_job=max_keys_per_job)
        self.membership = Membership(self)
        self.rendezvous = Rendezvous(self, self.membership, heartbeat_timeout)
        self.liveness = Liveness(
            self, self.membership, heartbeat_timeout=heartbeat_timeout, resume_grace=resume_grace
        )
        self.dedupe = Dedupe(self, client_ttl=job_ttl if client_ttl is None else client_ttl)
        self.progress = Progress(self)
        self.stacks = Stacks(self, self.jobs)
        self.progress.on_behind = self.stacks.ask_behind
        self.quorum = Quorum(self, self.kv, heartbeat_timeout=lambda: self.liveness.heartbeat_timeout)
        # The command tables: every operation to the part that answers it; store operations by
        # their compact code, the others by name.
        self._store: dict[int, tuple[str, StoreHandler]] = self.kv.handlers()
        self._handlers: dict[str, Handler] = {
            **self.rendezvous.handlers(),
            **self.liveness.handlers(),
            **self.progress.handlers(),
            **self.quorum.handlers(),
            **self.stacks.handlers(),
            "status": self._op_status,
        }
        names = set(self._handlers) | {name for name, _ in self._store.values()}
        assert names == OPS, sorted(OPS ^ names)

    # -- settings the parts hold, readable here
    @property
    def heartbeat_timeout(self) -> float:
        return self.liveness.heartbeat_timeout

    @property
    def resume_grace(self) -> float:
        return self.liveness.resume_grace

    @property
    def resends_answered(self) -> int:
        return self.dedupe.resends_answered

    # ------------------------------------------------------------------ connections
    def connect(
        self,
        conn_id: int,
        job: str,
        role: str,
        *,
        peer: str = "",
        session: object = None,
        cid: object = None,
    ) -> None:
        """Register an authenticated connection to ``job``; re-attach a member when ``session`` names
        one; ``cid`` (CID_BYTES bytes) names the client whose numbered mutations it carries.

        An admin connection (`aiocoll status`) only looks: it makes no job. Naming one that does
        not exist gives it an empty job of that name that no view lists, and that goes with it.
        """
        now = self.clock()
        j = (self.jobs.get(job) or Job(job, now)) if role == ROLE_ADMIN else self.job(job, now)
        conn = Conn(conn_id, j, role, peer, now)
        self.conns[conn_id] = conn
        if role != ROLE_ADMIN:  # watching a job (status --watch) does not keep it from expiring
            j.conns.add(conn)
            j.last_activity = now
        self.dedupe.attach(conn, cid, now)
        if role == ROLE_BEAT:
            self.membership.attach_beat(conn, session)
        elif session is not None and role == ROLE_WORKER:
            self.membership.resume(conn, session, now)
        self.membership.announce()

    def refused_connection(self, job: str, role: object, peer: str, reason: str) -> None:
        """A connection naming ``job`` failed authentication (see Membership.refused_connection)."""
        self.membership.refused_connection(self.jobs.get(job), role, peer, reason)

    def disconnect(self, conn_id: int, reason: str) -> None:
        """Forget a connection: drop its waiters, declare its members lost (unless they left)."""
        self.disconnect_many(((conn_id, reason),))

    def disconnect_many(self, lost: Iterable[tuple[int, str]]) -> None:
        """Forget several connections (``(conn_id, reason)`` each) at once: the others hear of the
        members lost with them in one announcement, not one per connection."""
        now = self.clock()
        for conn_id, reason in lost:
            conn = self.conns.pop(conn_id, None)
            if conn is None:
                continue
            job = conn.job
            job.conns.discard(conn)
            if conn.role != ROLE_ADMIN:
                job.last_activity = now
            self.dedupe.detach(conn, now)
            self.kv.drop(conn)
            self.rendezvous.disconnect(conn, reason)
            self.membership.disconnect(conn, reason)
            self.quorum.disconnect(conn, reason)
        self.membership.announce()

    # ------------------------------------------------------------------ requests
    def request(self, conn_id: int, header: dict[str, Any] | list[Any], payload: bytes | bytearray) -> None:
        """Handle one request frame; replies and events land in ``outbox``.

        Raises:
            ValueError: the header has no integer id; the connection should be closed.
        """
        self.requests(conn_id, ((header, payload),))

    def requests(
        self, conn_id: int, messages: Iterable[tuple[dict[str, Any] | list[Any], bytes | bytearray]]
    ) -> None:
        """Handle the request frames of one read of a connection, in order.

        Raises:
            ValueError: a header has no integer id; the connection should be closed (the
                requests before it were handled).
        """
        conn = self.conns[conn_id]
        now = self.started = self.clock()
        conn.last_seen = now
        if conn.role != ROLE_ADMIN:
            conn.job.last_activity = now
        store = self._store_request
        try:
            for header, payload in messages:
                if type(header) is list:
                    store(conn, header, payload, now)
                else:
                    self._control_request(conn, header, payload, now)  # type: ignore[arg-type]
        finally:
            if self._hand_over and self._answered:
                self._count_answered()
            self.membership.announce()

    def _count_answered(self) -> None:
        """Without the metrics' dict: hand the counts of the requests answered at once in one
        read to ``observe``."""
        answered = self._answered
        if self.observe is not None:
            for op, n in answered.items():
                for _ in range(n):
                    self.observe(op, 0.0, True)
        answered.clear()  # kept, not replaced: one dict for every read

    def _store_request(self, conn: Conn, h: list[Any], payload: bytes | bytearray, now: float) -> None:
        """A compact store request (protocol._store): [code, id, ...]. The store's hot path: a
        request answered at once counts in the metrics with no time spent (it was answered in
        the same call), one that waited with the time it waited."""
        try:
            code, req_id = h[0], h[1]
        except IndexError:
            raise ValueError(f"store request without an id ({str(h)[:64]})") from None
        if type(req_id) is not int:
            raise ValueError(f"store request without an integer id ({str(h)[:64]})")
        entry = self._store.get(code)
        if entry is None:
            msg = f"unknown store operation {str(code)[:64]!r}"
            self.fail(conn.id, req_id, str(code)[:64], now, ERR_UNKNOWN_OP, msg, compact=True)
            return
        op, handler = entry
        if op not in conn.allowed:
            self.fail(conn.id, req_id, op, now, ERR_INVALID, self._not_allowed(conn, op), compact=True)
            return
        client = answer = None
        if conn.cid is not None and code in MUTATIONS:
            try:
                client = self.dedupe.check(conn, op, req_id, h[2] if len(h) > 2 else None)
            except Refused as exc:
                self.fail(conn.id, req_id, op, now, exc.err, f"{op}: {exc.msg}", exc.keys, compact=True)
                return
            except AlreadyAnswered as again:  # a re-send: the reply it had, nothing carried out
                answer = again.value, again.payload
            j = len(self.journal)
        if answer is None:
            try:
                answer = handler(conn, req_id, h, payload)
            except (IndexError, TypeError):  # a field missing, or of a type nothing checked
                msg = f"{op}: malformed request {str(h)[:200]}"
                self.fail(conn.id, req_id, op, now, ERR_INVALID, msg, compact=True)
                return
            except Refused as exc:
                self.fail(conn.id, req_id, op, now, exc.err, f"{op}: {exc.msg}", exc.keys, compact=True)
                return
            if answer is PARKED:
                return
        # Answered at once: counted, and replied to unless the op is answered only when refused.
        counts = self._answered
        counts[op] = counts.get(op, 0) + 1
        body: bytes | bytearray
        if answer is DONE:
            value, body = None, b""
        else:
            value, body = answer
            if op not in _NO_REPLY_NAMES:
                self.outbox.append((conn.id, [req_id, OK] if value is None else [req_id, OK, value], body))
        if client is not None:
            if self.durable:  # the reply and the mutation's records go to the journal together
                self.dedupe.remember(conn, client, req_id, value, body, j)
            else:
                client.replies[req_id] = (value, body)

    def _not_allowed(self, conn: Conn, op: str) -> str:
        return f"a {conn.role!r} connection may not use {op!r} (allowed: {sorted(ROLE_OPS[conn.role])})"

    def _control_request(
        self, conn: Conn, header: dict[str, Any], payload: bytes | bytearray, now: float
    ) -> None:
        """A control request (join, hb, leave, status, table, progress): a map header."""
        req_id = header.get("id")
        if type(req_id) is not int:
            raise ValueError(f"request without an integer 'id' (op {str(header.get('op'))[:64]!r})")
        op = header.get("op")
        handler = self._handlers.get(op) if type(op) is str else None
        if handler is None:
            known = sorted(CONTROL_OPS)
            self.fail(
                conn.id,
                req_id,
                str(op),
                now,
                ERR_UNKNOWN_OP,
                f"unknown operation {str(op)[:64]!r}; known: {known}",
            )
            return
        assert type(op) is str
        if op not in conn.allowed:
            self.fail(conn.id, req_id, op, now, ERR_INVALID, self._not_allowed(conn, op))
            return
        n = len(self.outbox)
        try:
            handler(conn, req_id, header, memoryview(payload))
        except Refused as exc:
            del self.outbox[n:]
            self.fail(conn.id, req_id, op, now, exc.err, f"{op}: {exc.msg}", exc.keys)

    def _op_status(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        job = h.get("job")
        if job is not None and type(job) is not str:
            raise Refused(ERR_INVALID, f"'job' must be a string or None, got {type(job).__name__}")
        if job is not None and job not in self.jobs:
            raise Refused(ERR_INVALID, _views.no_such_job(self.jobs, job))
        self.reply(conn, req_id, "status", self.started, {"id": req_id, "ok": True, "jobs": self.status(job)})

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float:
        """The clock value at which ``tick`` next has work (a waiter's deadline or housekeeping)."""
        return min(self.next_timer(), self.liveness.next_round)

    def tick(self) -> None:
        """Expire waits and joins whose deadline passed; every second, check liveness and job expiry."""
        now = self.clock()
        self.run_timers(now)
        if self.liveness.due(now):
            self.liveness.check(now)
            self.membership.announce()
            self.progress.recheck(self.jobs, now)
            self.dedupe.sweep(self.jobs, now)
            self._expire_jobs(now)

    def _expire_jobs(self, now: float) -> None:
        for name, job in list(self.jobs.items()):
            if job.conns or now - job.last_activity <= self.job_ttl or self.membership.resuming(job):
                continue
            self.drop_job(job)
            log.info("job=%s event=job_expired idle_for=%.0fs", name, now - job.last_activity)

    def drop_job(self, job: Job) -> None:
        del self.jobs[job.name]
        self.stacks.forget_job(job.name)
        self.membership.forget_job(job)
        if self.durable:
            self.journal.append(["drop", job.name])

    def job(self, name: str, now: float) -> Job:
        """The job named ``name``, made on first use."""
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = Job(name, now)
        return job

    def out_of_capacity(self, reason: str) -> None:
        """The shell is refusing connections (``reason`` says why: no file descriptor to spare):
        every rank waiting in a forming round hears it now (EV_REFUSED), and a join that times
        out later says it."""
        self.capacity_note = (self.clock(), reason)
        rounds = [j.round for j in self.jobs.values() if j.round is not None and not j.round.complete]
        self.membership.notify_forming(rounds, {"ev": EV_REFUSED, "peer": "", "reason": reason[:500]})

    # ------------------------------------------------------------------ views
    def status(self, job: str | None = None) -> list[dict[str, Any]]:
        """What the ``status`` op, /jobs and `aiocoll status` show: one entry per job (see
        _views.status)."""
        views = _views.status(
            self.jobs, self.membership, self.progress, self.events, self.clock(), self.wall_clock(), job
        )
        self.stacks.annotate(views)  # the stacks of the ranks holding a job back
        return views

    def member_count(self) -> int:
        return len(self.membership.live)

    # ------------------------------------------------------------------ durability
    def take_journal(self) -> list[Record]:
        records, self.journal = self.journal, []
        return records

    def snapshot(self) -> dict[str, Any]:
        """The whole durable state as plain msgpack-able data (keys, rounds, members)."""
        return _persistence.snapshot(self.jobs)

    def restore(self, snap: dict[str, Any] | None, records: list[Record]) -> None:
        """Rebuild from a snapshot plus the journal records after it; members start ``resuming``.

        Must be called on a fresh state, before any connection.
        """
        _persistence.restore(self, snap, records)

    def apply_record(self, rec: Record) -> None:
        """Replay one journal record (as written by a live mutation)."""
        _persistence.apply_record(self, rec)
