"""The coordinator's membership part: the members of completed rounds, once joined: their
sessions and connections, re-attaching after a restart, beat connections, leaving, loss (with the
``member_lost`` event, once per connection), and their part of snapshots and the journal.
Sans-IO; imports _model, _rounds and _events only. Liveness (_liveness) decides when a member went silent
and calls ``lose``; joining (_rendezvous) hands completed rounds' members over with ``admit``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from aiocoll.protocol._coordinator import (
    EV_MEMBER_LOST,
    EV_REFUSED,
    EV_RESTARTED,
    EV_SESSION_LOST,
    LOST_RANKS_PER_EVENT,
    ROLE_WORKER,
)

from ._events import RANKS_PER_EVENT
from ._model import Conn, Effects, Job, MemberState, Record
from ._rounds import ALIVE, JOINING, LEFT, LOST, RESUMING, Member, Round, RoundState

__all__ = ["Membership"]

log = logging.getLogger("aiocoll.server")


class Membership:
    """The joined members of every job.

    Attributes:
        sessions: every alive or resuming member, by its session id.
        live: members alive or resuming (what liveness watches).
    """

    def __init__(self, fx: Effects) -> None:
        self.fx = fx
        self.events = fx.events
        self.sessions: dict[str, Member] = {}
        self.live: set[Member] = set()
        # Members made live since liveness last looked: it schedules their first look.
        self.newly_live: list[Member] = []
        # Members lost since the last ``announce``, by round: (round, members).
        self._lost: dict[int, tuple[Round, list[Member]]] = {}

    def admit(self, m: Member, now: float) -> None:
        """A member of a round that just completed: alive, with its session."""
        self.sessions[m.session] = m
        m.move(ALIVE)
        m.last_seen = now
        self._make_live(m)

    def _make_live(self, m: Member) -> None:
        if m not in self.live:
            self.live.add(m)
            self.newly_live.append(m)

    def resume(self, conn: Conn, session: object, now: float) -> None:
        """A worker connection whose hello names ``session`` (or a list of them: a connection
        that carried many members): re-attach those members, or tell it a session is gone
        (EV_SESSION_LOST)."""
        j = conn.job
        restarted = False
        resumed: list[Member] = []
        for name in session if isinstance(session, list) else [session]:
            member = self.sessions.get(name) if isinstance(name, str) else None
            if member is None or member.round.job is not j or member.state not in (ALIVE, RESUMING):
                why = (
                    "this coordinator does not know that session (it restarted without --state-dir, "
                    "or the session ended)"
                    if member is None or member.round.job is not j
                    else f"the member was already declared {member.state.value}: "
                    f"{member.reason or 'no reason'}"
                )
                log.warning("job=%s event=resume_refused peer=%s reason=%s", j.name, conn.peer, why)
                self.fx.outbox.append((conn.id, {"ev": EV_SESSION_LOST, "reason": why}, b""))
                continue
            old = member.conn
            if old is not None and old is not conn:
                old.members.remove(member)  # its close must not declare the member lost
                self.fx.closes.append((old.id, f"session of rank {member.rank} resumed on a new connection"))
            restarted |= member.state is RESUMING
            if member.state is RESUMING:
                resumed.append(member)
                member.move(ALIVE)
                self.newly_live.append(member)  # its limit is now the heartbeat's, not the grace
            member.conn = conn
            member.last_seen = now
            conn.members.append(member)
            self._make_live(member)
            log.info(
                "job=%s rank=%d event=resumed round=%d peer=%s",
                j.name,
                member.rank,
                member.round.number,
                conn.peer,
            )
        if resumed:
            ranks = [m.rank for m in resumed[:RANKS_PER_EVENT]]
            self.events.record(
                j.name, "resumed", rnd=resumed[0].round.number, ranks=ranks, count=len(resumed)
            )
        if restarted:
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
        if j is not None and role == ROLE_WORKER:
            number = j.round.number if j.round is not None else None
            self.events.record(j.name, "connection_refused", rnd=number, detail=reason, peer=peer)
        rnd = j.round if j is not None else None
        if role != ROLE_WORKER or rnd is None or rnd.complete:
            return
        self.notify_forming([rnd], {"ev": EV_REFUSED, "peer": peer[:300], "reason": reason[:500]})

    def notify_forming(self, rounds: Iterable[Round], event: dict[str, Any]) -> None:
        """Send ``event`` once to each connection with a member waiting in one of ``rounds``."""
        told: set[int] = set()
        for rnd in rounds:
            if rnd.complete:
                continue
            for m in rnd.members.values():
                conn = m.conn
                if m.state is JOINING and conn is not None and conn.id not in told:
                    told.add(conn.id)
                    self.fx.outbox.append((conn.id, event, b""))

    def disconnect(self, conn: Conn, reason: str) -> None:
        """A connection closed: its beat stops counting, its members are lost."""
        beat_of = conn.beat_of
        if beat_of is not None and beat_of.beat is conn:
            beat_of.beat = None  # its closing declares nothing: only silence on both does
        for member in list(conn.members):
            if member.conn is conn:
                self.lose(member, f"connection closed without leave ({reason})")

    # -- join
    def leave(self, conn: Conn) -> None:
        """The connection's members said goodbye."""
        members, conn.members = conn.members, []
        if members:
            ranks = [m.rank for m in members[:RANKS_PER_EVENT]]
            number = members[0].round.number
            self.events.record(conn.job.name, "left", rnd=number, ranks=ranks, count=len(members))
        for member in members:
            self._gone(member, LEFT, "left")
            log.info(
                "job=%s rank=%d event=member_left round=%d", conn.job.name, member.rank, member.round.number
            )

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
            rnd.breaks()
        if self.fx.durable:
            self.fx.journal.append(["gone", rnd.job.name, rnd.number, member.rank, state.value, reason])

    def lose(self, member: Member, reason: str) -> None:
        """Declare an alive or resuming member lost. The others hear of it from ``announce``,
        which the dispatcher calls once its request, tick or closing is handled: the losses of
        one such step (a connection's members, the silent ones of a second) go out together."""
        if member.state is not ALIVE and member.state is not RESUMING:
            return
        conn = member.conn
        if conn is not None and member in conn.members:
            conn.members.remove(member)
        self._gone(member, LOST, reason)
        rnd = member.round
        batch = self._lost.get(id(rnd))
        if batch is None:
            self._lost[id(rnd)] = (rnd, [member])
        else:
            batch[1].append(member)

    def announce(self) -> None:
        """Tell the connections that carry alive members of a round which of its members were
        lost since the last call: one event (EV_MEMBER_LOST) per connection, naming up to
        LOST_RANKS_PER_EVENT of them, so that losing many members costs the size of the round
        once, not once per member."""
        if not self._lost:  # the common call: after every read of requests
            return
        lost, self._lost = self._lost, {}
        outbox = self.fx.outbox
        for rnd, members in lost.values():
            first = members[0]
            if len(members) == 1:
                log.warning(
                    "job=%s rank=%d event=member_lost round=%d reason=%s",
                    rnd.job.name,
                    first.rank,
                    rnd.number,
                    first.reason,
                )
            else:
                log.warning(
                    "job=%s event=members_lost round=%d count=%d ranks=%s reason=%s",
                    rnd.job.name,
                    rnd.number,
                    len(members),
                    [m.rank for m in members[:16]],
                    first.reason,
                )
            ranks = [m.rank for m in members[:RANKS_PER_EVENT]]
            self.events.record(
                rnd.job.name, "lost", rnd=rnd.number, ranks=ranks, count=len(members), detail=first.reason
            )
            event: dict[str, Any] = {
                "ev": EV_MEMBER_LOST,
                "rank": first.rank,
                "reason": first.reason,
                "round": rnd.number,
            }
            if len(members) > 1:
                event["ranks"] = [m.rank for m in members[:LOST_RANKS_PER_EVENT]]
                event["count"] = len(members)
            told: set[int] = set()
            for other in rnd.members.values():
                to = other.conn
                if to is not None and other.state is ALIVE and to.id not in told:
                    told.add(to.id)
                    outbox.append((to.id, event, b""))

    def forget_job(self, job: Job) -> None:
        """The job expired: its members' sessions go with it."""
        self.events.forget(job.name)
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
        rnd.move(RoundState.COMPLETE)  # a snapshot or journal holds only rounds that completed
        if broken:
            rnd.move(RoundState.BROKEN)
        job.round = rnd
        job.next_round = max(job.next_round, number + 1)
        for entry in members:
            rank, addrs, host, session = entry[:4]
            m = Member(rank, addrs, host, rnd)
            m.session = session
            m.restore(MemberState(entry[4]) if len(entry) > 4 else ALIVE)
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
                state = MemberState(rec[4])
                if m.state is not state:
                    m.move(state)
                m.reason = rec[5]
                self.sessions.pop(m.session, None)
                rnd.breaks()
        else:
            return False
        return True

    def restored(self, now: float) -> None:
        """After a restore: every member with a session may re-attach within the grace."""
        for m in self.sessions.values():
            m.move(RESUMING)
            m.last_seen = now
            self._make_live(m)
