"""The coordinator's rendezvous part: forming rounds, the joins that wait for them, the member
table, and refusing joins that contradict a round. Sans-IO; imports _model, _rounds, _tables,
_membership, _events and aiocoll foundations only. A completed round's members go to the membership part
(_membership), which keeps them from then on.

One connection may carry many members: a join names one member (``rank``, ``addrs``, ``host``)
or many (``members``: a host's ranks, joined together by the process that runs them). A
connection's members are lost together when it closes, and hear each event once per connection.
The work of a rendezvous grows with its size N, never N²: a many-member join is answered with its
ranks and sessions only, and reads the addresses it needs as slices of the table (``table`` with
``ranks``), which is encoded once per round, when first asked for.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from aiocoll.protocol._coordinator import ERR_INVALID, ERR_RENDEZVOUS, HEARTBEAT_INTERVAL

from ._events import RANKS_PER_EVENT
from ._membership import Membership
from ._model import Conn, Effects, Job, Refused, error_header, fmt_timeout, timeout_field
from ._rounds import JOINING, LOST, JoinRequest, Member, Round, RoundState
from ._tables import encode_rows, one_member_reply

__all__ = ["MAX_MEMBERS_PER_JOIN", "MAX_WORLD_SIZE", "Rendezvous"]

log = logging.getLogger("aiocoll.server")

MAX_WORLD_SIZE = 1 << 20
MAX_MEMBERS_PER_JOIN = 4096
MAX_ADDRS = 64
MAX_HOST_CHARS = 256
# The heartbeats one round's connections are asked to send per second, at most: past this many
# connections, their join replies name a longer interval (``beat``, up to a third of the
# heartbeat timeout), so that the beats of a 12,500-host job do not outnumber its real requests.
BEATS_PER_SECOND = 2500


def _member_fields(job: Job, rank: object, addrs: object, host: object) -> tuple[int | None, list[Any], str]:
    """One member's fields from a join, checked.

    Raises:
        Refused: naming what is wrong.
    """
    if rank is not None and type(rank) is not int:
        raise Refused(ERR_INVALID, f"job {job.name!r}, rank {rank}: 'rank' must be an integer or None")
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
            ERR_INVALID,
            f"job {job.name!r}, rank {rank}: 'addrs' must be a list of at most {MAX_ADDRS} "
            f"[host, port] pairs",
        )
    if type(host) is not str or len(host) > MAX_HOST_CHARS:
        raise Refused(
            ERR_INVALID,
            f"job {job.name!r}, rank {rank}: 'host' must be a string of at most {MAX_HOST_CHARS} characters",
        )
    return rank, addrs, host


def _who(job: Job, wanted: list[tuple[int | None, list[Any], str]], many: bool) -> str:
    """Who joined, as an error names them (built only for an error: a join is on the hot path)."""
    if many:
        return f"job {job.name!r}, ranks {[w[0] for w in wanted][:16]}"
    return f"job {job.name!r}, rank {wanted[0][0]}"


class Rendezvous:
    """The forming rounds of every job, and the member table of completed ones."""

    def __init__(self, fx: Effects, membership: Membership, heartbeat_timeout: float) -> None:
        self.fx = fx
        self.membership = membership
        self.events = fx.events
        self.heartbeat_timeout = heartbeat_timeout

    def handlers(self) -> dict[str, Any]:
        return {"join": self.op_join, "leave": self.op_leave, "table": self.op_table}

    def disconnect(self, conn: Conn, reason: str) -> None:
        """A connection closed: its join is dropped (its ranks are free again)."""
        if conn.joining is not None:
            self._drop_request(conn.joining, f"connection closed: {reason}")

    def op_join(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        job = conn.job
        world_size = h.get("world_size")
        listed = h.get("members")
        many = listed is not None
        if many:
            if not isinstance(listed, list) or not 1 <= len(listed) <= MAX_MEMBERS_PER_JOIN:
                raise Refused(
                    ERR_INVALID,
                    f"job {job.name!r}: 'members' must be a list of 1..{MAX_MEMBERS_PER_JOIN} "
                    f"[rank, addrs, host]",
                )
            if not all(isinstance(e, list) and len(e) == 3 for e in listed):
                raise Refused(ERR_INVALID, f"job {job.name!r}: each of 'members' must be [rank, addrs, host]")
            wanted = [_member_fields(job, *e) for e in listed]
        else:
            wanted = [_member_fields(job, h.get("rank"), h.get("addrs", []), h.get("host", ""))]
        if type(world_size) is not int or not 1 <= world_size <= MAX_WORLD_SIZE:
            raise Refused(
                ERR_INVALID,
                f"{_who(job, wanted, many)}: 'world_size' must be an integer in 1..{MAX_WORLD_SIZE}, "
                f"got {world_size!r}",
            )
        timeout = timeout_field(h.get("timeout"))
        if conn.joining is not None or conn.members:
            number = (
                conn.joining.members[0].round.number
                if conn.joining is not None
                else conn.members[0].round.number
            )
            raise Refused(
                ERR_RENDEZVOUS,
                f"{_who(job, wanted, many)}: this connection already joined round {number}; one join "
                f"per session",
            )
        if len(wanted) > world_size:
            raise Refused(
                ERR_RENDEZVOUS,
                f"{_who(job, wanted, many)}: {len(wanted)} members for a world of {world_size}",
            )
        rnd = job.round
        if rnd is not None and rnd.complete:
            if not rnd.broken:
                self.events.record(
                    job.name,
                    "join_refused",
                    rnd=rnd.number,
                    ranks=[w[0] for w in wanted[:RANKS_PER_EVENT] if w[0] is not None],
                    detail=f"round {rnd.number} is complete and all its members are alive",
                )
                raise Refused(
                    ERR_RENDEZVOUS,
                    f"{_who(job, wanted, many)}: round {rnd.number} of job {job.name!r} is complete "
                    f"with world size {rnd.world_size} and all its members are alive; a new "
                    f"round opens only after a member leaves or is lost (or use another job id)",
                )
            rnd = None
        if rnd is None:
            rnd = self._open_round(job, world_size)
        elif rnd.world_size != world_size:
            why = (
                f"{_who(job, wanted, many)} asked for world size {world_size}, but round "
                f"{rnd.number} of job {job.name!r} was opened with world size {rnd.world_size} "
                f"(ranks {sorted(rnd.members)[:32]} already joined); every rank must pass the same "
                f"world size"
            )
            self._refuse_join(rnd, conn, req_id, why)
            return
        for rank, _, _ in wanted:
            if rank is not None and not 0 <= rank < world_size:
                self.events.record(
                    job.name,
                    "join_refused",
                    rnd=rnd.number,
                    ranks=[rank],
                    detail=f"rank {rank} is out of range for world size {world_size}",
                )
                raise Refused(
                    ERR_RENDEZVOUS,
                    f"job {job.name!r}: rank {rank} is out of range for world size "
                    f"{world_size} (valid ranks: 0..{world_size - 1})",
                )
        free = world_size - len(rnd.members)
        if len(wanted) > free:
            self._refuse_join(
                rnd,
                conn,
                req_id,
                f"{_who(job, wanted, many)}: {len(wanted)} members joined a round with {free} free ranks",
            )
            return
        now = self.fx.clock()
        request = JoinRequest(conn, req_id, now, timeout, many)
        request.table_in_payload = h.get("table_in_payload") is True
        request.table_ref = h.get("table_ref") is True
        conn.joining = request
        for rank, addrs, host in wanted:
            member = self._place(rnd, rank, addrs, host, conn, req_id)
            if member is None:  # refused: the round's joins, this one's too, were failed
                if conn.joining is request:
                    conn.joining = None
                return
            member.request = request
            member.last_seen = now
            request.members.append(member)
        self.events.record(
            job.name,
            "join",
            rnd=rnd.number,
            ranks=[m.rank for m in request.members[:RANKS_PER_EVENT]],
            count=len(request.members),
            detail=str(world_size),
            total=len(rnd.members),
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "job=%s %s event=join round=%d joined=%d/%d",
                job.name,
                request.ranks(),
                rnd.number,
                len(rnd.members),
                world_size,
            )
        if len(rnd.members) == world_size:
            self._complete(rnd)
        elif timeout is not None:
            request.deadline = now + timeout
            self.fx.push_timer(request.deadline, request, self._expire_join)

    def _place(
        self, rnd: Round, rank: int | None, addrs: list[Any], host: str, conn: Conn, req_id: int
    ) -> Member | None:
        """Put one member into the forming round at ``rank`` (None: the lowest free one); None
        when that contradicts the round (the joins were failed then)."""
        job = rnd.job
        assigned = rank is None
        if rank is None:
            rank = self._take_free_rank(rnd)
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
                f"{rnd.number} (world size {rnd.world_size}) from host {other.host!r}; two "
                f"processes were given the same rank"
            )
            self._refuse_join(rnd, conn, req_id, why)
            return None
        member = Member(rank, addrs, host, rnd)
        member.assigned = assigned
        member.conn = conn
        rnd.members[rank] = member
        return member

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
        rnd.move(RoundState.COMPLETE)
        rnd.job.progress.reset()
        members = list(rnd.members.values())
        # One draw from the OS for every session of the round (a call per member was a fifth of
        # completing a 100,000-member round).
        secrets = os.urandom(16 * len(members)).hex()
        for i, m in enumerate(members):
            m.session = secrets[32 * i : 32 * i + 32]
        if self.fx.durable:
            self.fx.journal.append(
                [
                    "round",
                    rnd.job.name,
                    rnd.number,
                    rnd.world_size,
                    [[m.rank, m.addrs, m.host, m.session] for m in members],
                ]
            )
        now = self.fx.clock()
        requests: dict[int, JoinRequest] = {}  # each join answered once, whatever it brought
        admit = self.membership.admit
        for m in members:
            admit(m, now)
            request = m.request
            assert request is not None and m.conn is not None
            m.request = None
            requests[id(request)] = request
        spread = min(len(requests) / BEATS_PER_SECOND, self.heartbeat_timeout / 3)
        beat = spread if spread > HEARTBEAT_INTERVAL else None
        for request in requests.values():
            conn = request.conn
            conn.joining = None
            conn.members.extend(request.members)
            self._answer_join(request, rnd, beat)
        self.events.record(rnd.job.name, "round_complete", rnd=rnd.number, count=len(members))
        log.info(
            "job=%s event=round_complete round=%d world_size=%d", rnd.job.name, rnd.number, rnd.world_size
        )

    def _answer_join(self, request: JoinRequest, rnd: Round, beat: float | None) -> None:
        """Answer a join of round ``rnd``; ``beat``: the heartbeat interval its session should
        keep, when longer than the usual (a round of many connections)."""
        if request.many:
            # Ranks and sessions only: the addresses it needs, it reads as slices of the table.
            header = {
                "id": request.req_id,
                "ok": True,
                "ranks": [m.rank for m in request.members],
                "sessions": [m.session for m in request.members],
                "world_size": rnd.world_size,
                "round": rnd.number,
            }
            if beat is not None:
                header["beat"] = beat
            self.fx.reply(request.conn, request.req_id, "join", request.started, header)
            return
        m = request.members[0]
        table, digest = rnd.full_table()
        fields = {
            "id": request.req_id,
            "ok": True,
            "rank": m.rank,
            "world_size": rnd.world_size,
            "round": rnd.number,
            "session": m.session,
        }
        if beat is not None:
            fields["beat"] = beat
        head, body = one_member_reply(
            fields, table, digest, ref=request.table_ref, in_payload=request.table_in_payload
        )
        self.fx.reply(request.conn, request.req_id, "join", request.started, head, body)

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
        span = h.get("ranks")
        if span is None:
            table, digest = rnd.full_table()
            self.fx.reply(
                conn,
                req_id,
                "table",
                self.fx.started,
                {"id": req_id, "ok": True, "table_digest": digest},
                table,
            )
            return
        if not (
            isinstance(span, list)
            and len(span) == 2
            and all(type(r) is int for r in span)
            and 0 <= span[0] <= span[1] <= rnd.world_size
        ):
            raise Refused(
                ERR_INVALID, f"'ranks' must be [first, end] within 0..{rnd.world_size}, got {span!r:.100}"
            )
        members = rnd.members
        rows = encode_rows(members[r] for r in range(span[0], span[1]))
        self.fx.reply(conn, req_id, "table", self.fx.started, {"id": req_id, "ok": True}, rows)

    def _refuse_join(self, rnd: Round, refused: Conn, req_id: int, why: str) -> None:
        """Refuse a join that contradicts ``rnd``; the joins already waiting there hear it at
        once (the round cannot complete as the ranks were configured) instead of waiting out
        their timeout. (Not a Refused: that would take back the other members' replies.)"""
        self.fx.fail(refused.id, req_id, "join", self.fx.started, ERR_RENDEZVOUS, f"join: {why}")
        self.events.record(rnd.job.name, "join_refused", rnd=rnd.number, detail=why)
        requests: dict[int, JoinRequest] = {}
        for m in rnd.members.values():
            if m.state is JOINING and m.request is not None:
                requests[id(m.request)] = m.request
        for request in requests.values():
            self._drop_request(request, "another join was refused")
            if request.conn is refused and request.req_id == req_id:
                continue  # the refused join itself: answered above
            self.fx.fail(
                request.conn.id,
                request.req_id,
                "join",
                request.started,
                ERR_RENDEZVOUS,
                f"join: {request.ranks()} of job {rnd.job.name!r}: the rendezvous of round "
                f"{rnd.number} failed because the coordinator refused a join from "
                f"{refused.peer or 'another process'}: {why}. Fix the launch configuration "
                f"and start every rank again",
            )

    def _drop_request(self, request: JoinRequest, why: str) -> None:
        """Take a not-yet-complete join out of its round (its ranks become free again)."""
        if request.conn.joining is request:
            request.conn.joining = None
        for member in request.members:
            if member.state is not JOINING:
                continue
            rnd = member.round
            if rnd.members.get(member.rank) is member:
                del rnd.members[member.rank]
                rnd.free_hint = min(rnd.free_hint, member.rank)
            member.move(LOST)
            member.request = None
        if request.members:
            rnd = request.members[0].round
            log.info(
                "job=%s %s event=join_dropped round=%d reason=%s",
                rnd.job.name,
                request.ranks(),
                rnd.number,
                why,
            )

    def _expire_join(self, request: JoinRequest) -> None:
        rnd = request.members[0].round
        earlier = sorted(rnd.gave_up.difference(rnd.members))  # timed out before this request
        rnd.gave_up.update(m.rank for m in request.members)
        joined = len(rnd.members) + len(earlier)
        absent = [r for r in range(rnd.world_size) if r not in rnd.members and r not in rnd.gave_up][:32]
        self._drop_request(request, "rendezvous timed out")
        had = f"{joined} of {rnd.world_size} ranks had joined"
        if earlier:
            had += f" (rank(s) {earlier[:32]} of them timed out already)"
        self.events.record(
            rnd.job.name,
            "join_timeout",
            rnd=rnd.number,
            ranks=[m.rank for m in request.members[:RANKS_PER_EVENT]],
            count=len(request.members),
            detail=f"{had}; missing {absent}",
        )
        note = self.fx.capacity_note
        meanwhile = f"; meanwhile {note[1]}" if note is not None and note[0] >= request.started else ""
        self.fx.fail(
            request.conn.id,
            request.req_id,
            "join",
            request.started,
            ERR_RENDEZVOUS,
            f"join: rendezvous of job {rnd.job.name!r} round {rnd.number} timed out "
            f"after {fmt_timeout(request.timeout)} for {request.ranks()}: "
            f"{had}; missing ranks {absent} (not all processes started, or they were given another "
            f"world size or job)"
            f"{meanwhile}",
        )

    # -- leaving and loss
    def op_leave(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        request = conn.joining
        if request is not None:
            self._drop_request(request, "left before the round completed")
            number = request.members[0].round.number if request.members else -1
            self.fx.outbox.append(
                (
                    conn.id,
                    error_header(
                        request.req_id,
                        ERR_RENDEZVOUS,
                        f"join: {request.ranks()} of job {conn.job.name!r} left before round {number} "
                        f"completed",
                    ),
                    b"",
                )
            )
        self.membership.leave(conn)
        self.fx.reply(conn, req_id, "leave", self.fx.started)
