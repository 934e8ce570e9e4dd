"""The coordinator's pure state machine: per-job key spaces, waiting operations, rendezvous rounds,
member liveness and job expiry. No sockets, no asyncio, no threads; time comes from an injected
clock. May import aiocoll foundations (protocol schema, errors) only, never client/ or the public
surface.

It exists so that every decision the coordinator makes can be tested without a network and
replayed from the durable journal: the asyncio shell (_coordinator.py) feeds it requests,
connection openings and closings and clock ticks, and drains what it decided: ``outbox`` (frames to
send, per connection), ``closes`` (connections to drop, with a reason) and ``journal`` (records of
acknowledged mutations, for the durable log).

Records in the journal are plain lists, so msgpack can carry them; ``apply_record`` replays one.
Every mutation goes through the same helpers live and on replay, so a restored state equals the
state that acknowledged the records.

Exactly-once mutations: a mutation numbered by its client (hello ``cid``, header ``rid`` and
``ack``, see protocol._coordinator) has its reply remembered per client and job, and its records
are wrapped in one ``req`` record together with that reply, so that a crash can never keep the
mutation but lose the memory of it. A re-sent rid is answered from that memory and not applied.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import math
import os
from collections.abc import Callable
from typing import Any

import msgpack

from aiocoll._progress_check import JobProgress, ProgressError, Verdict
from aiocoll.protocol._coordinator import (
    CID_BYTES,
    DEDUPE_WINDOW,
    ERR_INVALID,
    ERR_RENDEZVOUS,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    ERR_UNKNOWN_OP,
    EV_BEHIND,
    EV_MEMBER_LOST,
    EV_MISMATCH,
    EV_REFUSED,
    EV_RESTARTED,
    EV_SESSION_LOST,
    HEARTBEAT_TIMEOUT,
    MAX_KEY_BYTES,
    MUTATING_OPS,
    OPS,
    RESUME_GRACE,
    ROLE_ADMIN,
    ROLE_BEAT,
    ROLE_STORE,
    ROLE_WORKER,
)

__all__ = [
    "DEFAULT_JOB_TTL",
    "DEFAULT_MAX_KEYS_PER_JOB",
    "DEFAULT_MAX_VALUE_BYTES",
    "CoordinatorState",
    "EncodedHeader",
]

log = logging.getLogger("aiocoll.server")

DEFAULT_MAX_VALUE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_KEYS_PER_JOB = 1_000_000
DEFAULT_JOB_TTL = 3600.0
MAX_KEYS_PER_REQUEST = 100_000
MAX_WORLD_SIZE = 1 << 20
MAX_ADDRS = 64
MAX_HOST_CHARS = 256
# Liveness and expiry scans walk every member and job; once a second is plenty for a 10 s
# heartbeat timeout and keeps a 10,000-member coordinator's housekeeping cheap.
HOUSEKEEPING_INTERVAL = 1.0
# Forgotten clients' dedupe memory is looked for this often (it holds no deadline anyone waits on).
CLIENT_SWEEP_INTERVAL = 30.0
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# A str of at most this many characters is at most MAX_KEY_BYTES in UTF-8 (4 bytes a character):
# the hot operations take such a key without encoding it.
_SURELY_SHORT_KEY = MAX_KEY_BYTES // 4

# What each role may ask: admin connections (`aiocoll status`) only read.
_READ_OPS = frozenset({"get", "wait", "check", "nkeys", "mget", "hb", "status", "table"})
_ROLE_OPS: dict[str, frozenset[str]] = {
    ROLE_WORKER: OPS,
    ROLE_STORE: OPS - {"join", "leave"},
    ROLE_ADMIN: _READ_OPS,
    ROLE_BEAT: frozenset({"hb", "progress"}),
}

# (connection id, reply or event header, payload); a large shared header comes pre-encoded.
Send = tuple[int, "dict[str, Any] | EncodedHeader", "bytes | bytearray | memoryview"]
Record = list[Any]


class _Refused(Exception):
    """A well-formed request the coordinator will not carry out; becomes an error reply."""

    def __init__(self, err: str, msg: str, keys: list[str] | None = None) -> None:
        super().__init__(msg)
        self.err = err
        self.msg = msg
        self.keys = keys or []


class _Fatal(Exception):
    """A request so malformed that the connection cannot continue (no request id to answer)."""


class _Client:
    """What the coordinator remembers of one client (hello ``cid``) of one job: the replies of its
    numbered mutations above ``floor`` (its latest ack), so that re-sent ones are not applied twice."""

    __slots__ = ("attached", "floor", "last_seen", "replies")

    def __init__(self, floor: int, now: float) -> None:
        self.floor = floor
        self.replies: dict[int, tuple[dict[str, Any], bytes]] = {}
        self.attached = 0  # open connections that carry this cid
        self.last_seen = now

    def forget_through(self, ack: int) -> None:
        """Drop replies the client has confirmed receiving (rid <= ack)."""
        if ack <= self.floor:
            return
        self.floor = ack
        replies = self.replies
        # Rids mostly arrive in order, so the oldest entries come first; a re-sent one that came
        # late is found by the full scan, done only when the window fills.
        while replies:
            rid = next(iter(replies))
            if rid > ack:
                break
            del replies[rid]
        if len(replies) >= DEDUPE_WINDOW:
            for rid in [r for r in replies if r <= ack]:
                del replies[rid]


class _Conn:
    __slots__ = (
        "allowed",
        "beat_of",
        "cid",
        "id",
        "job",
        "joining",
        "last_seen",
        "member",
        "peer",
        "role",
        "waiters",
    )

    def __init__(self, conn_id: int, job: _Job, role: str, peer: str, now: float) -> None:
        self.cid: bytes | None = None
        self.id = conn_id
        self.job = job
        self.role = role
        self.allowed = _ROLE_OPS.get(role, OPS)  # the operations this role may ask
        self.peer = peer
        self.member: _Member | None = None  # set once this connection joined or resumed
        self.beat_of: _Member | None = None  # a beat connection: the member it keeps alive
        self.joining: _Member | None = None  # a join waiting for the round to complete
        self.waiters: set[_Waiter] = set()
        self.last_seen = now


class _Waiter:
    """A get/wait/mget waiting for keys; completed by a set or expired by the clock."""

    __slots__ = ("conn", "deadline", "done", "keys", "op", "req_id", "started", "timeout")

    def __init__(
        self,
        conn: _Conn,
        req_id: int,
        op: str,
        keys: list[str],
        deadline: float | None,
        started: float,
        timeout: float | None,
    ) -> None:
        self.conn = conn
        self.req_id = req_id
        self.op = op
        self.keys = keys
        self.deadline = deadline
        self.started = started
        self.timeout = timeout
        self.done = False


class _Member:
    """One rank of one rendezvous round."""

    __slots__ = (
        "addrs",
        "beat",
        "conn",
        "deadline",
        "host",
        "last_seen",
        "rank",
        "reason",
        "req_id",
        "round",
        "session",
        "started",
        "state",
        "table_in_payload",
        "table_ref",
        "timeout",
    )

    def __init__(self, rank: int, addrs: list[Any], host: str, rnd: _Round) -> None:
        self.rank = rank
        self.addrs = addrs
        self.host = host
        self.session = ""
        # joining -> alive -> left | lost; resuming after a restart until the client re-attaches.
        self.state = "joining"
        self.conn: _Conn | None = None
        self.beat: _Conn | None = None  # its beat connection (ROLE_BEAT), heard apart from conn
        self.round = rnd
        self.req_id = 0
        self.deadline: float | None = None
        self.started = 0.0
        self.timeout: float | None = None
        self.reason = ""
        self.last_seen = 0.0
        self.table_in_payload = False
        self.table_ref = False


class _Round:
    __slots__ = (
        "broken",
        "complete",
        "free_hint",
        "job",
        "members",
        "number",
        "table",
        "table_digest",
        "world_size",
    )

    def __init__(self, job: _Job, number: int, world_size: int) -> None:
        self.job = job
        self.number = number
        self.world_size = world_size
        self.members: dict[int, _Member] = {}
        self.complete = False
        self.broken = False  # a member of the completed round left or was lost
        self.free_hint = 0  # lowest rank that may be free
        # The completed round's member table, msgpack-encoded once, and its digest (for
        # ``table_ref`` joins and the ``table`` operation); built on completion or on demand.
        self.table: bytes | None = None
        self.table_digest = b""


class _Job:
    __slots__ = (
        "clients",
        "conns",
        "kv",
        "last_activity",
        "name",
        "next_round",
        "progress",
        "round",
        "waiters",
    )

    def __init__(self, name: str, now: float) -> None:
        self.name = name
        self.clients: dict[bytes, _Client] = {}
        self.kv: dict[str, bytes | bytearray] = {}
        self.waiters: dict[str, set[_Waiter]] = {}
        self.conns: set[_Conn] = set()
        self.last_activity = now
        self.round: _Round | None = None
        self.next_round = 0
        self.progress = JobProgress()


class EncodedHeader:
    """A reply header already encoded as msgpack, in parts; the shell writes the parts as they are.

    Used where many recipients share most of a large header (the rendezvous membership table).
    """

    __slots__ = ("parts", "size")

    def __init__(self, parts: tuple[bytes, ...]) -> None:
        self.parts = parts
        self.size = sum(len(p) for p in parts)

    def decode(self) -> dict[str, Any]:
        header: dict[str, Any] = msgpack.unpackb(b"".join(self.parts), raw=False, strict_map_key=False)
        return header


_MEMBERS_KEY = msgpack.packb("members", use_bin_type=True)


def _ok(req_id: int) -> dict[str, Any]:
    return {"id": req_id, "ok": True}


def _err(req_id: int, err: str, msg: str, keys: list[str] | None = None) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "err": err, "msg": msg, "keys": keys or []}


def _own(payload: bytes | bytearray | memoryview) -> bytes | bytearray:
    """The payload as an object we may keep: the decoder hands each frame a fresh bytearray."""
    if isinstance(payload, memoryview):
        obj = payload.obj
        if isinstance(obj, (bytes, bytearray)) and len(obj) == payload.nbytes and payload.c_contiguous:
            return obj
        return bytes(payload)
    return payload


def _fmt_timeout(timeout: float | None) -> str:
    return "no limit" if timeout is None else f"{timeout:.3g}s"


class CoordinatorState:
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
    ) -> None:
        self.clock = clock
        # Seconds since 1970, for the "since" of progress reports (``status``); default: clock.
        self.wall_clock = wall_clock or clock
        self.max_value_bytes = max_value_bytes
        self.max_keys_per_job = max_keys_per_job
        self.job_ttl = job_ttl
        self.heartbeat_timeout = heartbeat_timeout
        self.resume_grace = resume_grace
        self.client_ttl = job_ttl if client_ttl is None else client_ttl
        self.durable = durable
        self.observe = observe
        self.jobs: dict[str, _Job] = {}
        self.conns: dict[int, _Conn] = {}
        self.outbox: list[Send] = []
        self.closes: list[tuple[int, str]] = []
        self.journal: list[Record] = []
        self._sessions: dict[str, _Member] = {}
        self._live_members: set[_Member] = set()  # alive or resuming: watched by housekeeping
        self._timers: list[tuple[float, int, _Waiter | _Member]] = []
        # Grows with every deadline pushed: a shell whose timer is armed and that saw the same
        # count need not ask next_deadline again (nothing earlier can have appeared).
        self.timers_pushed = 0
        self._timer_seq = itertools.count()
        self._next_housekeeping = clock() + HOUSEKEEPING_INTERVAL
        self._last_housekeeping = clock()
        self._next_client_sweep = clock() + CLIENT_SWEEP_INTERVAL
        self.resends_answered = 0  # re-sent mutations answered from memory (for tests and logs)
        self._started = 0.0  # clock value when the request being handled arrived
        self._handlers: dict[str, Callable[[_Conn, int, dict[str, Any], memoryview], None]] = {
            "set": self._op_set,
            "get": self._op_get,
            "add": self._op_add,
            "cas": self._op_cas,
            "wait": self._op_wait,
            "check": self._op_check,
            "del": self._op_del,
            "nkeys": self._op_nkeys,
            "mget": self._op_mget,
            "mset": self._op_mset,
            "append": self._op_append,
            "join": self._op_join,
            "hb": self._op_hb,
            "leave": self._op_leave,
            "status": self._op_status,
            "table": self._op_table,
            "progress": self._op_progress,
        }

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
        one; ``cid`` (CID_BYTES bytes) names the client whose numbered mutations it carries."""
        now = self.clock()
        j = self._job(job, now)
        conn = _Conn(conn_id, j, role, peer, now)
        self.conns[conn_id] = conn
        j.conns.add(conn)
        j.last_activity = now
        if type(cid) is bytes and len(cid) == CID_BYTES:
            conn.cid = cid
            client = j.clients.get(cid)
            if client is None:
                client = j.clients[cid] = _Client(0, now)
            client.attached += 1
            client.last_seen = now
        if role == ROLE_BEAT:
            self._attach_beat(conn, session)
            return
        if session is None or role != ROLE_WORKER:
            return
        member = self._sessions.get(session) if isinstance(session, str) else None
        if member is None or member.round.job is not j or member.state not in ("alive", "resuming"):
            why = (
                "this coordinator does not know that session (it restarted without --state-dir, "
                "or the session ended)"
                if member is None or member.round.job is not j
                else f"the member was already declared {member.state}: {member.reason or 'no reason'}"
            )
            log.warning("job=%s event=resume_refused peer=%s reason=%s", job, peer, why)
            self.outbox.append((conn_id, {"ev": EV_SESSION_LOST, "reason": why}, b""))
            return
        old = member.conn
        if old is not None and old is not conn:
            old.member = None  # its close must not declare the member lost
            self.closes.append((old.id, f"session of rank {member.rank} resumed on a new connection"))
        was = member.state
        member.conn = conn
        member.state = "alive"
        member.last_seen = now
        conn.member = member
        self._live_members.add(member)
        log.info("job=%s rank=%d event=resumed round=%d peer=%s", job, member.rank, member.round.number, peer)
        if was == "resuming":
            self.outbox.append((conn_id, {"ev": EV_RESTARTED}, b""))

    def _attach_beat(self, conn: _Conn, session: object) -> None:
        """A member's beat connection: it keeps the member alive apart from its main connection."""
        member = self._sessions.get(session) if isinstance(session, str) else None
        if member is None or member.round.job is not conn.job or member.state != "alive":
            self.closes.append((conn.id, "a beat connection must name the session of an alive member"))
            return
        old = member.beat
        if old is not None and old is not conn:
            old.beat_of = None
            self.closes.append((old.id, f"rank {member.rank}'s beats moved to a new connection"))
        member.beat = conn
        conn.beat_of = member

    def refused_connection(self, job: str, role: object, peer: str, reason: str) -> None:
        """A connection naming ``job`` failed authentication: tell that job's members waiting in a
        forming round (EV_REFUSED), so their logs say why a rank may never arrive. Only a notice:
        the hello is unauthenticated, and an outsider must not be able to fail a rendezvous."""
        j = self.jobs.get(job)
        rnd = j.round if j is not None else None
        if role != ROLE_WORKER or rnd is None or rnd.complete:
            return
        event = {"ev": EV_REFUSED, "peer": peer[:300], "reason": reason[:500]}
        for m in rnd.members.values():
            if m.state == "joining" and m.conn is not None:
                self.outbox.append((m.conn.id, event, b""))

    def disconnect(self, conn_id: int, reason: str) -> None:
        """Forget a connection: drop its waiters, declare its member lost (unless it left)."""
        conn = self.conns.pop(conn_id, None)
        if conn is None:
            return
        job = conn.job
        job.conns.discard(conn)
        job.last_activity = self.clock()
        if conn.cid is not None:
            client = job.clients.get(conn.cid)
            if client is not None:
                client.attached -= 1
                client.last_seen = job.last_activity
        for w in conn.waiters:
            w.done = True
            for key in w.keys:
                ws = job.waiters.get(key)
                if ws is not None:
                    ws.discard(w)
                    if not ws:
                        del job.waiters[key]
        conn.waiters.clear()
        beat_of = conn.beat_of
        if beat_of is not None and beat_of.beat is conn:
            beat_of.beat = None  # its closing declares nothing: only silence on both does
        if conn.joining is not None:
            self._drop_joining(conn.joining, f"connection closed: {reason}")
        member = conn.member
        if member is not None and member.conn is conn:
            self._lose(member, f"connection closed without leave ({reason})")

    # ------------------------------------------------------------------ requests
    def request(self, conn_id: int, header: dict[str, Any], payload: memoryview) -> None:
        """Handle one request frame; replies and events land in ``outbox``.

        Raises:
            ValueError: the header has no integer ``id``; the connection should be closed.
        """
        conn = self.conns[conn_id]
        req_id = header.get("id")
        if type(req_id) is not int:
            raise ValueError(f"request without an integer 'id' (op {str(header.get('op'))[:64]!r})")
        op = header.get("op")
        now = self._started = self.clock()
        conn.last_seen = now
        conn.job.last_activity = now
        handler = self._handlers.get(op) if type(op) is str else None
        if handler is None:
            self.outbox.append(
                (
                    conn_id,
                    _err(req_id, ERR_UNKNOWN_OP, f"unknown operation {str(op)[:64]!r}; known: {sorted(OPS)}"),
                    b"",
                )
            )
            self._observe(str(op), now, False)
            return
        if op not in conn.allowed:
            self.outbox.append(
                (
                    conn_id,
                    _err(
                        req_id,
                        ERR_INVALID,
                        f"a {conn.role!r} connection may not use {op!r} "
                        f"(allowed: {sorted(_ROLE_OPS[conn.role])})",
                    ),
                    b"",
                )
            )
            self._observe(str(op), now, False)
            return
        rid = header.get("rid") if op in MUTATING_OPS else None
        client: _Client | None = None
        if rid is not None:
            try:
                client = self._numbered(conn, req_id, op, rid, header.get("ack"))
            except _Refused as exc:
                self.outbox.append((conn_id, _err(req_id, exc.err, f"{op}: {exc.msg}", exc.keys), b""))
                self._observe(op, now, False)
                return
            if client is None:  # answered from memory
                return
        n = len(self.outbox)
        j = len(self.journal)
        try:
            handler(conn, req_id, header, payload)
        except _Refused as exc:
            del self.outbox[n:]
            self.outbox.append((conn_id, _err(req_id, exc.err, f"{op}: {exc.msg}", exc.keys), b""))
            self._observe(op, now, False)
            return
        if client is not None:
            assert type(rid) is int and conn.cid is not None
            self._remember_live(conn, client, req_id, rid, n, j)

    def _numbered(self, conn: _Conn, req_id: int, op: str, rid: object, ack: object) -> _Client | None:
        """Check a numbered mutation; answer a re-sent one from memory (returns None then), else
        return its client's record, ready for ``_remember_live``."""
        if conn.cid is None:
            raise _Refused(ERR_INVALID, "'rid' needs a client id: send 'cid' in the hello")
        if type(rid) is not int or type(ack) is not int or not 0 <= ack < rid:
            raise _Refused(
                ERR_INVALID, f"'rid' and 'ack' must be integers with 0 <= ack < rid, got {rid!r}, {ack!r}"
            )
        job = conn.job
        client = job.clients[conn.cid]  # made by connect(), kept while a connection carries the cid
        client.last_seen = self._started
        stored = client.replies.get(rid)
        if stored is not None:
            client.forget_through(ack)
            header, payload = stored
            self.resends_answered += 1
            log.info(
                "job=%s event=resent_request_answered op=%s rid=%d peer=%s", job.name, op, rid, conn.peer
            )
            self._reply(conn, req_id, op, self._started, {**header, "id": req_id}, payload)
            return None
        if rid <= client.floor:
            raise _Refused(
                ERR_INVALID,
                f"request number {rid} of this client was already acknowledged (ack {client.floor}); "
                f"a client must not re-send a request it had the reply to",
            )
        if rid - max(ack, client.floor) > DEDUPE_WINDOW:
            raise _Refused(
                ERR_INVALID,
                f"request number {rid} is more than {DEDUPE_WINDOW} beyond the client's acknowledged "
                f"{max(ack, client.floor)}: a client may have at most {DEDUPE_WINDOW} mutations awaiting "
                f"their reply",
            )
        client.forget_through(ack)
        return client

    def _remember_live(self, conn: _Conn, client: _Client, req_id: int, rid: int, n: int, j: int) -> None:
        """Keep the reply of numbered mutation ``rid`` and wrap its journal records into one."""
        outbox = self.outbox
        # The reply is normally the last frame; replies to waiters the mutation woke come before it.
        i = len(outbox) - 1
        while i >= n:
            c, h, p = outbox[i]
            if c == conn.id and type(h) is dict and h.get("id") == req_id:
                break
            i -= 1
        else:
            return  # mutations answer at once, so this does not happen; nothing to remember then
        if h.get("ok") is not True:
            return
        body = p if type(p) is bytes else bytes(p)
        if not self.durable:
            # Kept as sent, "id" included (the hot path: no copy); a re-sent request is answered
            # with the id replaced, and nothing else reads it.
            client.replies[rid] = (h, body)
            return
        kept = dict(h)
        del kept["id"]
        client.replies[rid] = (kept, body)
        records = self.journal[j:]
        del self.journal[j:]
        assert conn.cid is not None
        self.journal.append(["req", conn.job.name, conn.cid, rid, client.floor, kept, body, records])

    def _observe(self, op: str, started: float, ok: bool) -> None:
        if self.observe is not None:
            self.observe(op, self.clock() - started, ok)

    def _reply(
        self,
        conn: _Conn,
        req_id: int,
        op: str,
        started: float,
        header: dict[str, Any] | EncodedHeader | None = None,
        payload: bytes | bytearray | memoryview = b"",
    ) -> None:
        self.outbox.append((conn.id, header if header is not None else {"id": req_id, "ok": True}, payload))
        if self.observe is not None:
            self.observe(op, self.clock() - started, True)

    # -- validation helpers
    @staticmethod
    def _key(header: dict[str, Any], field: str = "key") -> str:
        key = header.get(field)
        if type(key) is not str:
            raise _Refused(ERR_INVALID, f"{field!r} must be a string, got {type(key).__name__}")
        n = len(key)
        if n == 0 or (n * 4 > MAX_KEY_BYTES and len(key.encode("utf-8")) > MAX_KEY_BYTES):
            raise _Refused(
                ERR_TOO_LARGE if n else ERR_INVALID,
                f"key {key[:64]!r} must be 1..{MAX_KEY_BYTES} UTF-8 bytes",
                [key[:256]],
            )
        return key

    @classmethod
    def _keys(cls, header: dict[str, Any]) -> list[str]:
        keys = header.get("keys")
        if not isinstance(keys, list):
            raise _Refused(ERR_INVALID, f"'keys' must be a list of strings, got {type(keys).__name__}")
        if len(keys) > MAX_KEYS_PER_REQUEST:
            raise _Refused(
                ERR_TOO_LARGE, f"{len(keys)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}"
            )
        for k in keys:
            cls._key({"key": k})
        return keys

    @staticmethod
    def _timeout(header: dict[str, Any]) -> float | None:
        t = header.get("timeout")
        if t is None:
            return None
        if type(t) not in (int, float) or math.isnan(t) or t < 0:
            raise _Refused(ERR_INVALID, f"'timeout' must be None or a non-negative number, got {t!r}")
        return None if math.isinf(t) else float(t)

    def _value(self, key: str, value: bytes | bytearray | memoryview) -> None:
        if len(value) > self.max_value_bytes:
            raise _Refused(
                ERR_TOO_LARGE,
                f"value of {len(value)} bytes for key {key[:256]!r} exceeds the "
                f"coordinator's limit of {self.max_value_bytes} bytes (--max-value-bytes)",
                [key],
            )

    def _room(self, job: _Job, new_keys: int, key: str) -> None:
        if new_keys and len(job.kv) + new_keys > self.max_keys_per_job:
            raise _Refused(
                ERR_TOO_LARGE,
                f"job {job.name!r} already holds {len(job.kv)} keys; the limit "
                f"is {self.max_keys_per_job} (delete keys or raise the limit)",
                [key],
            )

    # -- key-value mutations (shared by live requests and replay)
    def _put(self, job: _Job, key: str, value: bytes | bytearray) -> None:
        job.kv[key] = value
        if self.durable:
            self.journal.append(["set", job.name, key, value])
        if key in job.waiters:
            self._wake(job, key)

    def _wake(self, job: _Job, key: str) -> None:
        for w in job.waiters.pop(key, ()):
            if w.done:
                continue
            missing = [k for k in w.keys if k not in job.kv]
            if missing:  # another key it needs is still absent (or was deleted meanwhile)
                job.waiters.setdefault(missing[0], set()).add(w)
                continue
            self._finish_waiter(w)

    def _finish_waiter(self, w: _Waiter) -> None:
        w.done = True
        conn = w.conn
        conn.waiters.discard(w)
        job = conn.job
        for k in w.keys:  # unregister from the other keys it was parked on
            ws = job.waiters.get(k)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del job.waiters[k]
        kv = job.kv
        if w.op == "get":
            self._reply(conn, w.req_id, "get", w.started, None, kv[w.keys[0]])
        elif w.op == "wait":
            self._reply(conn, w.req_id, "wait", w.started)
        else:
            values = [kv[k] for k in w.keys]
            self._reply(
                conn,
                w.req_id,
                "mget",
                w.started,
                {"id": w.req_id, "ok": True, "sizes": [len(v) for v in values]},
                b"".join(values),
            )

    def _park(
        self, conn: _Conn, req_id: int, op: str, keys: list[str], missing: list[str], timeout: float | None
    ) -> None:
        now = self.clock()
        if timeout == 0:
            raise _Refused(
                ERR_TIMEOUT, f"key(s) {missing!r} of job {conn.job.name!r} do not exist (timeout 0)", missing
            )
        deadline = None if timeout is None else now + timeout
        w = _Waiter(conn, req_id, op, keys, deadline, now, timeout)
        conn.waiters.add(w)
        conn.job.waiters.setdefault(missing[0], set()).add(w)
        if deadline is not None:
            heapq.heappush(self._timers, (deadline, next(self._timer_seq), w))
            self.timers_pushed += 1

    # -- operations
    def _op_set(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        key = h.get("key")
        if type(key) is not str or not 0 < len(key) <= _SURELY_SHORT_KEY:
            key = self._key(h)  # the full check, and its error
        job = conn.job
        if len(payload) > self.max_value_bytes:
            self._value(key, payload)
        if key not in job.kv:
            self._room(job, 1, key)
        self._put(job, key, _own(payload))
        self._reply(conn, req_id, "set", self._started)

    def _op_get(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        key = h.get("key")
        if type(key) is not str or not 0 < len(key) <= _SURELY_SHORT_KEY:
            key = self._key(h)  # the full check, and its error
        value = conn.job.kv.get(key)
        if value is not None:
            self._reply(conn, req_id, "get", self._started, None, value)
            return
        self._park(conn, req_id, "get", [key], [key], self._timeout(h))

    def _op_add(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        key = h.get("key")
        if type(key) is not str or not 0 < len(key) <= _SURELY_SHORT_KEY:
            key = self._key(h)  # the full check, and its error
        amount = h.get("amount")
        if type(amount) is not int:
            raise _Refused(
                ERR_INVALID,
                f"'amount' for key {key!r} must be an integer, got {type(amount).__name__}",
                [key],
            )
        job = conn.job
        old = job.kv.get(key)
        if old is None:
            self._room(job, 1, key)
            current = 0
        else:
            try:
                # int() of ASCII bytes accepts what int() of their text does; any other byte
                # fails as decoding would
                current = int(old)
            except ValueError:
                raise _Refused(
                    ERR_INVALID,
                    f"key {key!r} holds a value that is not an integer "
                    f"({bytes(old[:32])!r}), so add cannot increment it",
                    [key],
                ) from None
        value = current + amount
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Refused(
                ERR_INVALID, f"add would take key {key!r} to {value}, outside the 64-bit range", [key]
            )
        self._put(job, key, str(value).encode("ascii"))
        self._reply(conn, req_id, "add", self._started, {"id": req_id, "ok": True, "value": value})

    def _op_cas(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        key = self._key(h)
        sizes = h.get("sizes")
        if not (
            isinstance(sizes, list)
            and len(sizes) == 2
            and all(type(s) is int and s >= 0 for s in sizes)
            and sum(sizes) == len(payload)
        ):
            raise _Refused(
                ERR_INVALID,
                f"cas on key {key!r} needs 'sizes' = [len(expected), len(desired)] "
                f"adding up to the payload's {len(payload)} bytes",
                [key],
            )
        expected, desired = bytes(payload[: sizes[0]]), bytes(payload[sizes[0] :])
        self._value(key, desired)
        job = conn.job
        current = job.kv.get(key)
        if current is None:
            if expected:
                result: bytes | bytearray = expected
            else:
                self._room(job, 1, key)
                self._put(job, key, desired)
                result = desired
        elif current == expected:
            self._put(job, key, desired)
            result = desired
        else:
            result = current
        self._reply(conn, req_id, "cas", self._started, None, result)

    def _op_wait(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        keys = self._keys(h)
        timeout = self._timeout(h)
        missing = [k for k in keys if k not in conn.job.kv]
        if not missing:
            self._reply(conn, req_id, "wait", self._started)
            return
        self._park(conn, req_id, "wait", keys, missing, timeout)

    def _op_mget(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        keys = self._keys(h)
        timeout = self._timeout(h)
        kv = conn.job.kv
        missing = [k for k in keys if k not in kv]
        if not missing:
            values = [kv[k] for k in keys]
            self._reply(
                conn,
                req_id,
                "mget",
                self._started,
                {"id": req_id, "ok": True, "sizes": [len(v) for v in values]},
                b"".join(values),
            )
            return
        self._park(conn, req_id, "mget", keys, missing, timeout)

    def _op_check(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        keys = self._keys(h)
        kv = conn.job.kv
        self._reply(
            conn,
            req_id,
            "check",
            self._started,
            {"id": req_id, "ok": True, "value": all(k in kv for k in keys)},
        )

    def _op_del(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        key = self._key(h)
        job = conn.job
        existed = key in job.kv
        if existed:
            self._delete(job, key)
        self._reply(conn, req_id, "del", self._started, {"id": req_id, "ok": True, "value": existed})

    def _delete(self, job: _Job, key: str) -> None:
        del job.kv[key]
        if self.durable:
            self.journal.append(["del", job.name, key])

    def _op_nkeys(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        self._reply(
            conn, req_id, "nkeys", self._started, {"id": req_id, "ok": True, "value": len(conn.job.kv)}
        )

    def _op_mset(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        keys = self._keys(h)
        sizes = h.get("sizes")
        if not (
            isinstance(sizes, list)
            and len(sizes) == len(keys)
            and all(type(s) is int and s >= 0 for s in sizes)
            and sum(sizes) == len(payload)
        ):
            raise _Refused(
                ERR_INVALID,
                f"mset needs one size per key ({len(keys)} keys) adding up to the "
                f"payload's {len(payload)} bytes",
                keys[:16],
            )
        job = conn.job
        for k, s in zip(keys, sizes, strict=True):
            if s > self.max_value_bytes:
                raise _Refused(
                    ERR_TOO_LARGE,
                    f"value of {s} bytes for key {k[:256]!r} exceeds the "
                    f"coordinator's limit of {self.max_value_bytes} bytes (--max-value-bytes)",
                    [k],
                )
        self._room(job, len({k for k in keys if k not in job.kv}), keys[0] if keys else "")
        pos = 0
        for k, s in zip(keys, sizes, strict=True):
            self._put(job, k, bytes(payload[pos : pos + s]))
            pos += s
        self._reply(conn, req_id, "mset", self._started)

    def _op_append(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        key = self._key(h)
        job = conn.job
        old = job.kv.get(key)
        if old is None:
            self._room(job, 1, key)
            size = len(payload)
        else:
            size = len(old) + len(payload)
        if size > self.max_value_bytes:
            raise _Refused(
                ERR_TOO_LARGE,
                f"append would make key {key!r} {size} bytes, above the "
                f"coordinator's limit of {self.max_value_bytes} bytes",
                [key],
            )
        data = bytes(payload)
        self._append(job, key, data)
        self._reply(conn, req_id, "append", self._started)

    def _append(self, job: _Job, key: str, data: bytes) -> None:
        old = job.kv.get(key)
        job.kv[key] = data if old is None else bytes(old) + data  # never mutate: a reply may hold it
        if self.durable:
            self.journal.append(["append", job.name, key, data])
        if key in job.waiters:
            self._wake(job, key)

    def _op_hb(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        member = conn.member or conn.beat_of
        if member is not None:
            member.last_seen = conn.last_seen
            if conn.beat_of is not None and member.rank in conn.job.progress.wanted:
                self._reply(conn, req_id, "hb", self._started, {"id": req_id, "ok": True, "want": True})
                return
        self._reply(conn, req_id, "hb", self._started)

    def _op_progress(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        member = conn.member or conn.beat_of
        if member is None or member.state != "alive":
            raise _Refused(
                ERR_INVALID, "progress: only an alive member of a completed round reports progress"
            )
        member.last_seen = conn.last_seen
        job = conn.job
        try:
            verdicts = job.progress.update(member.rank, h, self._started, self.wall_clock())
        except ProgressError as exc:
            raise _Refused(ERR_INVALID, f"progress from rank {member.rank}: {exc}") from None
        self._reply(conn, req_id, "progress", self._started)
        self._announce(job, verdicts)

    def _announce(self, job: _Job, verdicts: list[Verdict]) -> None:
        """Tell every member of the group what the cross-check found (EV_MISMATCH, EV_BEHIND)."""
        rnd = job.round
        if rnd is None:
            return
        for v in verdicts:
            log.warning(
                "job=%s event=%s group=%s seq=%d ranks=%s %s",
                job.name,
                v.kind,
                v.group,
                v.seq,
                list(v.ranks),
                v.message,
            )
            event = {
                "ev": EV_MISMATCH if v.kind == "mismatch" else EV_BEHIND,
                "group": v.group,
                "seq": v.seq,
                "ranks": list(v.ranks),
                "msg": v.message,
            }
            for rank in v.members:
                m = rnd.members.get(rank)
                if m is not None and m.state == "alive" and m.conn is not None:
                    self.outbox.append((m.conn.id, event, b""))

    def _op_status(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        job = h.get("job")
        if job is not None and type(job) is not str:
            raise _Refused(ERR_INVALID, f"'job' must be a string or None, got {type(job).__name__}")
        self._reply(
            conn, req_id, "status", self._started, {"id": req_id, "ok": True, "jobs": self.status(job)}
        )

    # ------------------------------------------------------------------ rendezvous
    def _op_join(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        job = conn.job
        rank, world_size, addrs, host = (
            h.get("rank"),
            h.get("world_size"),
            h.get("addrs", []),
            h.get("host", ""),
        )
        who = f"job {job.name!r}, rank {rank}"
        if rank is not None and type(rank) is not int:
            raise _Refused(ERR_INVALID, f"{who}: 'rank' must be an integer or None")
        if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise _Refused(
                ERR_INVALID,
                f"{who}: 'world_size' must be an integer in 1..{MAX_WORLD_SIZE}, got {world_size!r}",
            )
        if not (
            isinstance(addrs, list)
            and len(addrs) <= MAX_ADDRS
            and all(
                isinstance(a, list)
                and len(a) == 2
                and type(a[0]) is str
                and len(a[0]) <= MAX_HOST_CHARS
                and type(a[1]) is int
                and 0 <= a[1] <= 65535
                for a in addrs
            )
        ):
            raise _Refused(
                ERR_INVALID, f"{who}: 'addrs' must be a list of at most {MAX_ADDRS} [host, port] pairs"
            )
        if type(host) is not str or len(host) > MAX_HOST_CHARS:
            raise _Refused(
                ERR_INVALID, f"{who}: 'host' must be a string of at most {MAX_HOST_CHARS} characters"
            )
        timeout = self._timeout(h)
        already = conn.joining or conn.member
        if already is not None:
            raise _Refused(
                ERR_RENDEZVOUS,
                f"{who}: this connection already joined round {already.round.number}; one join per session",
            )
        rnd = job.round
        if rnd is not None and rnd.complete:
            if not rnd.broken:
                raise _Refused(
                    ERR_RENDEZVOUS,
                    f"{who}: round {rnd.number} of job {job.name!r} is complete "
                    f"with world size {rnd.world_size} and all its members are alive; a new "
                    f"round opens only after a member leaves or is lost (or use another job id)",
                )
            rnd = None
        if rnd is None:
            rnd = self._open_round(job, world_size)
        elif rnd.world_size != world_size:
            why = (
                f"{who} asked for world size {world_size}, but round "
                f"{rnd.number} of job {job.name!r} was opened with world size {rnd.world_size} "
                f"(ranks {sorted(rnd.members)} already joined); every rank must pass the same "
                f"world size"
            )
            self._refuse_join(rnd, conn, req_id, why)
            return
        if rank is None:
            # Every rank below free_hint is taken, so assignment is O(1) amortised (10,000 joins
            # must not scan 10,000 ranks each).
            rank = rnd.free_hint
            while rank in rnd.members:
                rank += 1
            rnd.free_hint = rank + 1
        elif not 0 <= rank < world_size:
            raise _Refused(
                ERR_RENDEZVOUS,
                f"job {job.name!r}: rank {rank} is out of range for world size "
                f"{world_size} (valid ranks: 0..{world_size - 1})",
            )
        elif rank in rnd.members:
            other = rnd.members[rank]
            why = (
                f"job {job.name!r}: rank {rank} already joined round "
                f"{rnd.number} (world size {world_size}) from host {other.host!r}; two "
                f"processes were given the same rank"
            )
            self._refuse_join(rnd, conn, req_id, why)
            return
        now = self.clock()
        member = _Member(rank, addrs, host, rnd)
        member.conn = conn
        member.req_id = req_id
        member.started = now
        member.timeout = timeout
        member.last_seen = now
        member.table_in_payload = h.get("table_in_payload") is True
        member.table_ref = h.get("table_ref") is True
        conn.joining = member
        rnd.members[rank] = member
        log.debug(
            "job=%s rank=%d event=join round=%d joined=%d/%d",
            job.name,
            rank,
            rnd.number,
            len(rnd.members),
            world_size,
        )
        if len(rnd.members) == world_size:
            self._complete(rnd)
        elif timeout is not None:
            member.deadline = now + timeout
            heapq.heappush(self._timers, (member.deadline, next(self._timer_seq), member))
            self.timers_pushed += 1

    def _open_round(self, job: _Job, world_size: int) -> _Round:
        rnd = _Round(job, job.next_round, world_size)
        job.next_round += 1
        job.round = rnd
        log.info("job=%s event=round_open round=%d world_size=%d", job.name, rnd.number, world_size)
        return rnd

    def _complete(self, rnd: _Round) -> None:
        rnd.complete = True
        rnd.job.progress.reset()
        # Every member gets the same table: encode it once (a 10,000-member table is ~0.5 MB, and
        # encoding it per member would cost seconds).
        members_packed, digest = self._round_table(rnd)
        for m in rnd.members.values():
            m.session = os.urandom(16).hex()
            self._sessions[m.session] = m
        if self.durable:
            self.journal.append(
                [
                    "round",
                    rnd.job.name,
                    rnd.number,
                    rnd.world_size,
                    [[m.rank, m.addrs, m.host, m.session] for m in rnd.members.values()],
                ]
            )
        now = self.clock()
        # "table_digest": bin8 of 16 bytes, appended to a reply header's map (one more entry).
        digest_field = b"".join(msgpack.packb(x, use_bin_type=True) for x in ("table_digest", digest))
        for m in rnd.members.values():
            conn = m.conn
            assert conn is not None
            conn.joining = None
            conn.member = m
            m.state = "alive"
            m.deadline = None
            m.last_seen = now
            self._live_members.add(m)
            head = msgpack.packb(
                {
                    "id": m.req_id,
                    "ok": True,
                    "rank": m.rank,
                    "world_size": rnd.world_size,
                    "round": rnd.number,
                    "session": m.session,
                },
                use_bin_type=True,
            )
            if m.table_ref:
                # The client may hold this table already (another session of its process got it):
                # it fetches it with the ``table`` operation only when its digest is new to it.
                ref = msgpack.packb(
                    {"table_digest": digest, "table_size": len(members_packed)}, use_bin_type=True
                )
                # Two fixmaps (6 and 2 entries) merged into one of 8: 0x88.
                self._reply(conn, m.req_id, "join", m.started, EncodedHeader((b"\x88" + head[1:], ref[1:])))
            elif m.table_in_payload:
                # The client asked for the table as a payload (msgpack) it may decode lazily; its
                # digest rides along, so the client need not hash the table to share it.
                header = EncodedHeader((b"\x87" + head[1:], digest_field))
                self._reply(conn, m.req_id, "join", m.started, header, members_packed)
            else:
                # A fixmap of 6 entries (0x86) becomes one of 7 with "members" appended.
                header = EncodedHeader((b"\x87" + head[1:], _MEMBERS_KEY, members_packed))
                self._reply(conn, m.req_id, "join", m.started, header)
        log.info(
            "job=%s event=round_complete round=%d world_size=%d", rnd.job.name, rnd.number, rnd.world_size
        )

    @staticmethod
    def _round_table(rnd: _Round) -> tuple[bytes, bytes]:
        """The round's member table (msgpack, sorted by rank) and its digest, encoded once."""
        if rnd.table is None:
            rnd.table = msgpack.packb(
                [
                    {"rank": m.rank, "addrs": m.addrs, "host": m.host}
                    for m in sorted(rnd.members.values(), key=lambda m: m.rank)
                ],
                use_bin_type=True,
            )
            rnd.table_digest = hashlib.blake2b(rnd.table, digest_size=16).digest()
        return rnd.table, rnd.table_digest

    def _op_table(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        number = h.get("round")
        if type(number) is not int:
            raise _Refused(ERR_INVALID, f"'round' must be an integer, got {type(number).__name__}")
        job = conn.job
        rnd = job.round
        if rnd is None or not rnd.complete or rnd.number != number:
            current = "no completed round" if rnd is None or not rnd.complete else f"round {rnd.number}"
            raise _Refused(
                ERR_RENDEZVOUS,
                f"job {job.name!r} has {current}, not round {number}: its member table is gone "
                f"(a newer round replaced it); join again",
            )
        table, digest = self._round_table(rnd)
        self._reply(
            conn, req_id, "table", self._started, {"id": req_id, "ok": True, "table_digest": digest}, table
        )

    def _refuse_join(self, rnd: _Round, refused: _Conn, req_id: int, why: str) -> None:
        """Refuse a join that contradicts ``rnd``; the members already waiting there hear it at
        once (the round cannot complete as the ranks were configured) instead of waiting out
        their timeout. (Not a _Refused: that would take back the other members' replies.)"""
        self.outbox.append((refused.id, _err(req_id, ERR_RENDEZVOUS, f"join: {why}"), b""))
        self._observe("join", self._started, False)
        for m in list(rnd.members.values()):
            conn = m.conn
            if m.state != "joining" or conn is None:
                continue
            self._drop_joining(m, "another join was refused")
            self.outbox.append(
                (
                    conn.id,
                    _err(
                        m.req_id,
                        ERR_RENDEZVOUS,
                        f"join: rank {m.rank} of job {rnd.job.name!r}: the rendezvous of round "
                        f"{rnd.number} failed because the coordinator refused a join from "
                        f"{refused.peer or 'another process'}: {why}. Fix the launch configuration "
                        f"and start every rank again",
                    ),
                    b"",
                )
            )
            self._observe("join", m.started, False)

    def _drop_joining(self, member: _Member, why: str) -> None:
        """Take a not-yet-complete join out of its round (its rank becomes free again)."""
        rnd = member.round
        if rnd.members.get(member.rank) is member:
            del rnd.members[member.rank]
            rnd.free_hint = min(rnd.free_hint, member.rank)
        if member.conn is not None and member.conn.joining is member:
            member.conn.joining = None
        member.state = "lost"
        member.deadline = None
        log.info(
            "job=%s rank=%d event=join_dropped round=%d reason=%s", rnd.job.name, member.rank, rnd.number, why
        )

    def _op_leave(self, conn: _Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        if conn.joining is not None:
            m = conn.joining
            self._drop_joining(m, "left before the round completed")
            self.outbox.append(
                (
                    conn.id,
                    _err(
                        m.req_id,
                        ERR_RENDEZVOUS,
                        f"join: rank {m.rank} of job "
                        f"{conn.job.name!r} left before round {m.round.number} completed",
                    ),
                    b"",
                )
            )
        member = conn.member
        if member is not None:
            conn.member = None
            self._gone(member, "left", "left")
            log.info(
                "job=%s rank=%d event=member_left round=%d", conn.job.name, member.rank, member.round.number
            )
        self._reply(conn, req_id, "leave", self._started)

    def _gone(self, member: _Member, state: str, reason: str) -> None:
        member.state = state
        member.reason = reason
        member.conn = None
        beat, member.beat = member.beat, None
        if beat is not None:
            beat.beat_of = None
            if state == "lost":  # a member that left stops its own beats
                self.closes.append((beat.id, f"rank {member.rank} is lost"))
        member.round.job.progress.forget(member.rank)
        self._live_members.discard(member)
        self._sessions.pop(member.session, None)
        rnd = member.round
        if rnd.complete:
            rnd.broken = True
        if self.durable:
            self.journal.append(["gone", rnd.job.name, rnd.number, member.rank, state, reason])

    def _lose(self, member: _Member, reason: str) -> None:
        if member.state not in ("alive", "resuming"):
            return
        conn = member.conn
        if conn is not None:
            conn.member = None
        self._gone(member, "lost", reason)
        rnd = member.round
        log.warning(
            "job=%s rank=%d event=member_lost round=%d reason=%s",
            rnd.job.name,
            member.rank,
            rnd.number,
            reason,
        )
        event = {"ev": EV_MEMBER_LOST, "rank": member.rank, "reason": reason, "round": rnd.number}
        for other in rnd.members.values():
            if other is not member and other.state == "alive" and other.conn is not None:
                self.outbox.append((other.conn.id, event, b""))

    # ------------------------------------------------------------------ time
    def next_deadline(self) -> float:
        """The clock value at which ``tick`` next has work (a waiter's deadline or housekeeping)."""
        nxt = self._next_housekeeping
        timers = self._timers
        while timers and (
            timers[0][2].done if isinstance(timers[0][2], _Waiter) else timers[0][2].state != "joining"
        ):
            heapq.heappop(timers)
        if timers and timers[0][0] < nxt:
            nxt = timers[0][0]
        return nxt

    def tick(self) -> None:
        """Expire waits and joins whose deadline passed; every second, check liveness and job expiry."""
        now = self.clock()
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, item = heapq.heappop(timers)
            if isinstance(item, _Waiter):
                if not item.done:
                    self._expire_waiter(item)
            elif item.state == "joining":
                self._expire_join(item)
        if now >= self._next_housekeeping:
            # Silence is measured in time the coordinator could listen. When its own loop stalled
            # (an embedded coordinator in a rank busy importing torch, a paused VM), the members'
            # heartbeats wait unread in socket buffers; credit them the stall instead of
            # declaring everyone lost on waking.
            stalled = now - self._last_housekeeping - HOUSEKEEPING_INTERVAL
            if stalled > self.heartbeat_timeout / 2:
                self._credit_stall(stalled)
            self._last_housekeeping = now
            self._next_housekeeping = now + HOUSEKEEPING_INTERVAL
            self._housekeeping(now)

    def _expire_waiter(self, w: _Waiter) -> None:
        conn = w.conn
        job = conn.job
        missing = [k for k in w.keys if k not in job.kv]
        if not missing:  # raced: complete instead of failing
            self._finish_waiter(w)
            return
        w.done = True
        conn.waiters.discard(w)
        for k in w.keys:
            ws = job.waiters.get(k)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del job.waiters[k]
        self.outbox.append(
            (
                conn.id,
                _err(
                    w.req_id,
                    ERR_TIMEOUT,
                    f"{w.op}: timed out after "
                    f"{_fmt_timeout(w.timeout)} waiting for key(s) {missing[:16]!r} of job "
                    f"{job.name!r}",
                    missing,
                ),
                b"",
            )
        )
        self._observe(w.op, w.started, False)

    def _expire_join(self, m: _Member) -> None:
        rnd = m.round
        present = sorted(r for r, x in rnd.members.items() if x is not m)
        absent = [r for r in range(rnd.world_size) if r not in rnd.members][:32]
        conn = m.conn
        self._drop_joining(m, "rendezvous timed out")
        if conn is not None:
            self.outbox.append(
                (
                    conn.id,
                    _err(
                        m.req_id,
                        ERR_RENDEZVOUS,
                        f"join: rendezvous of job {rnd.job.name!r} round {rnd.number} timed out "
                        f"after {_fmt_timeout(m.timeout)} for rank {m.rank}: {len(present) + 1} of "
                        f"{rnd.world_size} ranks had joined; missing ranks {absent} (not all "
                        f"processes started, or they were given another world size or job)",
                    ),
                    b"",
                )
            )
            self._observe("join", m.started, False)

    def _credit_stall(self, seconds: float) -> None:
        for m in self._live_members:
            if m.state == "alive" and m.conn is not None:
                m.conn.last_seen += seconds
                if m.beat is not None:
                    m.beat.last_seen += seconds
        log.warning("event=coordinator_stalled seconds=%.1f liveness clocks credited", seconds)

    def _housekeeping(self, now: float) -> None:
        limit = self.heartbeat_timeout
        for m in list(self._live_members):
            if m.state == "alive":
                conn = m.conn
                seen = self._heard(m)
                if now - seen > limit:
                    self._lose(m, f"silent for {now - seen:.1f}s (heartbeat timeout {limit:g}s)")
                    if conn is not None:
                        self.closes.append(
                            (conn.id, f"rank {m.rank} of job {m.round.job.name!r} went silent")
                        )
            elif m.state == "resuming" and now - m.last_seen > self.resume_grace:
                self._lose(
                    m, f"did not reconnect within {self.resume_grace:g}s after the coordinator restarted"
                )
        for job in self.jobs.values():
            if job.progress.waiting:
                self._announce(job, job.progress.recheck(now))
        if now >= self._next_client_sweep:
            self._next_client_sweep = now + CLIENT_SWEEP_INTERVAL
            ttl = self.client_ttl
            for job in self.jobs.values():
                gone = [c for c, cl in job.clients.items() if cl.attached <= 0 and now - cl.last_seen > ttl]
                for cid in gone:
                    del job.clients[cid]
        for name, job in list(self.jobs.items()):
            if job.conns or now - job.last_activity <= self.job_ttl:
                continue
            if job.round is not None and any(m.state == "resuming" for m in job.round.members.values()):
                continue
            self._drop_job(job)
            log.info("job=%s event=job_expired idle_for=%.0fs", name, now - job.last_activity)

    @staticmethod
    def _heard(m: _Member) -> float:
        """When an alive member was last heard from, on its main or its beat connection."""
        seen = m.conn.last_seen if m.conn is not None else m.last_seen
        if m.beat is not None and m.beat.last_seen > seen:
            seen = m.beat.last_seen
        return seen

    def _drop_job(self, job: _Job) -> None:
        del self.jobs[job.name]
        if job.round is not None:
            for m in job.round.members.values():
                self._sessions.pop(m.session, None)
                self._live_members.discard(m)
        if self.durable:
            self.journal.append(["drop", job.name])

    def _job(self, name: str, now: float) -> _Job:
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = _Job(name, now)
        return job

    # ------------------------------------------------------------------ views
    def status(self, job: str | None = None) -> list[dict[str, Any]]:
        """What the ``status`` op, /jobs and `aiocoll status` show: one entry per job.

        ``last_seen`` is seconds since the member was last heard from (None if never).
        """
        now = self.clock()
        wall = self.wall_clock()
        out = []
        names = sorted(self.jobs) if job is None else ([job] if job in self.jobs else [])
        for name in names:
            j = self.jobs[name]
            rnd = j.round
            members = []
            if rnd is not None:
                for m in sorted(rnd.members.values(), key=lambda m: m.rank):
                    seen = self._heard(m) if m.state == "alive" else m.last_seen
                    members.append(
                        {
                            "rank": m.rank,
                            "host": m.host,
                            "alive": m.state == "alive",
                            "state": m.state,
                            "last_seen": round(now - seen, 3),
                            "reason": m.reason,
                            "progress": j.progress.progress_of(m.rank, now, wall),
                        }
                    )
            alive = [m.rank for m in rnd.members.values() if m.state == "alive"] if rnd else []
            held, summary = j.progress.held_back_by(alive)
            out.append(
                {
                    "job": name,
                    "world_size": rnd.world_size if rnd else None,
                    "round": rnd.number if rnd else None,
                    "complete": bool(rnd and rnd.complete),
                    "keys": len(j.kv),
                    "connections": len(j.conns),
                    "members": members,
                    "held_back_by": held,
                    "summary": summary,
                    "progress_reports": j.progress.reports_received,
                }
            )
        return out

    def member_count(self) -> int:
        return len(self._live_members)

    # ------------------------------------------------------------------ durability
    def take_journal(self) -> list[Record]:
        records, self.journal = self.journal, []
        return records

    def snapshot(self) -> dict[str, Any]:
        """The whole durable state as plain msgpack-able data (keys, rounds, members)."""
        jobs = []
        for j in self.jobs.values():
            rnd = j.round
            rd = None
            if rnd is not None and rnd.complete:
                rd = {
                    "number": rnd.number,
                    "world_size": rnd.world_size,
                    "broken": rnd.broken,
                    "members": [
                        [
                            m.rank,
                            m.addrs,
                            m.host,
                            m.session,
                            "alive" if m.state == "resuming" else m.state,
                            m.reason,
                        ]
                        for m in rnd.members.values()
                    ],
                }
            clients = [
                [cid, c.floor, [[rid, h, p] for rid, (h, p) in c.replies.items()]]
                for cid, c in j.clients.items()
                if c.replies
            ]
            jobs.append(
                {"name": j.name, "kv": j.kv, "next_round": j.next_round, "round": rd, "clients": clients}
            )
        return {"format": 1, "jobs": jobs}

    def restore(self, snap: dict[str, Any] | None, records: list[Record]) -> None:
        """Rebuild from a snapshot plus the journal records after it; members start ``resuming``.

        Must be called on a fresh state, before any connection.
        """
        now = self.clock()
        durable, self.durable = self.durable, False  # replay must not re-journal
        try:
            for jd in (snap or {}).get("jobs", []):
                job = self._job(jd["name"], now)
                job.kv.update(jd["kv"])
                job.next_round = jd["next_round"]
                rd = jd["round"]
                if rd is not None:
                    self._restore_round(job, rd["number"], rd["world_size"], rd["members"], rd["broken"])
                for cid, floor, replies in jd.get("clients", []):
                    client = job.clients[cid] = _Client(floor, now)
                    for rid, header, payload in replies:
                        client.replies[rid] = (header, payload)
            for rec in records:
                self.apply_record(rec)
        finally:
            self.durable = durable
        for m in self._sessions.values():
            m.state = "resuming"
            m.last_seen = now
            self._live_members.add(m)

    def _restore_round(
        self, job: _Job, number: int, world_size: int, members: list[list[Any]], broken: bool
    ) -> None:
        rnd = _Round(job, number, world_size)
        rnd.complete = True
        rnd.broken = broken
        job.round = rnd
        job.next_round = max(job.next_round, number + 1)
        for entry in members:
            rank, addrs, host, session = entry[:4]
            m = _Member(rank, addrs, host, rnd)
            m.session = session
            m.state = entry[4] if len(entry) > 4 else "alive"
            m.reason = entry[5] if len(entry) > 5 else ""
            rnd.members[rank] = m
            if m.state == "alive":
                self._sessions[session] = m

    def apply_record(self, rec: Record) -> None:
        """Replay one journal record (as written by a live mutation)."""
        kind, name = rec[0], rec[1]
        now = self.clock()
        if kind == "drop":
            job = self.jobs.get(name)
            if job is not None:
                self._drop_job(job)
            return
        job = self._job(name, now)
        if kind == "set":
            job.kv[rec[2]] = rec[3]
        elif kind == "del":
            job.kv.pop(rec[2], None)
        elif kind == "append":
            old = job.kv.get(rec[2])
            job.kv[rec[2]] = rec[3] if old is None else bytes(old) + rec[3]
        elif kind == "round":
            if job.round is not None:
                for m in job.round.members.values():
                    self._sessions.pop(m.session, None)
            self._restore_round(job, rec[2], rec[3], rec[4], False)
        elif kind == "req":
            _, _, cid, rid, ack, header, payload, records = rec
            for sub in records:
                self.apply_record(sub)
            client = job.clients.get(cid)
            if client is None:
                client = job.clients[cid] = _Client(0, now)
            client.forget_through(ack)
            client.replies[rid] = (header, payload)
        elif kind == "gone":
            rnd = job.round
            if rnd is not None and rnd.number == rec[2] and rec[3] in rnd.members:
                m = rnd.members[rec[3]]
                m.state, m.reason = rec[4], rec[5]
                self._sessions.pop(m.session, None)
                rnd.broken = True
        else:
            raise ValueError(f"unknown journal record kind {kind!r}")
