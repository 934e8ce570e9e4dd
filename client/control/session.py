"""The coordinator session: a store client, rendezvous, heartbeats and reconnection.

May import foundations only (protocol, stores, _errors, _deadline) and the client modules it is
made of; never the public surface. ``CoordinatorSession`` is what a worker (role "worker") and
``aiocoll.connect_store`` (role "store") use to talk to the coordinator. It is itself an
``aiocoll.Store``. Its parts: the store client's bookkeeping (_store_core: ids, unsettled
mutations, exactly-once numbers), the link kept up (_link_keeper: connecting, reconnecting),
joining a rendezvous (_join, _members: the member table, heartbeats, the beat thread).

Store requests go in their compact form (protocol._store). ``set`` (and ``append``,
``multi_set``) expects no reply: it returns once its frame is queued, and the frames queued in one
turn of the event loop leave together. What is promised then (docs/COORDINATOR.md, "What a set
promises"): the coordinator carries out this session's requests in order, so any later request
sees the value, and any later reply acknowledges it; a refused one is raised by the first
operation that starts after the refusal arrived, and at the latest by ``flush()`` or ``aclose()``;
``flush()`` waits until every set is acknowledged (with ``--state-dir``: on disk).

Reconnection. When the link drops (a coordinator restart, a cut cable) the session reconnects
by itself, with exponential backoff and jitter, for up to ``timeout`` seconds, re-authenticates,
and sends its rendezvous ``session`` id in the hello so the coordinator re-attaches it. On the
new link it first sends again, in order, the sets nobody has seen acknowledged; requests that
were pending are sent again after them; a waiting request (get, wait, multi_get, join) resumes
with what is left of its own deadline. None is applied twice: reads and waits have no effect;
join is forgotten by the coordinator when its link drops (and no unfinished round survives a
restart), so joining again is how the rendezvous resumes; the mutations carry this session's
client id (hello ``cid``) and keep their request id, which is their number, and the coordinator
answers a number it has already carried out with the reply it gave the first time, from a memory
it journals with the mutation itself, so this holds across a coordinator restart with
--state-dir too. With every mutation the session also sends ``ack``, the id at and below which
every mutation of its own is settled, so the coordinator keeps only the replies that may still
be asked for again (at most DEDUPE_WINDOW: the session holds back a mutation beyond that).

A joined worker that reconnects after its link was cut while the coordinator stayed up is told
``session_lost`` (the coordinator declared it lost when the link closed); its store operations
keep working, only its membership is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from aiocoll._deadline import Deadline
from aiocoll._errors import StoreTimeout
from aiocoll._net import host_port
from aiocoll.protocol import ClientHandshake
from aiocoll.protocol._coordinator import (
    CID_BYTES,
    EV_MEMBER_LOST,
    EV_REFUSED,
    EV_RESTARTED,
    EV_SESSION_LOST,
    ROLE_ADMIN,
    ROLE_STORE,
    ROLE_WORKER,
)
from aiocoll.protocol._store import (
    MUTATIONS,
)
from aiocoll.stores import DEFAULT_TIMEOUT, Store
from aiocoll.stores._base import Value

from ._beat import BeatThread
from ._connection import CoordinatorLink, LinkLost
from ._join import Joining
from ._link_keeper import EV_COORDINATOR_LOST, EV_RECONNECTED, CoordinatorUnreachable, LinkKeeper
from ._members import HostMembership, Member, Membership, MemberTable
from ._store_core import MIN_REPLY_TIME, REPLY_GRACE, SYNC_AFTER, Request, StoreCore, requests

__all__ = [
    "EV_COORDINATOR_LOST",
    "EV_RECONNECTED",
    "CoordinatorSession",
    "CoordinatorUnreachable",
    "HostMembership",
    "Member",
    "MemberTable",
    "Membership",
]

log = logging.getLogger("aiocoll.client")

_LEAVE_TIMEOUT = 2.0
# A caller that sets in a tight loop gives the event loop a turn once in this many sets, so that
# other tasks run and refusals are read as they come.
_YIELD_EVERY = 256

MemberLostCallback = Callable[[int, str], None]
EventCallback = Callable[[dict[str, Any]], None]


class CoordinatorSession(Joining, Store):
    """A client of an aiocoll coordinator for one job; create it with ``await connect(...)``.

    Every store operation takes an optional ``timeout=`` (seconds): for get, multi_get and wait
    how long to wait for the keys, and for every operation how long to keep trying to reach the
    coordinator. The default is the session's ``timeout``.

    Attributes:
        host, port, job, role: where and as what this session is connected.
        membership: the Membership after ``join`` (None before).
        session_lost: None, or why the coordinator no longer counts this member.
        pipeline_sets: True (the default): ``set`` returns once queued (see the module's
            docstring); False: it returns once the coordinator acknowledged it, one round trip.
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
        pipeline_sets: bool = True,
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
        self.pipeline_sets = bool(pipeline_sets)
        self._token = token
        self._cid = os.urandom(CID_BYTES)
        self._core = StoreCore(job, host_port(host, self.port))
        self._keeper = LinkKeeper(
            host,
            self.port,
            job,
            timeout=lambda: self._timeout,
            handshake=self._handshake,
            on_event=self._on_event,
            on_settle=self._on_settle,
            next_id=self._core.next_id,
            on_new_link=self._resend_unsettled,
            rank=lambda: self._rank,
        )
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._beats: BeatThread | None = None
        self._closed = False
        self._last_request = 0.0
        self._member_lost_callbacks: list[MemberLostCallback] = []
        self._event_callbacks: list[EventCallback] = []
        self.membership: Membership | None = None
        self.host_membership: HostMembership | None = None  # join_host's members
        self.session_lost: str | None = None
        # Someone waits for the window of unsettled mutations to move (a future, made only then).
        self._window_moved: asyncio.Future[None] | None = None
        self._sets_since_yield = 0

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
        pipeline_sets: bool = True,
    ) -> CoordinatorSession:
        """Connect and authenticate, retrying with backoff while ``timeout`` allows.

        Args:
            host, port: the coordinator's address (use IP literals; no name lookups are made
                beyond what connecting needs). token: the shared secret (None: empty secret).
            job: the job's id; each job has its own keys and ranks. role: ROLE_WORKER (may join
                a rendezvous and keeps heartbeats) or ROLE_STORE (a plain store client).
            timeout: seconds to keep trying, and the default for every operation.
            pipeline_sets: ``set`` returns once queued (True, the default, as torch's TCPStore
                does) or once acknowledged (False); see the class's docstring.

        Raises:
            CoordinatorUnreachable: nothing accepted at host:port for the whole timeout.
            AuthenticationError: the coordinator holds another token (not retried).
            ProtocolError: host:port is not an aiocoll coordinator of this version.
        """
        session = cls(
            host, port, token=token, job=job, role=role, timeout=timeout, pipeline_sets=pipeline_sets
        )
        keeper = session._keeper
        link = await keeper.connect(Deadline(session.timeout))
        keeper.link = link
        return session

    @property
    def server_info(self) -> dict[str, Any]:
        return self._keeper.server_info

    # -- callbacks -----------------------------------------------------------------------
    def on_member_lost(self, callback: MemberLostCallback) -> None:
        """Call ``callback(rank, reason)`` when the coordinator reports a member of our round lost."""
        self._member_lost_callbacks.append(callback)

    def on_event(self, callback: EventCallback) -> None:
        """Call ``callback(event)`` for every event: the coordinator's (``member_lost``,
        ``restarted``, ``session_lost``) and the session's own (``reconnected``,
        ``coordinator_lost`` with a ``reason``). Each event is a dict with its name under "ev"."""
        self._event_callbacks.append(callback)

    def _on_event(self, event: dict[str, Any]) -> None:
        name = event.get("ev")
        if name == EV_MEMBER_LOST:
            # One rank, or (a connection's members, a second's silent ones) several at once.
            reason = str(event.get("reason", ""))
            ranks = event.get("ranks")
            lost = (
                [r for r in ranks if isinstance(r, int)] if isinstance(ranks, list) else [event.get("rank")]
            )
            for rank in lost:
                if not isinstance(rank, int):
                    continue
                # INFO: the engine says it in one line, with what follows (client/_progress.py)
                log.info(
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
            self._stop_beat_thread()  # the coordinator no longer counts this member
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
        for listener in list(self._event_callbacks):
            try:
                listener(event)
            except Exception:
                log.exception("job=%s event callback failed on %r", self.job, event)

    @property
    def _rank(self) -> int | None:
        return None if self.membership is None else self.membership.rank

    # -- the link ------------------------------------------------------------------------
    def _handshake(self) -> ClientHandshake:
        extra: dict[str, Any] = {}
        if self.role != ROLE_ADMIN:
            extra["cid"] = self._cid
        if self.session_lost is None:
            if self.membership is not None:
                extra["session"] = self.membership.session
            elif self.host_membership is not None:
                extra["session"] = list(self.host_membership.sessions)
        return ClientHandshake(self._token, role=self.role, job=self.job, extra=extra)

    def _resend_unsettled(self, link: CoordinatorLink) -> None:
        """A new link: first the sets nobody has seen acknowledged, in order (the coordinator
        answers the ones it had carried out from its memory, so none is applied twice)."""
        for frame in self._core.reconnected():
            link.send(frame)

    def _on_settle(self, header: list[Any], payload: bytes) -> None:
        """Every store reply: settle the mutations up to it; wake a caller waiting for the window."""
        self._core.settle(header, payload)
        waiter = self._window_moved
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _deadline(self, timeout: float | datetime.timedelta | None) -> Deadline:
        return Deadline(self._timeout if timeout is None else self._check_timeout(timeout))

    def _seconds(self, timeout: float | datetime.timedelta | None) -> float:
        return self._timeout if timeout is None else self._check_timeout(timeout)

    async def _room(self, deadline: Deadline, op: str, keys: Sequence[str]) -> None:
        """Wait until one more mutation may be numbered (DEDUPE_WINDOW of ours are unsettled),
        asking the coordinator to settle them."""
        core = self._core
        while not core.window_open():
            link = await self._usable(deadline, op, keys, False)
            if not core.sync_in_flight:
                core.sync_in_flight, frame = core.sync_frame()
                link.send(frame)
            waiter = self._window_moved
            if waiter is None or waiter.done():  # one future for every caller waiting for room
                waiter = self._window_moved = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(waiter), deadline.remaining())
            except asyncio.TimeoutError:
                raise core.window_timeout(op, keys, deadline.timeout) from None

    async def _usable(self, deadline: Deadline, op: str, keys: Sequence[str], waits: bool) -> CoordinatorLink:
        core = self._core
        return await self._keeper.usable(
            deadline, op, lambda: core.timed_out(op, deadline.timeout, waits, keys, True)
        )

    # -- requests ------------------------------------------------------------------------
    async def _store(self, req: Request, timeout: float) -> Any:
        """Send one store request that has a reply (again after a reconnect) and return what
        the reply means. ``timeout``: seconds for all of it."""
        core = self._core
        if core.deferred is not None:
            core.raise_deferred()
        code = req.code
        mutation = code in MUTATIONS
        deadline: Deadline | None = None  # made when the first try does not do
        req_id = 0
        remaining = timeout
        try:
            while True:
                link = self._keeper.ready()
                numbering = mutation and not req_id
                if link is None or (numbering and not core.window_open()):
                    deadline = deadline or Deadline(timeout)
                    while True:  # until a link takes it and (for a new mutation) the window has room
                        if numbering:
                            await self._room(deadline, req.op, req.keys)
                        link = await self._usable(deadline, req.op, req.keys, req.waits)
                        if not numbering or core.window_open():
                            break
                if deadline is not None:
                    remaining = deadline.remaining()  # type: ignore[assignment]
                req_id, frame, bound = core.encode(req, req_id if mutation else 0, timeout, remaining)
                self._last_request = link.loop.time()
                fut = link.start(req_id, frame, bound)
                try:
                    reply, body = await fut  # answered: the link has dropped what it kept for it
                except LinkLost:
                    deadline = deadline or Deadline(remaining)
                    continue  # sent again on the next link, after the sets that went before it
                except TimeoutError:
                    link.forget(req_id)
                    raise core.timed_out(req.op, timeout, req.waits, req.keys, False) from None
                except BaseException:
                    link.forget(req_id)
                    raise
                return core.outcome(req, reply, body, timeout)
        except BaseException:
            if mutation and req_id and req_id in core.unsettled:
                self._abandon(req_id)
            raise

    def _abandon(self, req_id: int) -> None:
        """Nobody awaits mutation ``req_id`` any more (its caller gave up): a later reply on the
        link that carried it settles it; one the current link has not carried goes out now (or
        first on the next link), for the coordinator may or may not have it."""
        frame = self._core.forget(req_id)
        link = self._keeper.ready()
        if frame is not None and link is not None:
            self._core.resent(req_id)
            link.send(frame)

    async def _call(
        self,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        deadline: Deadline,
        waits: bool = False,
    ) -> tuple[dict[str, Any], bytes]:
        """Send one control request (join, status, table; a map header) and return its reply,
        again on the next link when the link drops."""
        core = self._core
        while True:
            link = self._keeper.ready()
            if link is None:
                link = await self._usable(deadline, op, (), waits)
            fields["op"] = op
            remaining = deadline.remaining()
            if waits:
                fields["timeout"] = remaining
                bound = None if remaining is None else remaining + REPLY_GRACE
            else:
                bound = None if remaining is None else max(remaining, MIN_REPLY_TIME)
            self._last_request = link.loop.time()
            try:
                reply, body = await link.request(fields, payload, bound)
            except TimeoutError:
                raise core.timed_out(op, deadline.timeout, waits, (), False) from None
            except LinkLost:
                continue
            if reply.get("ok") is True:
                return reply, body
            raise core.error(op, reply, (), deadline.timeout)

    def _queue(self, req: Request, seconds: float) -> bool:
        """Queue SET, APPEND or MSET on the link when that needs no waiting (the link takes it,
        the window has room, no refusal is waiting to be raised); False otherwise."""
        core = self._core
        link = self._keeper.link
        if link is None or not link.can_send or core.deferred is not None or not core.window_open():
            return False
        link.send(core.mutation(req.code, req.fields, req.payload, req.keys, seconds, False)[1])
        if core.no_reply_unsettled >= SYNC_AFTER and not core.sync_in_flight:
            core.sync_in_flight, sync = core.sync_frame()
            link.send(sync)
        return True

    async def _mutate(self, req: Request, timeout: float | None) -> None:
        """SET, APPEND or MSET: queued (see the module's docstring), or acknowledged when the
        session was made with ``pipeline_sets=False``."""
        core = self._core
        seconds = self._timeout if timeout is None else self._check_timeout(timeout)
        if not self._queue(req, seconds):
            if core.deferred is not None:
                core.raise_deferred()
            # Reconnecting, paused by backpressure, or the window is full: wait (as long as the
            # deadline allows) until a link takes it.
            deadline = Deadline(seconds)
            while not self._queue(req, seconds):
                await self._room(deadline, req.op, req.keys)
                await self._usable(deadline, req.op, req.keys, False)
                if core.deferred is not None:
                    core.raise_deferred()
        if not self.pipeline_sets:
            await self.flush(timeout=seconds)
            return
        self._sets_since_yield += 1
        if self._sets_since_yield >= _YIELD_EVERY:
            self._sets_since_yield = 0
            await asyncio.sleep(0)

    async def flush(self, *, timeout: float | None = None) -> None:
        """Wait until every set (append, multi_set) of this session is acknowledged: with
        ``--state-dir``, on disk.

        Raises:
            StoreError, StoreTimeout: one of them was refused (the first refusal is raised once),
                or the coordinator did not answer in time.
        """
        core = self._core
        if core.no_reply_unsettled:
            seconds = self._seconds(timeout)
            try:
                await self._store(requests.sync(), seconds)
            except StoreTimeout:
                raise core.flush_timeout(seconds) from None
        if core.deferred is not None:
            core.raise_deferred()

    # -- Store ---------------------------------------------------------------------------
    async def set(self, key: str, value: Value, *, timeout: float | None = None) -> None:
        """Set ``key`` to ``value``.

        Returns once the request is queued (or, with ``pipeline_sets=False``, acknowledged): a
        later operation of this session sees the value; a refusal is raised by the first
        operation started after it arrived, at the latest by ``flush`` or ``aclose``.

        Raises:
            StoreError: the coordinator refused this or an earlier set (too large, too many keys).
            StoreTimeout: the coordinator could not be reached in time.
        """
        req = requests.set(key, value)
        if timeout is None and self.pipeline_sets and self._sets_since_yield < _YIELD_EVERY - 1:
            # The common case, without a coroutine of its own: queued now, or waits in _mutate.
            if self._queue(req, self._timeout):
                self._sets_since_yield += 1
                return
        await self._mutate(req, timeout)

    async def append(self, key: str, value: Value, *, timeout: float | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (created when missing); queued like ``set``."""
        await self._mutate(requests.append(key, value), timeout)

    async def multi_set(
        self, keys: Sequence[str], values: Sequence[Value], *, timeout: float | None = None
    ) -> None:
        """Set several keys at once; queued like ``set``."""
        await self._mutate(requests.multi_set(keys, values), timeout)

    async def get(self, key: str, *, timeout: float | None = None) -> bytes:
        result: bytes = await self._store(requests.get(key), self._seconds(timeout))
        return result

    async def add(self, key: str, amount: int, *, timeout: float | None = None) -> int:
        result: int = await self._store(requests.add(key, amount), self._seconds(timeout))
        return result

    async def compare_set(
        self, key: str, expected: Value, desired: Value, *, timeout: float | None = None
    ) -> bytes:
        req = requests.compare_set(key, expected, desired)
        result: bytes = await self._store(req, self._seconds(timeout))
        return result

    async def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        await self._store(requests.wait(keys), self._seconds(timeout))

    async def check(self, keys: Sequence[str], *, timeout: float | None = None) -> bool:
        result: bool = await self._store(requests.check(keys), self._seconds(timeout))
        return result

    async def delete_key(self, key: str, *, timeout: float | None = None) -> bool:
        result: bool = await self._store(requests.delete_key(key), self._seconds(timeout))
        return result

    async def num_keys(self, *, timeout: float | None = None) -> int:
        result: int = await self._store(requests.num_keys(), self._seconds(timeout))
        return result

    async def multi_get(self, keys: Sequence[str], *, timeout: float | None = None) -> list[bytes]:
        result: list[bytes] = await self._store(requests.multi_get(keys), self._seconds(timeout))
        return result

    async def status(self, job: str | None = None, *, timeout: float | None = None) -> list[dict[str, Any]]:
        """The coordinator's view of ``job`` (None: every job), as the ``status`` reply lists it."""
        reply, _ = await self._call("status", {"job": job}, deadline=self._deadline(timeout))
        jobs = reply.get("jobs", [])
        return list(jobs) if isinstance(jobs, list) else []

    # -- closing -------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    async def aclose(self) -> None:
        """Leave the rendezvous (when joined) and close. Twice is fine; never raises for a dead
        link, except that it first waits for the sets not yet acknowledged (up to the session's
        timeout) and, after closing, raises the refusal of one, or that they were not answered."""
        if self._closed:
            return
        failure: BaseException | None = None
        if self._core.no_reply_unsettled or self._core.deferred is not None:
            try:
                await self.flush()
            except Exception as exc:
                failure = exc
        self._stop_beat_thread()  # before leaving: a member that left has nothing to beat for
        link = self._keeper.link
        joined = self.membership is not None or self.host_membership is not None
        if link is not None and joined and self.session_lost is None:
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
        self._stop_beat_thread()
        self._keeper.close()

    def __repr__(self) -> str:
        state = (
            "closed" if self._closed else ("connected" if self._keeper.link is not None else "reconnecting")
        )
        return f"CoordinatorSession({self.address}, job={self.job!r}, role={self.role!r}, {state})"
