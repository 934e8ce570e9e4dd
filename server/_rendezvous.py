"""The coordinator's rendezvous part: rounds of each job, their members and sessions, the member
table, joins that wait, leave, loss (with the ``member_lost`` event) and re-attaching after a
restart. Sans-IO; imports _model and aiocoll foundations only. Liveness (_liveness) decides when a
member went silent and calls ``lose``.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
from collections.abc import Iterable
from typing import Any

import msgpack

from aiocoll.protocol._coordinator import (
    ERR_INVALID,
    ERR_RENDEZVOUS,
    EV_MEMBER_LOST,
    EV_REFUSED,
    EV_RESTARTED,
    EV_SESSION_LOST,
    ROLE_WORKER,
)

from ._model import (
    Conn,
    Effects,
    EncodedHeader,
    Job,
    MemberState,
    Record,
    Refused,
    can_move,
    error_header,
    fmt_timeout,
    timeout_field,
)

__all__ = ["MAX_WORLD_SIZE", "Member", "Rendezvous", "Round", "RoundState"]

log = logging.getLogger("aiocoll.server")

MAX_WORLD_SIZE = 1 << 20
MAX_ADDRS = 64
MAX_HOST_CHARS = 256
_MEMBERS_KEY = msgpack.packb("members", use_bin_type=True)

JOINING, ALIVE, RESUMING, LEFT, LOST = (
    MemberState.JOINING,
    MemberState.ALIVE,
    MemberState.RESUMING,
    MemberState.LEFT,
    MemberState.LOST,
)


class RoundState(enum.Enum):
    FORMING = "forming"  # members are joining
    COMPLETE = "complete"  # full; every member has the table
    BROKEN = "broken"  # complete, and a member has since left or been lost: the next join opens a new one


class Member:
    """One rank of one rendezvous round."""

    __slots__ = (
        "addrs",
        "assigned",
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

    def __init__(self, rank: int, addrs: list[Any], host: str, rnd: Round) -> None:
        self.rank = rank
        # The coordinator picked this rank (the join asked for none): until the round completes
        # it may move to another free rank, so that a member asking for this one gets it.
        self.assigned = False
        self.addrs = addrs
        self.host = host
        self.session = ""
        self.state = JOINING
        self.conn: Conn | None = None
        self.beat: Conn | None = None  # its beat connection (ROLE_BEAT), heard apart from conn
        self.round = rnd
        self.req_id = 0
        self.deadline: float | None = None
        self.started = 0.0
        self.timeout: float | None = None
        self.reason = ""
        self.last_seen = 0.0
        self.table_in_payload = False
        self.table_ref = False

    @property
    def waiting(self) -> bool:
        """Its join still waits for the round (the deadline heap asks)."""
        return self.state is JOINING

    def move(self, new: MemberState) -> None:
        assert can_move(self.state, new), f"member {self.rank}: {self.state} -> {new}"
        self.state = new


class Round:
    __slots__ = ("free_hint", "job", "members", "number", "state", "table", "table_digest", "world_size")

    def __init__(self, job: Job, number: int, world_size: int) -> None:
        self.job = job
        self.number = number
        self.world_size = world_size
        self.members: dict[int, Member] = {}
        self.state = RoundState.FORMING
        self.free_hint = 0  # lowest rank that may be free
        # The completed round's member table, msgpack-encoded once, and its digest (for
        # ``table_ref`` joins and the ``table`` operation); built on completion or on demand.
        self.table: bytes | None = None
        self.table_digest = b""

    @property
    def complete(self) -> bool:
        return self.state is not RoundState.FORMING

    @property
    def broken(self) -> bool:
        return self.state is RoundState.BROKEN


class Rendezvous:
    """Rounds, members and sessions of every job.

    Attributes:
        live: members alive or resuming (what liveness watches).
    """

    def __init__(self, fx: Effects) -> None:
        self.fx = fx
        self.sessions: dict[str, Member] = {}
        self.live: set[Member] = set()

    def handlers(self) -> dict[str, Any]:
        return {"join": self.op_join, "leave": self.op_leave, "table": self.op_table}

    # -- connections
    def resume(self, conn: Conn, session: object, now: float) -> None:
        """A worker connection whose hello names ``session``: re-attach its member, or tell it
        the session is gone (EV_SESSION_LOST)."""
        j = conn.job
        member = self.sessions.get(session) if isinstance(session, str) else None
        if member is None or member.round.job is not j or member.state not in (ALIVE, RESUMING):
            why = (
                "this coordinator does not know that session (it restarted without --state-dir, "
                "or the session ended)"
                if member is None or member.round.job is not j
                else f"the member was already declared {member.state.value}: {member.reason or 'no reason'}"
            )
            log.warning("job=%s event=resume_refused peer=%s reason=%s", j.name, conn.peer, why)
            self.fx.outbox.append((conn.id, {"ev": EV_SESSION_LOST, "reason": why}, b""))
            return
        old = member.conn
        if old is not None and old is not conn:
            old.member = None  # its close must not declare the member lost
            self.fx.closes.append((old.id, f"session of rank {member.rank} resumed on a new connection"))
        was = member.state
        member.conn = conn
        if was is RESUMING:
            member.move(ALIVE)
        member.last_seen = now
        conn.member = member
        self.live.add(member)
        log.info(
            "job=%s rank=%d event=resumed round=%d peer=%s",
            j.name,
            member.rank,
            member.round.number,
            conn.peer,
        )
        if was is RESUMING:
            self.fx.outbox.append((conn.id, {"ev": EV_RESTARTED}, b""))

    def attach_beat(self, conn: Conn, session: object) -> None:
        """A member's beat connection: it keeps the member alive apart from its main connection."""
        member = self.sessions.get(session) if isinstance(session, str) else None
        if member is None or member.round.job is not conn.job or member.state is not ALIVE:
            self.fx.closes.append((conn.id, "a beat connection must name the session of an alive member"))
            return
        old = member.beat
        if old is not None and old is not conn:
            old.beat_of = None
            self.fx.closes.append((old.id, f"rank {member.rank}'s beats moved to a new connection"))
        member.beat = conn
        conn.beat_of = member

    def refused_connection(self, j: Job | None, role: object, peer: str, reason: str) -> None:
        """A connection naming job ``j`` failed authentication: tell its members waiting in a
        forming round (EV_REFUSED), so their logs say why a rank may never arrive. Only a notice:
        the hello is unauthenticated, and an outsider must not be able to fail a rendezvous."""
        rnd = j.round if j is not None else None
        if role != ROLE_WORKER or rnd is None or rnd.complete:
            return
        event = {"ev": EV_REFUSED, "peer": peer[:300], "reason": reason[:500]}
        for m in rnd.members.values():
            if m.state is JOINING and m.conn is not None:
                self.fx.outbox.append((m.conn.id, event, b""))

    def disconnect(self, conn: Conn, reason: str) -> None:
        """A connection closed: its beat stops counting, its join is dropped, its member is lost."""
        beat_of = conn.beat_of
        if beat_of is not None and beat_of.beat is conn:
            beat_of.beat = None  # its closing declares nothing: only silence on both does
        if conn.joining is not None:
            self._drop_joining(conn.joining, f"connection closed: {reason}")
        member = conn.member
        if member is not None and member.conn is conn:
            self.lose(member, f"connection closed without leave ({reason})")

    # -- join
    def op_join(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        job = conn.job
        rank, world_size, addrs, host = (
            h.get("rank"),
            h.get("world_size"),
            h.get("addrs", []),
            h.get("host", ""),
        )
        who = f"job {job.name!r}, rank {rank}"
        if rank is not None and type(rank) is not int:
            raise Refused(ERR_INVALID, f"{who}: 'rank' must be an integer or None")
        if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise Refused(
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
            raise Refused(
                ERR_INVALID, f"{who}: 'addrs' must be a list of at most {MAX_ADDRS} [host, port] pairs"
            )
        if type(host) is not str or len(host) > MAX_HOST_CHARS:
            raise Refused(
                ERR_INVALID, f"{who}: 'host' must be a string of at most {MAX_HOST_CHARS} characters"
            )
        timeout = timeout_field(h.get("timeout"))
        already = conn.joining or conn.member
        if already is not None:
            raise Refused(
                ERR_RENDEZVOUS,
                f"{who}: this connection already joined round {already.round.number}; one join per session",
            )
        rnd = job.round
        if rnd is not None and rnd.complete:
            if not rnd.broken:
                raise Refused(
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
        assigned = rank is None
        if rank is None:
            rank = self._take_free_rank(rnd)
        elif not 0 <= rank < world_size:
            raise Refused(
                ERR_RENDEZVOUS,
                f"job {job.name!r}: rank {rank} is out of range for world size "
                f"{world_size} (valid ranks: 0..{world_size - 1})",
            )
        elif rank in rnd.members and rnd.members[rank].assigned:
            # A rank-less member that joined first holds it only provisionally (nobody has seen
            # the table yet): it moves to another free rank; one is free, as the round is not full.
            # So a requested rank is honoured whatever order the joins arrive in.
            moved = rnd.members[rank]
            moved.rank = self._take_free_rank(rnd)  # while ``rank`` is still held: never itself
            del rnd.members[rank]
            rnd.members[moved.rank] = moved
            log.debug(
                "job=%s event=rank_moved round=%d from=%d to=%d reason=rank %d was asked for",
                job.name,
                rnd.number,
                rank,
                moved.rank,
                rank,
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
        now = self.fx.clock()
        member = Member(rank, addrs, host, rnd)
        member.assigned = assigned
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
            self.fx.push_timer(member.deadline, member, self._expire_join)

    @staticmethod
    def _take_free_rank(rnd: Round) -> int:
        """The lowest rank no member of the forming round holds; the caller puts a member there.
        Every rank below ``free_hint`` is taken, so this is O(1) amortised (10,000 joins must not
        scan 10,000 ranks each)."""
        rank = rnd.free_hint
        while rank in rnd.members:
            rank += 1
        rnd.free_hint = rank + 1
        return rank

    def _open_round(self, job: Job, world_size: int) -> Round:
        rnd = Round(job, job.next_round, world_size)
        job.next_round += 1
        job.round = rnd
        log.info("job=%s event=round_open round=%d world_size=%d", job.name, rnd.number, world_size)
        return rnd

    def _complete(self, rnd: Round) -> None:
        rnd.state = RoundState.COMPLETE
        rnd.job.progress.reset()
        # Every member gets the same table: encode it once (a 10,000-member table is ~0.5 MB, and
        # encoding it per member would cost seconds).
        members_packed, digest = self.round_table(rnd)
        for m in rnd.members.values():
            m.session = os.urandom(16).hex()
            self.sessions[m.session] = m
        if self.fx.durable:
            self.fx.journal.append(
                [
                    "round",
                    rnd.job.name,
                    rnd.number,
                    rnd.world_size,
                    [[m.rank, m.addrs, m.host, m.session] for m in rnd.members.values()],
                ]
            )
        now = self.fx.clock()
        # "table_digest": bin8 of 16 bytes, appended to a reply header's map (one more entry).
        digest_field = b"".join(msgpack.packb(x, use_bin_type=True) for x in ("table_digest", digest))
        for m in rnd.members.values():
            conn = m.conn
            assert conn is not None
            conn.joining = None
            conn.member = m
            m.move(ALIVE)
            m.deadline = None
            m.last_seen = now
            self.live.add(m)
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
                self.fx.reply(conn, m.req_id, "join", m.started, EncodedHeader((b"\x88" + head[1:], ref[1:])))
            elif m.table_in_payload:
                # The client asked for the table as a payload (msgpack) it may decode lazily; its
                # digest rides along, so the client need not hash the table to share it.
                header = EncodedHeader((b"\x87" + head[1:], digest_field))
                self.fx.reply(conn, m.req_id, "join", m.started, header, members_packed)
            else:
                # A fixmap of 6 entries (0x86) becomes one of 7 with "members" appended.
                header = EncodedHeader((b"\x87" + head[1:], _MEMBERS_KEY, members_packed))
                self.fx.reply(conn, m.req_id, "join", m.started, header)
        log.info(
            "job=%s event=round_complete round=%d world_size=%d", rnd.job.name, rnd.number, rnd.world_size
        )

    @staticmethod
    def round_table(rnd: Round) -> tuple[bytes, bytes]:
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

    def op_table(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        number = h.get("round")
        if type(number) is not int:
            raise Refused(ERR_INVALID, f"'round' must be an integer, got {type(number).__name__}")
        job = conn.job
        rnd = job.round
        if rnd is None or not rnd.complete or rnd.number != number:
            current = "no completed round" if rnd is None or not rnd.complete else f"round {rnd.number}"
            raise Refused(
                ERR_RENDEZVOUS,
                f"job {job.name!r} has {current}, not round {number}: its member table is gone "
                f"(a newer round replaced it); join again",
            )
        table, digest = self.round_table(rnd)
        self.fx.reply(
            conn, req_id, "table", self.fx.started, {"id": req_id, "ok": True, "table_digest": digest}, table
        )

    def _refuse_join(self, rnd: Round, refused: Conn, req_id: int, why: str) -> None:
        """Refuse a join that contradicts ``rnd``; the members already waiting there hear it at
        once (the round cannot complete as the ranks were configured) instead of waiting out
        their timeout. (Not a Refused: that would take back the other members' replies.)"""
        self.fx.fail(refused.id, req_id, "join", self.fx.started, ERR_RENDEZVOUS, f"join: {why}")
        for m in list(rnd.members.values()):
            conn = m.conn
            if m.state is not JOINING or conn is None:
                continue
            self._drop_joining(m, "another join was refused")
            self.fx.fail(
                conn.id,
                m.req_id,
                "join",
                m.started,
                ERR_RENDEZVOUS,
                f"join: rank {m.rank} of job {rnd.job.name!r}: the rendezvous of round "
                f"{rnd.number} failed because the coordinator refused a join from "
                f"{refused.peer or 'another process'}: {why}. Fix the launch configuration "
                f"and start every rank again",
            )

    def _drop_joining(self, member: Member, why: str) -> None:
        """Take a not-yet-complete join out of its round (its rank becomes free again)."""
        rnd = member.round
        if rnd.members.get(member.rank) is member:
            del rnd.members[member.rank]
            rnd.free_hint = min(rnd.free_hint, member.rank)
        if member.conn is not None and member.conn.joining is member:
            member.conn.joining = None
        member.move(LOST)
        member.deadline = None
        log.info(
            "job=%s rank=%d event=join_dropped round=%d reason=%s", rnd.job.name, member.rank, rnd.number, why
        )

    def _expire_join(self, m: Member) -> None:
        rnd = m.round
        present = sorted(r for r, x in rnd.members.items() if x is not m)
        absent = [r for r in range(rnd.world_size) if r not in rnd.members][:32]
        conn = m.conn
        self._drop_joining(m, "rendezvous timed out")
        if conn is not None:
            self.fx.fail(
                conn.id,
                m.req_id,
                "join",
                m.started,
                ERR_RENDEZVOUS,
                f"join: rendezvous of job {rnd.job.name!r} round {rnd.number} timed out "
                f"after {fmt_timeout(m.timeout)} for rank {m.rank}: {len(present) + 1} of "
                f"{rnd.world_size} ranks had joined; missing ranks {absent} (not all "
                f"processes started, or they were given another world size or job)",
            )

    # -- leaving and loss
    def op_leave(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        if conn.joining is not None:
            m = conn.joining
            self._drop_joining(m, "left before the round completed")
            self.fx.outbox.append(
                (
                    conn.id,
                    error_header(
                        m.req_id,
                        ERR_RENDEZVOUS,
                        f"join: rank {m.rank} of job {conn.job.name!r} left before round "
                        f"{m.round.number} completed",
                    ),
                    b"",
                )
            )
        member = conn.member
        if member is not None:
            conn.member = None
            self._gone(member, LEFT, "left")
            log.info(
                "job=%s rank=%d event=member_left round=%d", conn.job.name, member.rank, member.round.number
            )
        self.fx.reply(conn, req_id, "leave", self.fx.started)

    def _gone(self, member: Member, state: MemberState, reason: str) -> None:
        member.move(state)
        member.reason = reason
        member.conn = None
        beat, member.beat = member.beat, None
        if beat is not None:
            beat.beat_of = None
            if state is LOST:  # a member that left stops its own beats
                self.fx.closes.append((beat.id, f"rank {member.rank} is lost"))
        rnd = member.round
        rnd.job.progress.forget(member.rank)
        self.live.discard(member)
        self.sessions.pop(member.session, None)
        if rnd.complete:
            rnd.state = RoundState.BROKEN
        if self.fx.durable:
            self.fx.journal.append(["gone", rnd.job.name, rnd.number, member.rank, state.value, reason])

    def lose(self, member: Member, reason: str) -> None:
        """Declare an alive or resuming member lost and tell the others (EV_MEMBER_LOST)."""
        if member.state is not ALIVE and member.state is not RESUMING:
            return
        conn = member.conn
        if conn is not None:
            conn.member = None
        self._gone(member, LOST, reason)
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
            if other is not member and other.state is ALIVE and other.conn is not None:
                self.fx.outbox.append((other.conn.id, event, b""))

    def forget_job(self, job: Job) -> None:
        """The job expired: its members' sessions go with it."""
        if job.round is not None:
            for m in job.round.members.values():
                self.sessions.pop(m.session, None)
                self.live.discard(m)

    def resuming(self, job: Job) -> bool:
        """Whether some member of the job may still re-attach after a restart."""
        return job.round is not None and any(m.state is RESUMING for m in job.round.members.values())

    # -- views
    @staticmethod
    def alive_ranks(job: Job) -> list[int]:
        rnd = job.round
        return [m.rank for m in rnd.members.values() if m.state is ALIVE] if rnd is not None else []

    @staticmethod
    def members_of(job: Job) -> Iterable[Member]:
        rnd = job.round
        return sorted(rnd.members.values(), key=lambda m: m.rank) if rnd is not None else ()

    # -- persistence
    @staticmethod
    def snapshot(job: Job) -> dict[str, Any] | None:
        rnd = job.round
        if rnd is None or not rnd.complete:
            return None
        return {
            "number": rnd.number,
            "world_size": rnd.world_size,
            "broken": rnd.broken,
            "members": [
                [
                    m.rank,
                    m.addrs,
                    m.host,
                    m.session,
                    "alive" if m.state is RESUMING else m.state.value,
                    m.reason,
                ]
                for m in rnd.members.values()
            ],
        }

    def restore_round(
        self, job: Job, number: int, world_size: int, members: list[list[Any]], broken: bool
    ) -> None:
        rnd = Round(job, number, world_size)
        rnd.state = RoundState.BROKEN if broken else RoundState.COMPLETE
        job.round = rnd
        job.next_round = max(job.next_round, number + 1)
        for entry in members:
            rank, addrs, host, session = entry[:4]
            m = Member(rank, addrs, host, rnd)
            m.session = session
            m.state = MemberState(entry[4]) if len(entry) > 4 else ALIVE
            m.reason = entry[5] if len(entry) > 5 else ""
            rnd.members[rank] = m
            if m.state is ALIVE:
                self.sessions[session] = m

    def apply(self, job: Job, rec: Record) -> bool:
        """Replay a rendezvous record (round, gone); False when ``rec`` is not one."""
        kind = rec[0]
        if kind == "round":
            if job.round is not None:
                for m in job.round.members.values():
                    self.sessions.pop(m.session, None)
            self.restore_round(job, rec[2], rec[3], rec[4], False)
        elif kind == "gone":
            rnd = job.round
            if rnd is not None and rnd.number == rec[2] and rec[3] in rnd.members:
                m = rnd.members[rec[3]]
                m.state, m.reason = MemberState(rec[4]), rec[5]
                self.sessions.pop(m.session, None)
                rnd.state = RoundState.BROKEN
        else:
            return False
        return True

    def restored(self, now: float) -> None:
        """After a restore: every member with a session may re-attach within the grace."""
        for m in self.sessions.values():
            m.state = RESUMING
            m.last_seen = now
            self.live.add(m)
