"""The coordinator session: a store client, rendezvous, heartbeats and reconnection.

May import foundations only (protocol, stores, _errors, _deadline); never the public surface.
``CoordinatorSession`` is what a worker (role "worker") and ``aiocoll.connect_store`` (role
"store") use to talk to the coordinator. It is itself an ``aiocoll.Store``.

Reconnection. When the link drops (a coordinator restart, a cut cable) the session reconnects
by itself, with exponential backoff and jitter, for up to ``timeout`` seconds, re-authenticates,
and sends its rendezvous ``session`` id in the hello so the coordinator re-attaches it. Requests
that were pending are sent again on the new link; a waiting request (get, wait, multi_get, join)
resumes with what is left of its own deadline. Every request is re-sent, and none is applied
twice: reads and waits have no effect; join is forgotten by the coordinator when its link drops
(and no unfinished round survives a restart), so joining again is how the rendezvous resumes;
the mutations (set, multi_set, compare_set, add, append, delete_key) carry this session's client
id (hello ``cid``) and a request number (``rid``), and the coordinator answers a number it has
already carried out with the reply it gave the first time, from a memory it journals with the
mutation itself, so this holds across a coordinator restart with --state-dir too. With every
request the session also sends ``ack``, the number below which it holds every reply, so the
coordinator keeps only the replies that may still be asked for again (at most DEDUPE_WINDOW:
the session holds back a mutation that would have more outstanding).

A joined worker that reconnects after its link was cut while the coordinator stayed up is told
``session_lost`` (the coordinator declared it lost when the link closed); its store operations
keep working, only its membership is gone.

Authentication failures and "this is not a coordinator" are not retried: they raise at once,
saying what to do.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime
import functools
import hashlib
import heapq
import logging
import os
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgpack

from aiocoll._deadline import Deadline
from aiocoll._errors import (
    AuthenticationError,
    DistError,
    ProtocolError,
    RendezvousError,
    StoreError,
    StoreTimeout,
)
from aiocoll._net import host_port
from aiocoll.protocol import ClientHandshake
from aiocoll.protocol._coordinator import (
    CID_BYTES,
    DEDUPE_WINDOW,
    ERR_INVALID,
    ERR_RENDEZVOUS,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    EV_MEMBER_LOST,
    EV_REFUSED,
    EV_RESTARTED,
    EV_SESSION_LOST,
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    MUTATING_OPS,
    ROLE_ADMIN,
    ROLE_STORE,
    ROLE_WORKER,
    join_values,
    split_values,
)
from aiocoll.stores import DEFAULT_TIMEOUT, Store
from aiocoll.stores._base import Value, check_amount, check_key, check_keys, to_value

from ._beat import BeatThread, Report
from ._connection import CoordinatorLink, LinkLost, open_link

__all__ = [
    "EV_COORDINATOR_LOST",
    "EV_RECONNECTED",
    "CoordinatorSession",
    "CoordinatorUnreachable",
    "Member",
    "MemberTable",
    "Membership",
]

log = logging.getLogger("aiocoll.client")

# Events the session makes up itself (the coordinator's own are in protocol._coordinator).
EV_RECONNECTED = "reconnected"  # a new link is up after a drop
EV_COORDINATOR_LOST = "coordinator_lost"  # reconnecting ran out of time; "reason" says why

_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0
# One connect + handshake attempt; a paused or black-holed coordinator costs at most this.
_ATTEMPT_TIMEOUT = 10.0
# A waiting request is answered by the coordinator when its timeout runs out; the client's own
# bound comes this much later, so that normally the coordinator's answer (naming keys) wins.
_REPLY_GRACE = 5.0
# Requests that do not wait still get at least this long for their answer.
_MIN_REPLY_TIME = 1.0
# A heartbeat unanswered for this long means the link is dead even if TCP has not noticed.
_HEARTBEAT_REPLY_TIMEOUT = HEARTBEAT_TIMEOUT / 2
_LEAVE_TIMEOUT = 2.0
# A pipelined set gives the event loop a turn once in this many (see ``set``).
_PIPELINE_YIELD_EVERY = 64


class CoordinatorUnreachable(DistError):
    """No coordinator answered at host:port within the timeout (refused, unreachable, silent)."""


@dataclass(frozen=True)
class Member:
    """One member of a rendezvous round: its rank, the addresses its peer listener accepts
    connections on, and its host identity (ranks with equal ``host`` share a machine)."""

    rank: int
    addrs: list[tuple[str, int]]
    host: str


@dataclass(frozen=True)
class Membership:
    """The result of a completed rendezvous.

    Attributes:
        rank, world_size: this member's rank and the round's size.
        round: the job's round number (grows each time the job re-forms).
        session: the id the coordinator gave this member, used to resume after a reconnect.
        members: every member, sorted by rank (an immutable sequence, a MemberTable, shared by
            the sessions of this process that joined the same round and decoded on first use).
    """

    rank: int
    world_size: int
    round: int
    session: str
    members: Sequence[Member] = field(default_factory=tuple)


# Member tables decoded in this process, by digest: sessions of one process that join the same
# round share one immutable table instead of each decoding its own copy (N sessions x N members).
_TABLES_KEPT = 8
_TABLES: collections.OrderedDict[bytes, MemberTable] = collections.OrderedDict()
# Tables being fetched, by (event loop, digest): one ``table`` request per process and round.
_TABLE_FETCHES: dict[tuple[int, bytes], asyncio.Future[MemberTable]] = {}
# Joins in flight, by (event loop, coordinator address, job): the first takes the table inline.
_JOINS_IN_FLIGHT: dict[tuple[int, str, str], int] = {}


def _remember_table(digest: bytes, table: MemberTable) -> MemberTable:
    _TABLES[digest] = table
    _TABLES.move_to_end(digest)
    while len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return table


def _unpack_table(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise ProtocolError(f"the coordinator sent an undecodable member table: {exc}") from exc


def _decode_members(raw: Any) -> tuple[Member, ...]:
    """Members from the wire's list of {rank, addrs, host} maps, sorted by rank."""
    if not isinstance(raw, list):
        raise ProtocolError(f"the coordinator sent a member table of type {type(raw).__name__}")
    # Filled in place of Member.__init__ (a frozen dataclass's __init__ goes through
    # object.__setattr__ per field: half the cost of a 10,000-member table), after the same
    # checks its fields' types would need.
    new = object.__new__
    members = []
    try:
        for m in raw:
            rank, addrs, host = m["rank"], m.get("addrs", ()), m.get("host", "")
            pairs = [(h, p) for h, p in addrs]
            if type(rank) is not int or type(host) is not str:
                raise TypeError(f"entry {m!r:.200}")
            for h, p in pairs:
                if type(h) is not str or type(p) is not int:
                    raise TypeError(f"address in entry {m!r:.200}")
            member = new(Member)
            fields = member.__dict__
            fields["rank"] = rank
            fields["addrs"] = pairs
            fields["host"] = host
            members.append(member)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ProtocolError(f"the coordinator sent a malformed member table: {exc!r}") from exc
    if any(members[i].rank > members[i + 1].rank for i in range(len(members) - 1)):
        members.sort(key=lambda m: m.rank)
    return tuple(members)


class MemberTable(Sequence[Member]):
    """The members of a round, sorted by rank: an immutable sequence of ``Member`` that keeps
    the coordinator's encoding and decodes it on first use (len, index, iteration, equality).

    A join returns as soon as the table's bytes are here, as a TCPStore rendezvous returns
    with its address strings; the Member objects are built once per process and table, when
    someone first looks. A malformed table raises ProtocolError then.
    """

    __slots__ = ("_members", "_raw")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._members: tuple[Member, ...] | None = None

    def _decoded(self) -> tuple[Member, ...]:
        members = self._members
        if members is None:
            members = self._members = _decode_members(_unpack_table(self._raw))
            self._raw = b""
        return members

    @overload
    def __getitem__(self, index: int) -> Member: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Member, ...]: ...
    def __getitem__(self, index: int | slice) -> Member | tuple[Member, ...]:
        return self._decoded()[index]

    def __len__(self) -> int:
        return len(self._decoded())

    def __iter__(self) -> Iterator[Member]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MemberTable):
            return other is self or self._decoded() == other._decoded()
        if isinstance(other, (tuple, list)):
            return list(self._decoded()) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MemberTable({list(self._decoded())!r})"


MemberLostCallback = Callable[[int, str], None]
EventCallback = Callable[[dict[str, Any]], None]


class CoordinatorSession(Store):
    """A client of an aiocoll coordinator for one job; create it with ``await connect(...)``.

    Every store operation takes an optional ``timeout=`` (seconds): for get, multi_get and wait
    how long to wait for the keys, and for every operation how long to keep trying to reach the
    coordinator. The default is the session's ``timeout``.

    Attributes:
        host, port, job, role: where and as what this session is connected.
        membership: the Membership after ``join`` (None before).
        session_lost: None, or why the coordinator no longer counts this member.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | bytes | None = None,
        job: str = "default",
        role: str = ROLE_WORKER,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
        pipeline_sets: bool = False,
    ) -> None:
        super().__init__(timeout)
        if role not in (ROLE_WORKER, ROLE_STORE, ROLE_ADMIN):
            raise ValueError(f"role must be {ROLE_WORKER!r}, {ROLE_STORE!r} or {ROLE_ADMIN!r}, not {role!r}")
        if not isinstance(job, str) or not job:
            raise ValueError(f"job must be a non-empty str, not {job!r}")
        self.host = host
        self.port = int(port)
        self.job = job
        self.role = role
        self._token = token
        self._link: CoordinatorLink | None = None
        self._link_changed = asyncio.Event()
        self._reconnect_task: asyncio.Task[None] | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._beats: BeatThread | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        self._last_request = 0.0
        self._member_lost_callbacks: list[MemberLostCallback] = []
        self._event_callbacks: list[EventCallback] = []
        self.membership: Membership | None = None
        self.session_lost: str | None = None
        self.server_info: dict[str, Any] = {}
        # Exactly-once mutations: our client id, the last request number handed out, and the
        # numbers still waiting for their reply (a lazy min-heap over a set) for ``ack``.
        self._cid = os.urandom(CID_BYTES)
        self._rid = 0
        self._unanswered: set[int] = set()
        self._unanswered_heap: list[int] = []
        self._window_moved = asyncio.Event()
        # Pipelined sets (``pipeline_sets``): written but not yet answered, by request number;
        # those whose link dropped (re-sent, in order, before this session's next request); and
        # the first failure of one, raised by the next operation, ``flush`` or ``aclose``.
        self.pipeline_sets = bool(pipeline_sets)
        self._sets_in_flight: dict[int, tuple[str, bytes, Deadline]] = {}
        self._lost_sets: list[tuple[int, str, bytes, Deadline]] = []
        self._deferred: BaseException | None = None
        self._sets_idle = asyncio.Event()
        self._sets_idle.set()
        self._sets_since_yield = 0

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        token: str | bytes | None = None,
        job: str = "default",
        role: str = ROLE_WORKER,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
        pipeline_sets: bool = False,
    ) -> CoordinatorSession:
        """Connect and authenticate, retrying with backoff while ``timeout`` allows.

        Args:
            host, port: the coordinator's address (use IP literals; no name lookups are made
                beyond what connecting needs). token: the shared secret (None: empty secret).
            job: the job's id; each job has its own keys and ranks. role: ROLE_WORKER (may join
                a rendezvous and keeps heartbeats) or ROLE_STORE (a plain store client).
            timeout: seconds to keep trying, and the default for every operation.
            pipeline_sets: ``set`` returns once its request is written, as torch's TCPStore
                does, instead of after the coordinator's reply; see ``set`` for what is
                promised then (docs/COORDINATOR.md, "Pipelined sets").

        Raises:
            CoordinatorUnreachable: nothing accepted at host:port for the whole timeout.
            AuthenticationError: the coordinator holds another token (not retried).
            ProtocolError: host:port is not an aiocoll coordinator of this version.
        """
        session = cls(
            host, port, token=token, job=job, role=role, timeout=timeout, pipeline_sets=pipeline_sets
        )
        link = await session._connect(Deadline(session.timeout))
        session._link = link
        return session

    # -- callbacks -----------------------------------------------------------------------
    def on_member_lost(self, callback: MemberLostCallback) -> None:
        """Call ``callback(rank, reason)`` when the coordinator reports a member of our round lost."""
        self._member_lost_callbacks.append(callback)

    def on_event(self, callback: EventCallback) -> None:
        """Call ``callback(event)`` for every event: the coordinator's (``member_lost``,
        ``restarted``, ``session_lost``) and the session's own (``reconnected``,
        ``coordinator_lost`` with a ``reason``). Each event is a dict with its name under "ev"."""
        self._event_callbacks.append(callback)

    def _emit(self, event: dict[str, Any]) -> None:
        for callback in list(self._event_callbacks):
            try:
                callback(event)
            except Exception:
                log.exception("job=%s event callback failed on %r", self.job, event)

    def _on_event(self, event: dict[str, Any]) -> None:
        name = event.get("ev")
        if name == EV_MEMBER_LOST:
            rank, reason = event.get("rank"), str(event.get("reason", ""))
            if isinstance(rank, int):
                log.warning(
                    "job=%s rank=%s event=member_lost lost_rank=%d reason=%s",
                    self.job,
                    self._rank,
                    rank,
                    reason,
                )
                for callback in list(self._member_lost_callbacks):
                    try:
                        callback(rank, reason)
                    except Exception:
                        log.exception("job=%s member-lost callback failed for rank %d", self.job, rank)
        elif name == EV_SESSION_LOST:
            self.session_lost = str(event.get("reason", "the coordinator refused to resume the session"))
            log.error("job=%s rank=%s event=session_lost reason=%s", self.job, self._rank, self.session_lost)
            self._stop_heartbeats()
        elif name == EV_REFUSED:
            log.warning(
                "job=%s rank=%s event=join_refused peer=%s reason=%s: the coordinator refused a process "
                "that tried to join this job; if it is one of this job's ranks, give it the same token "
                "(AIOCOLL_TOKEN or --token-file) and start it again, or this rendezvous waits for it "
                "until its timeout",
                self.job,
                self._rank,
                event.get("peer"),
                event.get("reason"),
            )
        elif name == EV_RESTARTED:
            log.info("job=%s rank=%s event=coordinator_restarted", self.job, self._rank)
        self._emit(event)

    @property
    def _rank(self) -> int | None:
        return None if self.membership is None else self.membership.rank

    # -- connecting ----------------------------------------------------------------------
    def _handshake(self) -> ClientHandshake:
        extra: dict[str, Any] = {}
        if self.role != ROLE_ADMIN:
            extra["cid"] = self._cid
        if self.membership is not None and self.session_lost is None:
            extra["session"] = self.membership.session
        return ClientHandshake(self._token, role=self.role, job=self.job, extra=extra)

    async def _connect(self, deadline: Deadline) -> CoordinatorLink:
        """One link, authenticated, trying until the deadline (backoff with full jitter)."""
        delay = _BACKOFF_FIRST
        attempts = 0
        while True:
            attempts += 1
            remaining = deadline.remaining()
            attempt_time = (
                _ATTEMPT_TIMEOUT if remaining is None else max(min(remaining, _ATTEMPT_TIMEOUT), 0.05)
            )
            try:
                link, info = await open_link(
                    self.host,
                    self.port,
                    self._handshake(),
                    on_event=self._on_event,
                    on_lost=self._on_link_lost,
                    timeout=attempt_time,
                )
                if link.closed:
                    raise ConnectionResetError("the coordinator closed the link right after the handshake")
                self.server_info = info
                return link
            except AuthenticationError as exc:
                raise AuthenticationError(
                    f"the coordinator at {self.address} did not accept us for job {self.job!r}: {exc}. "
                    f"Use the coordinator's token: set AIOCOLL_TOKEN (or pass token=) to the value the "
                    f"coordinator was started with (--token-file or its AIOCOLL_TOKEN)"
                ) from exc
            except ProtocolError as exc:
                raise ProtocolError(
                    f"{self.address} did not answer as an aiocoll coordinator: {exc}. Check the port "
                    f"(is it a worker's peer port or another service?) and that both sides run the "
                    f"same aiocoll release",
                    remote=exc.remote,
                ) from exc
            except (OSError, asyncio.TimeoutError) as exc:
                last = exc
            if self._closed:
                raise StoreError(f"session to the coordinator at {self.address} was closed while connecting")
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise CoordinatorUnreachable(
                    f"no aiocoll coordinator answered at {self.address} within {deadline.timeout:.3g}s "
                    f"({attempts} attempts; last error: {type(last).__name__}: {last or 'timed out'}). "
                    f"Check that the coordinator runs there (aiocoll coordinator --port {self.port}) and "
                    f"that host and port are right, or raise the timeout"
                ) from last
            pause = random.uniform(0, delay)
            if remaining is not None:
                pause = min(pause, remaining)
            await asyncio.sleep(pause)
            delay = min(delay * 2, _BACKOFF_MAX)

    def _on_link_lost(self, link: CoordinatorLink, exc: BaseException | None) -> None:
        if link is not self._link:
            return
        self._link = None
        self._link_changed.set()
        self._link_changed = asyncio.Event()
        if self._closed:
            return
        log.warning(
            "job=%s rank=%s event=coordinator_link_lost address=%s reason=%s; reconnecting",
            self.job,
            self._rank,
            self.address,
            exc or "closed by the coordinator",
        )
        self._reconnect_task = asyncio.ensure_future(self._reconnect())

    async def _reconnect(self) -> None:
        try:
            link = await self._connect(Deadline(self.timeout))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if self._closed:
                return
            self._fatal = exc
            log.error(
                "job=%s rank=%s event=coordinator_lost address=%s reason=%s",
                self.job,
                self._rank,
                self.address,
                exc,
            )
            self._link_changed.set()
            self._emit({"ev": EV_COORDINATOR_LOST, "reason": str(exc)})
            return
        if self._closed:
            link.close()
            return
        self._link = link
        self._link_changed.set()
        self._link_changed = asyncio.Event()
        log.info("job=%s rank=%s event=reconnected address=%s", self.job, self._rank, self.address)
        self._emit({"ev": EV_RECONNECTED})

    async def _usable_link(
        self, deadline: Deadline, op: str, timeout_error: Callable[[], BaseException]
    ) -> CoordinatorLink:
        while True:
            if self._closed:
                raise StoreError(f"{op}: the session to the coordinator at {self.address} is closed")
            if self._fatal is not None:
                raise CoordinatorUnreachable(
                    f"{op}: lost the coordinator at {self.address}: {self._fatal}"
                ) from self._fatal
            link = self._link
            if link is not None:
                if not link.closed:
                    return link
                self._on_link_lost(link, None)
                continue
            changed = self._link_changed
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise timeout_error()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                raise timeout_error() from None

    # -- requests ------------------------------------------------------------------------
    async def _call(
        self,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        deadline: Deadline,
        waits: bool = False,
        keys: Sequence[str] = (),
    ) -> tuple[dict[str, Any], bytes]:
        """Send one request (again after a reconnect) and return the reply.

        Args:
            waits: the coordinator may hold the request until ``timeout`` (a field we fill in).
            keys: the keys it is about, for error messages.
        """
        if self._deferred is not None or self._lost_sets:
            await self._settle()
        rid: int | None = None
        if op in MUTATING_OPS:
            if self._rid + 1 - self._ack() <= DEDUPE_WINDOW:  # the common case: no wait, no coroutine
                self._rid += 1
                rid = self._rid
                self._unanswered.add(rid)
                heapq.heappush(self._unanswered_heap, rid)
            else:
                rid = await self._next_rid(deadline, op, keys)
        try:
            link = self._link
            if link is None or not link.can_send or self._closed or self._fatal is not None:
                return await self._send(
                    op, fields, payload, deadline=deadline, waits=waits, keys=keys, rid=rid
                )
            # The hot path, inline: one request on an open link, awaited here (not through
            # _send and link.request: each coroutine level costs every resumption). Anything
            # unusual (a dropped link, a timeout) goes the way _send goes.
            header, bound = self._header(op, fields, rid, deadline, waits)
            self._last_request = link.loop.time()
            req_id, fut = link.start(header, payload, bound)
            try:
                reply, body = await fut
            except TimeoutError:
                raise self._timed_out(op, deadline, waits, keys, False) from None
            except LinkLost:
                if self._lost_sets:
                    await self._resend_lost_sets()
                return await self._send(
                    op, fields, payload, deadline=deadline, waits=waits, keys=keys, rid=rid
                )
            finally:
                link.forget(req_id)
            if reply.get("ok") is True:
                return reply, body
            raise self._error(op, reply, keys, deadline)
        finally:
            if rid is not None:
                self._unanswered.discard(rid)
                self._window_moved.set()

    def _header(
        self, op: str, fields: dict[str, Any], rid: int | None, deadline: Deadline, waits: bool
    ) -> tuple[dict[str, Any], float | None]:
        """The request header (``fields`` itself, completed) and how long to wait for its reply:
        a waiting op tells the coordinator its deadline and allows a grace for the reply."""
        fields["op"] = op
        if rid is not None:
            fields["rid"] = rid
            fields["ack"] = self._ack()
        remaining = deadline.remaining()
        if waits:
            fields["timeout"] = remaining
            return fields, None if remaining is None else remaining + _REPLY_GRACE
        return fields, None if remaining is None else max(remaining, _MIN_REPLY_TIME)

    def _ack(self) -> int:
        """The request number at and below which every mutation of ours has had its reply."""
        heap, unanswered = self._unanswered_heap, self._unanswered
        while heap and heap[0] not in unanswered:
            heapq.heappop(heap)
        return heap[0] - 1 if heap else self._rid

    async def _next_rid(self, deadline: Deadline, op: str, keys: Sequence[str]) -> int:
        """Number a mutation, waiting while DEDUPE_WINDOW of ours are unanswered below it."""
        while self._rid + 1 - self._ack() > DEDUPE_WINDOW:
            self._window_moved.clear()
            remaining = deadline.remaining()
            try:
                await asyncio.wait_for(self._window_moved.wait(), remaining)
            except asyncio.TimeoutError:
                raise StoreTimeout(
                    list(keys),
                    deadline.timeout,
                    f"{self._describe(op, keys)} timed out after {deadline.timeout:.3g}s: "
                    f"{DEDUPE_WINDOW} earlier mutations of this session were still unanswered",
                ) from None
        self._rid += 1
        rid = self._rid
        self._unanswered.add(rid)
        heapq.heappush(self._unanswered_heap, rid)
        return rid

    async def _send(
        self,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        deadline: Deadline,
        waits: bool = False,
        keys: Sequence[str] = (),
        rid: int | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """One request on the current link (waiting for one while reconnecting); ``fields`` is
        the caller's fresh dict and becomes the header."""
        while True:
            link = self._link
            if link is None or link.closed or self._closed or self._fatal is not None:
                link = await self._usable_link(
                    deadline, op, lambda: self._timed_out(op, deadline, waits, keys, True)
                )
            header, bound = self._header(op, fields, rid, deadline, waits)
            self._last_request = link.loop.time()
            try:
                reply, body = await link.request(header, payload, bound)
            except TimeoutError:
                raise self._timed_out(op, deadline, waits, keys, False) from None
            except LinkLost:
                # Re-sent on the next link (a numbered mutation is not applied twice), after the
                # pipelined sets written before it, so that it still sees them.
                if self._lost_sets:
                    await self._resend_lost_sets()
                continue
            if reply.get("ok") is True:
                return reply, body
            raise self._error(op, reply, keys, deadline)

    def _timed_out(
        self, op: str, deadline: Deadline, waits: bool, keys: Sequence[str], unreachable: bool
    ) -> BaseException:
        why = (
            f"the coordinator at {self.address} was unreachable (the session kept reconnecting)"
            if unreachable
            else f"the coordinator at {self.address} did not answer"
        )
        if op == "join":
            return RendezvousError(
                f"join (job {self.job!r}) did not complete within {deadline.timeout:.3g}s: {why}"
            )
        if waits and not unreachable:
            return StoreTimeout(keys, deadline.timeout, self._timeout_message(keys, deadline.timeout))
        return StoreTimeout(
            keys,
            deadline.timeout,
            f"{self._describe(op, keys)} timed out after {deadline.timeout:.3g}s: {why}",
        )

    def _describe(self, op: str, keys: Sequence[str]) -> str:
        if not keys:
            return f"{op} (job {self.job!r})"
        return f"{op} of key(s) {list(keys)[:8]!r} (job {self.job!r})"

    def _timeout_message(self, keys: Sequence[str], timeout: float | None) -> str:
        waited = f" after {timeout:.3g}s" if timeout is not None else ""
        return (
            f"timed out{waited} waiting for store key(s) {list(keys)!r} of job {self.job!r} at the "
            f"coordinator {self.address}"
        )

    def _error(
        self, op: str, reply: dict[str, Any], keys: Sequence[str], deadline: Deadline
    ) -> BaseException:
        err = reply.get("err")
        msg = str(reply.get("msg", "no reason given"))
        if err == ERR_TIMEOUT:
            missing = reply.get("keys")
            names = [k for k in missing if isinstance(k, str)] if isinstance(missing, list) else list(keys)
            return StoreTimeout(names, deadline.timeout, self._timeout_message(names, deadline.timeout))
        if err == ERR_RENDEZVOUS or op == "join":
            return RendezvousError(msg)
        if err in (ERR_INVALID, ERR_TOO_LARGE):
            return StoreError(msg)
        return DistError(f"the coordinator at {self.address} failed {op} ({err}): {msg}")

    def _deadline(self, timeout: float | datetime.timedelta | None) -> Deadline:
        return Deadline(self._timeout if timeout is None else self._check_timeout(timeout))

    # -- Store ---------------------------------------------------------------------------
    async def set(self, key: str, value: Value, *, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``.

        By default it returns once the coordinator acknowledged the set (with --state-dir: once
        it is on disk). With ``pipeline_sets`` it returns once the request is written to the
        link, as torch's TCPStore.set does: it is acknowledged when any operation of this
        session started after it returns (replies come in request order), or ``flush``/``aclose``
        returns; a failure is raised by the first operation started after the failure's reply
        arrived, and at the latest by ``flush`` or ``aclose``.

        Raises:
            StoreError: the coordinator refused it (too large, too many keys) — with
                ``pipeline_sets``, this or an earlier pipelined set, raised here or later.
            StoreTimeout: the coordinator could not be reached in time.
        """
        key = check_key(key)
        raw = to_value(key, value)
        deadline = self._deadline(timeout)
        if self.pipeline_sets:
            if self._deferred is not None or self._lost_sets:
                await self._settle()
            link = self._link
            if (
                link is not None
                and link.can_send
                and not self._closed
                and self._fatal is None
                and self._rid + 1 - self._ack() <= DEDUPE_WINDOW
            ):
                self._rid += 1
                rid = self._rid
                self._unanswered.add(rid)
                heapq.heappush(self._unanswered_heap, rid)
                remaining = deadline.remaining()
                header = {"key": key, "op": "set", "rid": rid, "ack": self._ack()}
                self._last_request = link.loop.time()
                self._sets_in_flight[rid] = (key, raw, deadline)
                self._sets_idle.clear()
                # No future and no task: the reply goes straight to _set_answered, and the frame
                # goes out with the others of this turn of the event loop in one write.
                link.send_nowait(
                    header,
                    raw,
                    None if remaining is None else max(remaining, _MIN_REPLY_TIME),
                    functools.partial(self._set_answered, rid),
                )
                self._sets_since_yield += 1
                if self._sets_since_yield >= _PIPELINE_YIELD_EVERY:
                    # A caller setting in a tight loop never lets the event loop run: give it a
                    # turn now and then, so replies are read as they come (the window of
                    # unanswered sets never fills and stalls) while the coordinator keeps busy.
                    self._sets_since_yield = 0
                    await asyncio.sleep(0)
                return
            # Reconnecting, paused by backpressure or a full window: the acknowledged path waits.
        await self._call("set", {"key": key}, raw, deadline=deadline, keys=[key])

    def _set_answered(
        self, rid: int, reply: dict[str, Any] | None, body: bytes, exc: BaseException | None
    ) -> None:
        """A pipelined set's reply (or failure: LinkLost, TimeoutError) arrived."""
        entry = self._sets_in_flight.pop(rid, None)
        if not self._sets_in_flight:
            self._sets_idle.set()
        if entry is None:
            return
        key, raw, deadline = entry
        if isinstance(exc, LinkLost):
            self._lost_sets.append((rid, key, raw, deadline))  # still unanswered: re-sent later
            return
        self._unanswered.discard(rid)
        self._window_moved.set()
        if exc is not None or reply is None:
            failure: BaseException = self._timed_out("set", deadline, False, [key], False)
        else:
            if reply.get("ok") is True:
                return
            failure = self._error("set", reply, [key], deadline)
        if self._deferred is None:
            self._deferred = failure
            log.error("job=%s event=pipelined_set_failed key=%r reason=%s", self.job, key[:256], failure)

    async def _resend_lost_sets(self) -> None:
        """Re-send, in order and one by one, the pipelined sets whose link dropped."""
        while self._lost_sets:
            lost = sorted(self._lost_sets, key=lambda entry: entry[0])
            self._lost_sets.clear()
            for i, (rid, key, raw, deadline) in enumerate(lost):
                try:
                    await self._send("set", {"key": key}, raw, deadline=deadline, keys=[key], rid=rid)
                except Exception as exc:
                    if self._deferred is None:
                        self._deferred = exc
                except BaseException:
                    self._lost_sets[:0] = lost[i:]  # cancelled: keep them for the next caller
                    raise
                self._unanswered.discard(rid)
                self._window_moved.set()

    async def _settle(self) -> None:
        """Re-send lost pipelined sets, then raise the first pipelined set's failure, if any."""
        if self._lost_sets:
            await self._resend_lost_sets()
        exc, self._deferred = self._deferred, None
        if exc is not None:
            raise exc

    async def flush(self, *, timeout: float | None = None) -> None:
        """Wait until every pipelined set of this session is acknowledged.

        Raises:
            StoreError, StoreTimeout: a pipelined set failed (the first failure is raised once).
        """
        deadline = self._deadline(timeout)
        while self._sets_in_flight or self._lost_sets or self._deferred is not None:
            if self._sets_in_flight:
                idle = self._sets_idle
                try:
                    await asyncio.wait_for(idle.wait(), deadline.remaining())
                except asyncio.TimeoutError:
                    raise StoreTimeout(
                        [k for k, _, _ in self._sets_in_flight.values()][:8],
                        deadline.timeout,
                        f"flush (job {self.job!r}): {len(self._sets_in_flight)} pipelined set(s) "
                        f"still unanswered by the coordinator at {self.address} after "
                        f"{deadline.timeout:.3g}s",
                    ) from None
            await self._settle()

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        key = check_key(key)
        _, body = await self._call(
            "get", {"key": key}, deadline=self._deadline(timeout), waits=True, keys=[key]
        )
        return body

    async def add(self, key: str, amount: int, *, timeout: float | None = None) -> int:
        key = check_key(key)
        amount = check_amount(key, amount)
        reply, _ = await self._call(
            "add", {"key": key, "amount": amount}, deadline=self._deadline(timeout), keys=[key]
        )
        return int(reply["value"])

    async def compare_set(
        self, key: str, expected: Value, desired: Value, *, timeout: float | None = None
    ) -> bytes:
        key = check_key(key)
        payload, sizes = join_values(
            [to_value(key, expected, "expected value"), to_value(key, desired, "desired value")]
        )
        _, body = await self._call(
            "cas", {"key": key, "sizes": sizes}, payload, deadline=self._deadline(timeout), keys=[key]
        )
        return body

    async def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        names = check_keys(keys)
        await self._call("wait", {"keys": names}, deadline=self._deadline(timeout), waits=True, keys=names)

    async def check(self, keys: Sequence[str], *, timeout: float | None = None) -> bool:
        names = check_keys(keys)
        reply, _ = await self._call("check", {"keys": names}, deadline=self._deadline(timeout), keys=names)
        return bool(reply["value"])

    async def delete_key(self, key: str, *, timeout: float | None = None) -> bool:
        key = check_key(key)
        reply, _ = await self._call(
            "del", {"key": key}, deadline=self._deadline(timeout), keys=[key]
        )
        return bool(reply["value"])

    async def num_keys(self, *, timeout: float | None = None) -> int:
        reply, _ = await self._call("nkeys", {}, deadline=self._deadline(timeout))
        return int(reply["value"])

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        names = check_keys(keys)
        reply, body = await self._call(
            "mget", {"keys": names}, deadline=self._deadline(timeout), waits=True, keys=names
        )
        values = split_values(body, reply.get("sizes"))
        if len(values) != len(names):
            raise ProtocolError(
                f"the coordinator answered mget of {len(names)} keys with {len(values)} values"
            )
        return values

    async def multi_set(
        self, keys: Sequence[str], values: Sequence[Value], *, timeout: float | None = None
    ) -> None:
        names, raw = self._pair(keys, values)
        payload, sizes = join_values(raw)
        await self._call(
            "mset", {"keys": names, "sizes": sizes}, payload, deadline=self._deadline(timeout), keys=names
        )

    async def append(self, key: str, value: Value, *, timeout: float | None = None) -> None:
        key = check_key(key)
        raw = to_value(key, value)
        await self._call(
            "append", {"key": key}, raw, deadline=self._deadline(timeout), keys=[key]
        )

    async def status(self, job: str | None = None, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """The coordinator's view of ``job`` (None: every job), as the ``status`` reply lists it."""
        reply, _ = await self._call("status", {"job": job}, deadline=self._deadline(timeout))
        jobs = reply.get("jobs", [])
        return list(jobs) if isinstance(jobs, list) else []

    # -- rendezvous ----------------------------------------------------------------------
    async def join(
        self,
        rank: int | None,
        world_size: int,
        addrs: Sequence[tuple[str, int]],
        host: str,
        timeout: float | datetime.timedelta | None = None,
    ) -> Membership:
        """Join this job's rendezvous and wait until all ``world_size`` members have joined.

        Args:
            rank: this process's rank, or None to let the coordinator pick the lowest free one.
            world_size: the number of members; every member must pass the same.
            addrs: (host, port) pairs where this member's peer listener accepts connections.
            host: this machine's identity (members with the same host may use shared memory).
            timeout: seconds to wait for the others (default: the session's timeout).

        Returns:
            The Membership; heartbeats start and keep this member alive until ``aclose``.

        Raises:
            RendezvousError: refused (duplicate or out-of-range rank, another world size) or timed out.
            ValueError, TypeError: bad arguments, before anything is sent.
        """
        if self.role != ROLE_WORKER:
            raise RendezvousError(
                f"join needs a session with role {ROLE_WORKER!r}; this one is {self.role!r}"
            )
        if self.membership is not None:
            raise RendezvousError(
                f"this session already joined job {self.job!r} as rank {self.membership.rank}; open a new "
                f"session to join again"
            )
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank must be an int or None, got {type(rank).__name__}")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} is out of range for world size {world_size} (valid: 0..{world_size - 1})"
            )
        wire_addrs = []
        for addr in addrs:
            if not (
                isinstance(addr, (tuple, list))
                and len(addr) == 2
                and isinstance(addr[0], str)
                and isinstance(addr[1], int)
            ):
                raise TypeError(f"addrs must hold (host: str, port: int) pairs, got {addr!r}")
            wire_addrs.append([addr[0], int(addr[1])])
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__}")
        deadline = self._deadline(timeout)
        fields: dict[str, Any] = {"rank": rank, "world_size": world_size, "addrs": wire_addrs, "host": host}
        # The first session of this process joining this job right now takes the table inline;
        # the others take only its digest and share the table the first one decodes (a process
        # simulating many members would otherwise receive and decode N tables of N members).
        loop = asyncio.get_running_loop()
        group = (id(loop), self.address, self.job)
        first = group not in _JOINS_IN_FLIGHT
        fields["table_in_payload" if first else "table_ref"] = True
        _JOINS_IN_FLIGHT[group] = _JOINS_IN_FLIGHT.get(group, 0) + 1
        # The heartbeat task is made now, while the round gathers, not after the reply: when a
        # round completes, every member handles its reply at the same moment, and on a shared
        # machine that burst is the rendezvous's critical path. It sends nothing before the join
        # succeeded.
        self._heartbeat_task = asyncio.ensure_future(self._heartbeats())
        try:
            try:
                # A join whose link drops is dropped by the coordinator (its rank is free again)
                # and an unfinished round is not kept across a restart, so joining again is what
                # resumes it.
                reply, body = await self._call("join", fields, deadline=deadline, waits=True)
            finally:
                left = _JOINS_IN_FLIGHT.pop(group) - 1
                if left:
                    _JOINS_IN_FLIGHT[group] = left
            members = await self._member_table(reply, body, deadline)
        except BaseException:
            self._stop_heartbeats()
            raise
        # Every member runs this at once when the round completes (see above): it calls as few
        # functions as it can, since each one first run in a freshly forked worker costs page
        # faults (copy-on-write of its code and objects): no dataclass __init__, and the log
        # call only when INFO is on.
        membership = object.__new__(Membership)
        attrs = membership.__dict__
        attrs["rank"] = int(reply["rank"])
        attrs["world_size"] = int(reply["world_size"])
        attrs["round"] = int(reply.get("round", 0))
        attrs["session"] = str(reply.get("session", ""))
        attrs["members"] = members
        self.membership = membership
        if log.isEnabledFor(logging.INFO):
            log.info(
                "job=%s rank=%d event=joined round=%d world_size=%d",
                self.job,
                membership.rank,
                membership.round,
                membership.world_size,
            )
        return membership

    async def _member_table(
        self, reply: dict[str, Any], body: bytes, deadline: Deadline
    ) -> Sequence[Member]:
        """The join reply's member table: inline (header or payload) or by digest, shared."""
        digest = reply.get("table_digest")
        if digest is None or body:
            if "members" in reply:  # a coordinator that predates table_in_payload
                old_style = MemberTable(b"")
                old_style._members = _decode_members(reply["members"])
                return old_style
            # The table came inline. Its digest comes with it from coordinators that send it
            # (no hashing here, on the path every member of a round takes at once); older ones
            # leave it to us.
            if type(digest) is not bytes or len(digest) != 16:
                digest = hashlib.blake2b(body, digest_size=16).digest()
            known = _TABLES.get(digest)
            if known is not None:
                return known
            inline = _TABLES[digest] = MemberTable(body)  # what _remember_table does, inline
            if len(_TABLES) > _TABLES_KEPT:
                _TABLES.popitem(last=False)
            return inline
        if not isinstance(digest, bytes):
            raise ProtocolError(f"the coordinator sent a table digest of type {type(digest).__name__}")
        known = _TABLES.get(digest)
        if known is not None:
            return known
        # One fetch per process and digest; the other sessions wait for it.
        loop = asyncio.get_running_loop()
        key = (id(loop), digest)
        fetch = _TABLE_FETCHES.get(key)
        if fetch is None:
            fetch = loop.create_future()
            _TABLE_FETCHES[key] = fetch
            try:
                head, payload = await self._call(
                    "table", {"round": int(reply.get("round", 0))}, deadline=deadline
                )
                got = hashlib.blake2b(payload, digest_size=16).digest()
                if got != digest or head.get("table_digest") != digest:
                    raise RendezvousError(
                        f"join (job {self.job!r}): the member table of round {reply.get('round')} changed "
                        f"before it could be read (a newer round replaced it); join again"
                    )
                table = _TABLES.get(digest)
                if table is None:
                    table = _remember_table(digest, MemberTable(payload))
            except BaseException as exc:
                fetch.set_exception(
                    exc
                    if isinstance(exc, Exception)
                    else RendezvousError(
                        f"join (job {self.job!r}): the session fetching the member table was cancelled"
                    )
                )
                fetch.exception()  # waiters may have given up; never "exception was never retrieved"
                raise
            else:
                fetch.set_result(table)
                return table
            finally:
                if _TABLE_FETCHES.get(key) is fetch:
                    del _TABLE_FETCHES[key]
        remaining = deadline.remaining()
        try:
            return await asyncio.wait_for(asyncio.shield(fetch), remaining)
        except asyncio.TimeoutError:
            raise RendezvousError(
                f"join (job {self.job!r}) did not complete within {deadline.timeout:.3g}s: the member "
                f"table did not arrive from the coordinator at {self.address}"
            ) from None

    async def _heartbeats(self) -> None:
        """Send ``hb`` when the link has been idle for HEARTBEAT_INTERVAL; a heartbeat that gets
        no answer in time closes the link, which makes the session reconnect."""
        loop = asyncio.get_running_loop()
        while not self._closed and self.session_lost is None:
            idle = loop.time() - self._last_request
            if self.membership is None:  # still joining: no beats yet
                await asyncio.sleep(HEARTBEAT_INTERVAL)
                continue
            if idle < HEARTBEAT_INTERVAL:
                await asyncio.sleep(HEARTBEAT_INTERVAL - idle)
                continue
            link = self._link
            if link is None:
                changed = self._link_changed
                await changed.wait()
                if self._fatal is not None:
                    return
                continue
            self._last_request = loop.time()
            try:
                await link.request({"op": "hb"}, b"", _HEARTBEAT_REPLY_TIMEOUT)
            except TimeoutError:
                log.warning(
                    "job=%s rank=%s event=heartbeat_unanswered address=%s after=%.1fs; reconnecting",
                    self.job,
                    self._rank,
                    self.address,
                    _HEARTBEAT_REPLY_TIMEOUT,
                )
                link.close()
            except LinkLost:
                pass  # the reconnect logic has it

    def start_beats(self, report: Report) -> BeatThread:
        """Beat from a thread on a connection of its own (client/_beat.py), so that this member
        stays alive while its event loop is busy, and send ``report(full)``'s progress reports.

        Raises:
            RendezvousError: this session has not joined.
        """
        if self.membership is None:
            raise RendezvousError("start_beats: this session has not joined a rendezvous")
        if self._beats is None:
            self._beats = BeatThread(
                self.host,
                self.port,
                token=self._token,
                job=self.job,
                session=self.membership.session,
                rank=self.membership.rank,
                report=report,
            )
            self._beats.start()
        return self._beats

    def _stop_heartbeats(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    # -- closing -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Leave the rendezvous (when joined) and close. Twice is fine; never raises for a dead
        link, except that with ``pipeline_sets`` it first waits for the pipelined sets (up to the
        session's timeout) and, after closing, raises the failure of one that did not succeed."""
        if self._closed:
            return
        failure: BaseException | None = None
        if self._sets_in_flight or self._lost_sets or self._deferred is not None:
            try:
                await self.flush()
            except Exception as exc:
                failure = exc
        beats, self._beats = self._beats, None
        if beats is not None:
            beats.stop()  # before leaving: a member that left has nothing to beat for
        link = self._link
        if link is not None and self.membership is not None and self.session_lost is None:
            with contextlib.suppress(LinkLost, TimeoutError, OSError):
                await link.request({"op": "leave"}, b"", _LEAVE_TIMEOUT)
        self.abort()
        if failure is not None:
            raise failure

    def abort(self) -> None:
        """Close at once without leaving: the coordinator will report this member lost."""
        if self._closed:
            return
        self._closed = True
        self._stop_heartbeats()
        beats, self._beats = self._beats, None
        if beats is not None:
            beats.stop()
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None:
            task.cancel()
        link, self._link = self._link, None
        if link is not None:
            link.close()
        self._link_changed.set()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._link is not None else "reconnecting")
        return f"CoordinatorSession({self.address}, job={self.job!r}, role={self.role!r}, {state})"
