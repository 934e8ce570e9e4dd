"""The coordinator state's shared vocabulary: connections, jobs, member and round states, what a
refused request is, and ``Effects``, where every part of the state puts what it decided (frames
to send, connections to close, journal records, deadlines). Pure data and bookkeeping: imports
aiocoll foundations (the protocol schema, the progress cross-check) only, and no other server
module, so that every part of the state (_kv, _rendezvous, _liveness, _dedupe, _progress_part)
can import it without importing each other.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

import msgpack

from aiocoll._progress_check import JobProgress
from aiocoll.protocol._coordinator import (
    ERR_INVALID,
    ERR_TOO_LARGE,
    MAX_KEY_BYTES,
    OPS,
    ROLE_ADMIN,
    ROLE_BEAT,
    ROLE_STORE,
    ROLE_WORKER,
)
from aiocoll.protocol._store import ERROR

from ._events import JobEvents

__all__ = [
    "ROLE_OPS",
    "Conn",
    "Effects",
    "EncodedHeader",
    "Job",
    "MemberState",
    "Record",
    "Refused",
    "Send",
    "DONE",
    "PARKED",
    "Answer",
    "StoreHandler",
    "fmt_timeout",
    "key_field",
    "timeout_field",
]

# A store operation's outcome (server/_kv.py): (value or None, payload) to send as its reply,
# DONE (applied; SET, APPEND and MSET send nothing then), or PARKED (answered when its keys come).
DONE: Any = ("done",)
PARKED: Any = None
Answer = Any
StoreHandler = Callable[["Conn", int, list[Any], "bytes | bytearray"], Any]

# (connection id, reply or event header, payload); a large shared header comes pre-encoded.
Send = tuple[int, "dict[str, Any] | list[Any] | EncodedHeader", "bytes | bytearray | memoryview"]
Record = list[Any]

# What each role may ask: admin connections (`aiocoll status`) only read.
READ_OPS = frozenset({"get", "wait", "check", "nkeys", "mget", "hb", "status", "table", "sync", "stacks"})
ROLE_OPS: dict[str, frozenset[str]] = {
    ROLE_WORKER: OPS,
    ROLE_STORE: OPS - {"join", "leave"},
    ROLE_ADMIN: READ_OPS,
    ROLE_BEAT: frozenset({"hb", "progress", "stack"}),
}


class MemberState(enum.Enum):
    """Where a member of a rendezvous round stands. The values are what the journal, snapshots
    and ``status`` write, so they never change."""

    JOINING = "joining"  # its join waits for the round to fill
    ALIVE = "alive"  # the round completed; it is heard from
    RESUMING = "resuming"  # restored after a coordinator restart; may re-attach within the grace
    LEFT = "left"  # said goodbye
    LOST = "lost"  # its connection closed without goodbye, it went silent, or never came back


# The only moves a member makes (h11's way: one table, checked in one place). Tuples, looked up
# by identity: an Enum's hash is a Python call, and a round of 100,000 members makes every move.
_MOVES: dict[str, tuple[MemberState, ...]] = {
    MemberState.JOINING.value: (MemberState.ALIVE, MemberState.LOST),
    # RESUMING only by a restore: a coordinator restart.
    MemberState.ALIVE.value: (MemberState.LEFT, MemberState.LOST, MemberState.RESUMING),
    MemberState.RESUMING.value: (MemberState.ALIVE, MemberState.LOST),
    MemberState.LEFT.value: (),
    MemberState.LOST.value: (),
}


def can_move(old: MemberState, new: MemberState) -> bool:
    """Whether a member in state ``old`` may move to ``new``."""
    return new in _MOVES[old._value_]


class Refused(Exception):
    """A well-formed request the coordinator will not carry out; becomes an error reply."""

    def __init__(self, err: str, msg: str, keys: list[str] | None = None) -> None:
        super().__init__(msg)
        self.err = err
        self.msg = msg
        self.keys = keys or []


class EncodedHeader:
    """A reply header already encoded as msgpack, in parts; the shell writes the parts as they are.

    Used where many recipients share most of a large header (the rendezvous membership table).
    """

    __slots__ = ("parts", "size")

    def __init__(self, parts: tuple[bytes, ...]) -> None:
        self.parts = parts
        self.size = sum(map(len, parts))

    def decode(self) -> dict[str, Any]:
        header: dict[str, Any] = msgpack.unpackb(b"".join(self.parts), raw=False, strict_map_key=False)
        return header


class Conn:
    """One authenticated connection, as the state sees it (the shell owns the socket)."""

    __slots__ = (
        "allowed",
        "beat_of",
        "cid",
        "client",
        "id",
        "job",
        "joining",
        "last_seen",
        "members",
        "peer",
        "role",
        "waiters",
    )

    def __init__(self, conn_id: int, job: Job, role: str, peer: str, now: float) -> None:
        self.cid: bytes | None = None
        self.client: Any = None  # _dedupe: what is remembered of the client ``cid`` names
        self.id = conn_id
        self.job = job
        self.role = role
        self.allowed = ROLE_OPS.get(role, OPS)  # the operations this role may ask
        self.peer = peer
        self.members: list[Any] = []  # the rendezvous members it joined or resumed as
        self.beat_of: Any = None  # a beat connection: the member it keeps alive
        self.joining: Any = None  # its join, waiting for the round to complete
        self.waiters: set[Any] = set()  # the key-value part's waits parked on this connection
        self.last_seen = now


class Job:
    """One job: its connections, and each part's data (each part reads and writes only its own)."""

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
        self.conns: set[Conn] = set()
        self.last_activity = now
        self.kv: dict[str, bytes | bytearray] = {}  # _kv
        self.waiters: dict[str, set[Any]] = {}  # _kv: parked waits by the key they wait for
        self.clients: dict[bytes, Any] = {}  # _dedupe: replies kept per client id
        self.round: Any = None  # _rendezvous: the current round
        self.next_round = 0  # _rendezvous
        self.progress = JobProgress()  # _progress_part


def fmt_timeout(timeout: float | None) -> str:
    return "no limit" if timeout is None else f"{timeout:.3g}s"


def timeout_field(value: object, name: str = "timeout") -> float | None:
    """A request's ``timeout`` (or the field ``name``): None (no limit) or non-negative seconds.

    Raises:
        Refused: for anything else, naming the field.
    """
    if value is None:
        return None
    if type(value) not in (int, float):
        raise Refused(ERR_INVALID, f"{name!r} must be None or a non-negative number, got {value!r}")
    seconds = float(value)  # type: ignore[arg-type]
    if math.isnan(seconds) or seconds < 0:
        raise Refused(ERR_INVALID, f"{name!r} must be None or a non-negative number, got {value!r}")
    return None if math.isinf(seconds) else seconds


def key_field(key: object, field: str = "key") -> str:
    """A request's key: a str of 1..MAX_KEY_BYTES UTF-8 bytes.

    Raises:
        Refused: naming the key.
    """
    if type(key) is not str:
        raise Refused(ERR_INVALID, f"{field!r} must be a string, got {type(key).__name__}")
    n = len(key)
    if n == 0 or (n * 4 > MAX_KEY_BYTES and len(key.encode("utf-8")) > MAX_KEY_BYTES):
        raise Refused(
            ERR_TOO_LARGE if n else ERR_INVALID,
            f"key {key[:64]!r} must be 1..{MAX_KEY_BYTES} UTF-8 bytes",
            [key[:256]],
        )
    return key


# A timer's item: ``waiting`` says whether it still needs its deadline (a wait not yet answered,
# a join not yet complete); the callback pushed with it runs when the deadline passes.
Expire = Callable[[Any], None]


class Effects:
    """What the state decided, for the shell to carry out, and the clocks it decides by.

    ``outbox`` (frames to send, per connection, in order), ``closes`` (connections to drop, with
    a reason), ``journal`` (records of acknowledged mutations, when ``durable``) and the deadline
    heap that ``tick`` works through. The dispatcher (CoordinatorState) is an Effects; every part
    is handed it.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] | None,
        durable: bool,
        observe: Callable[[str, float, bool], None] | None,
    ) -> None:
        self.clock = clock
        # Seconds since 1970, for the "since" of progress reports (``status``); default: clock.
        self.wall_clock = wall_clock or clock
        # Each job's recent events, for the page and /jobs (recorded by the parts that decide).
        self.events = JobEvents(self.wall_clock)
        self.durable = durable
        self.observe = observe
        self.outbox: list[Send] = []
        self.closes: list[tuple[int, str]] = []
        self.journal: list[Record] = []
        self.started = 0.0  # clock value when the request being handled arrived
        # (clock value, why) of the last time the shell refused connections for lack of capacity.
        self.capacity_note: tuple[float, str] | None = None
        self._timers: list[tuple[float, int, Any, Expire]] = []
        self._timer_seq = itertools.count()
        # Grows with every deadline pushed: a shell whose timer is armed and that saw the same
        # count need not ask next_deadline again (nothing earlier can have appeared).
        self.timers_pushed = 0

    def reply(
        self,
        conn: Conn,
        req_id: int,
        op: str,
        started: float,
        header: dict[str, Any] | list[Any] | EncodedHeader | None = None,
        payload: bytes | bytearray | memoryview = b"",
    ) -> None:
        """Answer request ``req_id`` (plain ok when no header is given) and count it."""
        self.outbox.append((conn.id, header if header is not None else {"id": req_id, "ok": True}, payload))
        if self.observe is not None:
            self.observe(op, self.clock() - started, True)

    def fail(
        self,
        conn_id: int,
        req_id: int,
        op: str,
        started: float,
        err: str,
        msg: str,
        keys: list[str] | None = None,
        *,
        compact: bool = False,
    ) -> None:
        """Refuse request ``req_id`` and count it: a map reply, or for a store request
        (``compact``) [id, ERROR, err, msg, keys]."""
        header: dict[str, Any] | list[Any] = (
            [req_id, ERROR, err, msg, keys or []] if compact else error_header(req_id, err, msg, keys)
        )
        self.outbox.append((conn_id, header, b""))
        if self.observe is not None:
            self.observe(op, self.clock() - started, False)

    def push_timer(self, deadline: float, item: Any, expire: Expire) -> None:
        """Call ``expire(item)`` at ``deadline`` unless ``item.waiting`` is false by then."""
        heapq.heappush(self._timers, (deadline, next(self._timer_seq), item, expire))
        self.timers_pushed += 1

    def next_timer(self) -> float:
        """The earliest deadline of an item still waiting (inf when none)."""
        timers = self._timers
        while timers and not timers[0][2].waiting:
            heapq.heappop(timers)
        return timers[0][0] if timers else math.inf

    def run_timers(self, now: float) -> None:
        """Expire every item whose deadline passed and that still waits."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, item, expire = heapq.heappop(timers)
            if item.waiting:
                expire(item)


def error_header(req_id: int, err: str, msg: str, keys: list[str] | None = None) -> dict[str, Any]:
    return {"id": req_id, "ok": False, "err": err, "msg": msg, "keys": keys or []}
