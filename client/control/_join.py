"""Joining a rendezvous from a coordinator session: ``join`` (with the member table shared by the
sessions of one process), the heartbeats that keep a joined member alive on the session's link,
and the beat thread that keeps it alive while its event loop is busy.

May import foundations only and client modules below the session (_members, _beat, _link_keeper).
``Joining`` is a part of ``CoordinatorSession`` (session.py): it uses the session's control
requests (``_call``), its link keeper and its deadline helper.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from aiocoll._deadline import Deadline
from aiocoll._errors import ProtocolError, RendezvousError
from aiocoll.protocol._coordinator import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, ROLE_WORKER

from ._beat import BeatThread, Report
from ._connection import LinkLost
from ._members import (
    JOINS_IN_FLIGHT,
    TABLE_FETCHES,
    TABLES,
    TABLES_KEPT,
    HostMembership,
    Member,
    Membership,
    MemberTable,
    decode_members,
    remember_table,
)

if TYPE_CHECKING:
    from ._link_keeper import LinkKeeper

__all__ = ["Joining"]

log = logging.getLogger("aiocoll.client")

# A heartbeat unanswered for this long means the link is dead even if TCP has not noticed.
_HEARTBEAT_REPLY_TIMEOUT = HEARTBEAT_TIMEOUT / 2


def beat_interval(reply: dict[str, Any]) -> float:
    """The heartbeat interval a join reply asks for: HEARTBEAT_INTERVAL, or longer for a round of
    many connections (``beat``), never past half the heartbeat timeout."""
    beat = reply.get("beat")
    if not isinstance(beat, (int, float)) or not beat > HEARTBEAT_INTERVAL:
        return HEARTBEAT_INTERVAL
    return min(float(beat), HEARTBEAT_TIMEOUT / 2)


class Joining:
    """The rendezvous half of a coordinator session (see CoordinatorSession)."""

    # What the session provides.
    role: str
    job: str
    host: str
    port: int
    membership: Membership | None
    host_membership: HostMembership | None
    session_lost: str | None
    _token: str | bytes | None
    _keeper: LinkKeeper
    _closed: bool
    _last_request: float
    _heartbeat_task: asyncio.Task[None] | None
    _beats: BeatThread | None
    # Seconds between heartbeats once joined (a large round's join reply may ask for more).
    _beat_interval: float = HEARTBEAT_INTERVAL

    @property
    def address(self) -> str:
        return self._keeper.address

    def _deadline(self, timeout: float | datetime.timedelta | None) -> Deadline:
        raise NotImplementedError

    async def _call(
        self,
        op: str,
        fields: dict[str, Any],
        payload: bytes = b"",
        *,
        deadline: Deadline,
        waits: bool = False,
    ) -> tuple[dict[str, Any], bytes]:
        raise NotImplementedError

    async def join(
        self,
        rank: int | None,
        world_size: int,
        addrs: Sequence[Sequence[Any]],
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
        self._check_can_join()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        rank = self._checked_rank(rank, world_size)
        wire_addrs = self._wire_addrs(addrs)
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__}")
        deadline = self._deadline(timeout)
        fields: dict[str, Any] = {"rank": rank, "world_size": world_size, "addrs": wire_addrs, "host": host}
        # The first session of this process joining this job right now takes the table inline;
        # the others take only its digest and share the table the first one decodes (a process
        # simulating many members would otherwise receive and decode N tables of N members).
        loop = asyncio.get_running_loop()
        group = (id(loop), self.address, self.job)
        first = group not in JOINS_IN_FLIGHT
        fields["table_in_payload" if first else "table_ref"] = True
        JOINS_IN_FLIGHT[group] = JOINS_IN_FLIGHT.get(group, 0) + 1
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
                left = JOINS_IN_FLIGHT.pop(group) - 1
                if left:
                    JOINS_IN_FLIGHT[group] = left
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
        self._beat_interval = beat_interval(reply)
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

    async def join_host(
        self,
        ranks: Sequence[int | None],
        world_size: int,
        addrs: Sequence[Sequence[tuple[str, int]]],
        host: str,
        timeout: float | datetime.timedelta | None = None,
    ) -> HostMembership:
        """Join several members over this one session: the ranks a host runs, joined together by
        the process that runs them (one connection for all, as a node agent does). They are alive
        while this session is, and lost together when it closes. The reply holds their ranks and
        sessions only; ``table_rows`` reads the addresses they need.

        Args:
            ranks: each member's rank, or None for the lowest free one.
            world_size: the size of the round. addrs: each member's (host, port) pairs.
            host: this machine's identity.

        Raises:
            RendezvousError: refused or timed out. ValueError, TypeError: bad arguments.
        """
        self._check_can_join()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not ranks or len(ranks) != len(addrs):
            raise ValueError(
                f"join_host needs one address list per rank: {len(ranks)} ranks, {len(addrs)} lists"
            )
        members = [
            [self._checked_rank(r, world_size), self._wire_addrs(a), host]
            for r, a in zip(ranks, addrs, strict=True)
        ]
        if not isinstance(host, str):
            raise TypeError(f"host must be a str, got {type(host).__name__}")
        deadline = self._deadline(timeout)
        self._heartbeat_task = asyncio.ensure_future(self._heartbeats())
        try:
            reply, _ = await self._call(
                "join", {"members": members, "world_size": world_size}, deadline=deadline, waits=True
            )
            got = HostMembership(
                tuple(int(r) for r in reply["ranks"]),
                tuple(str(s) for s in reply["sessions"]),
                int(reply["world_size"]),
                int(reply["round"]),
            )
            self._beat_interval = beat_interval(reply)
        except (KeyError, TypeError, ValueError) as exc:
            self._stop_heartbeats()
            raise ProtocolError(f"the coordinator sent a malformed join reply: {exc!r}") from exc
        except BaseException:
            self._stop_heartbeats()
            raise
        self.host_membership = got
        return got

    async def table_rows(
        self, first: int, end: int, *, timeout: float | datetime.timedelta | None = None
    ) -> tuple[Member, ...]:
        """The members of ranks ``first`` to ``end - 1`` of the round this session joined: the
        addresses a member's links need, without the whole table.

        Raises:
            RendezvousError: the session has not joined, or its round was replaced.
        """
        joined = self.membership or self.host_membership
        if joined is None:
            raise RendezvousError("table_rows: this session has not joined a rendezvous")
        _, body = await self._call(
            "table", {"round": joined.round, "ranks": [first, end]}, deadline=self._deadline(timeout)
        )
        return decode_members(msgpack.unpackb(body, raw=False))

    def _check_can_join(self) -> None:
        if self.role != ROLE_WORKER:
            raise RendezvousError(
                f"join needs a session with role {ROLE_WORKER!r}; this one is {self.role!r}"
            )
        joined = self.membership or self.host_membership
        if joined is not None:
            ranks = joined.rank if isinstance(joined, Membership) else list(joined.ranks)
            raise RendezvousError(
                f"this session already joined job {self.job!r} as rank {ranks}; open a new session to "
                f"join again"
            )

    @staticmethod
    def _checked_rank(rank: int | None, world_size: int) -> int | None:
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
            raise TypeError(f"rank must be an int or None, got {type(rank).__name__}")
        if rank is not None and not 0 <= rank < world_size:
            raise ValueError(
                f"rank {rank} is out of range for world size {world_size} (valid: 0..{world_size - 1})"
            )
        return rank

    @staticmethod
    def _wire_addrs(addrs: Sequence[Sequence[Any]]) -> list[list[Any]]:
        wire = []
        for addr in addrs:
            if not (
                isinstance(addr, (tuple, list))
                and len(addr) == 2
                and isinstance(addr[0], str)
                and isinstance(addr[1], int)
            ):
                raise TypeError(f"addrs must hold (host: str, port: int) pairs, got {addr!r}")
            wire.append([addr[0], int(addr[1])])
        return wire

    async def _member_table(self, reply: dict[str, Any], body: bytes, deadline: Deadline) -> Sequence[Member]:
        """The join reply's member table: inline (header or payload) or by digest, shared."""
        digest = reply.get("table_digest")
        if digest is None or body:
            if "members" in reply:  # a coordinator that predates table_in_payload
                old_style = MemberTable(b"")
                old_style._members = decode_members(reply["members"])
                return old_style
            # The table came inline. Its digest comes with it from coordinators that send it
            # (no hashing here, on the path every member of a round takes at once); older ones
            # leave it to us.
            if type(digest) is not bytes or len(digest) != 16:
                digest = hashlib.blake2b(body, digest_size=16).digest()
            known = TABLES.get(digest)
            if known is not None:
                return known
            inline = TABLES[digest] = MemberTable(body)  # what _remember_table does, inline
            if len(TABLES) > TABLES_KEPT:
                TABLES.popitem(last=False)
            return inline
        if not isinstance(digest, bytes):
            raise ProtocolError(f"the coordinator sent a table digest of type {type(digest).__name__}")
        known = TABLES.get(digest)
        if known is not None:
            return known
        # One fetch per process and digest; the other sessions wait for it.
        loop = asyncio.get_running_loop()
        key = (id(loop), digest)
        fetch = TABLE_FETCHES.get(key)
        if fetch is None:
            fetch = loop.create_future()
            TABLE_FETCHES[key] = fetch
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
                table = TABLES.get(digest)
                if table is None:
                    table = remember_table(digest, MemberTable(payload))
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
                if TABLE_FETCHES.get(key) is fetch:
                    del TABLE_FETCHES[key]
        remaining = deadline.remaining()
        try:
            return await asyncio.wait_for(asyncio.shield(fetch), remaining)
        except asyncio.TimeoutError:
            raise RendezvousError(
                f"join (job {self.job!r}) did not complete within {deadline.timeout:.3g}s: the member "
                f"table did not arrive from the coordinator at {self.address}"
            ) from None

    async def _heartbeats(self) -> None:
        """Send ``hb`` when the link has been idle for the beat interval (HEARTBEAT_INTERVAL, or
        the longer one a large round's join reply names); a heartbeat that gets no answer in time
        closes the link, which makes the session reconnect."""
        loop = asyncio.get_running_loop()
        while not self._closed and self.session_lost is None:
            idle = loop.time() - self._last_request
            if self.membership is None and self.host_membership is None:  # still joining: no beats yet
                await asyncio.sleep(HEARTBEAT_INTERVAL)
                continue
            interval = self._beat_interval
            if idle < interval:
                await asyncio.sleep(interval - idle)
                continue
            keeper = self._keeper
            link = keeper.link
            if link is None:
                await keeper.changed.wait()
                if keeper.fatal is not None:
                    return
                continue
            self._last_request = loop.time()
            try:
                await link.request({"op": "hb"}, b"", _HEARTBEAT_REPLY_TIMEOUT)
            except TimeoutError:
                keeper.replace(link, f"a heartbeat went unanswered for {_HEARTBEAT_REPLY_TIMEOUT:.1f}s")
            except LinkLost:
                pass  # the reconnect logic has it

    def start_beats(self, report: Report) -> BeatThread:
        """Beat from a thread on a connection of its own (client/control/_beat.py), so that this member
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
                interval=self._beat_interval,  # a round of many connections asks for fewer beats
            )
            self._beats.start()
        return self._beats

    def _stop_beat_thread(self) -> None:
        beats, self._beats = self._beats, None
        if beats is not None:
            beats.stop()

    def _stop_heartbeats(self) -> None:
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
