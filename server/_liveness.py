"""The coordinator's liveness part: heartbeats, and the once-a-second look at every live member
that declares the silent ones lost and the ones that did not come back after a restart. Sans-IO;
imports _model, _membership, _rounds and aiocoll foundations only.

Silence is measured in time the coordinator could listen: when its own loop stalled (an embedded
coordinator in a rank busy importing torch, a paused VM), the members' heartbeats wait unread in
socket buffers, so the stall is credited to everyone instead of declaring them all lost on waking.
"""

from __future__ import annotations

import logging
from typing import Any

from ._membership import Membership
from ._model import Conn, Effects, MemberState
from ._rounds import Member

__all__ = ["HOUSEKEEPING_INTERVAL", "Liveness"]

log = logging.getLogger("aiocoll.server")

# Liveness and expiry scans walk every member and job; once a second is plenty for a 10 s
# heartbeat timeout and keeps a 10,000-member coordinator's housekeeping cheap.
HOUSEKEEPING_INTERVAL = 1.0

_ALIVE, _RESUMING = MemberState.ALIVE, MemberState.RESUMING


def heard(m: Member) -> float:
    """When an alive member was last heard from, on its main or its beat connection, or admitted:
    a member says nothing while its round forms (it waits for the coordinator's answer), so its
    silence counts from the round's completion, not from its join (a round that took longer than
    the heartbeat timeout to form would lose its first members the moment it completed)."""
    seen = m.last_seen
    conn = m.conn
    if conn is not None and conn.last_seen > seen:
        seen = conn.last_seen
    if m.beat is not None and m.beat.last_seen > seen:
        seen = m.beat.last_seen
    return seen


class Liveness:
    """Heartbeats and silence.

    Args:
        fx: where decisions go. membership: whose members are watched.
        heartbeat_timeout: silence after which a member is declared lost.
        resume_grace: seconds restored members get to re-attach.
    """

    def __init__(
        self, fx: Effects, membership: Membership, *, heartbeat_timeout: float, resume_grace: float
    ) -> None:
        self.fx = fx
        self.membership = membership
        self.heartbeat_timeout = heartbeat_timeout
        self.resume_grace = resume_grace
        now = fx.clock()
        self.next_round = now + HOUSEKEEPING_INTERVAL
        self._last_round = now

    def handlers(self) -> dict[str, Any]:
        return {"hb": self.op_hb}

    def op_hb(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        # The connection was heard (request() noted it); a beat connection's member may be asked
        # for a full progress report, and learns the coordinator's wall clock (``t``), from which
        # it estimates its own clock's offset (client/_clock.py).
        member = conn.beat_of
        if member is None:
            self.fx.reply(conn, req_id, "hb", self.fx.started)
            return
        member.last_seen = conn.last_seen
        header: dict[str, Any] = {"id": req_id, "ok": True, "t": self.fx.wall_clock()}
        if member.rank in conn.job.progress.wanted:
            header["want"] = True
        self.fx.reply(conn, req_id, "hb", self.fx.started, header)

    def due(self, now: float) -> bool:
        """Whether a housekeeping round is due; if so, starts it (credits a stall of our own)."""
        if now < self.next_round:
            return False
        stalled = now - self._last_round - HOUSEKEEPING_INTERVAL
        if stalled > self.heartbeat_timeout / 2:
            self._credit_stall(stalled)
        self._last_round = now
        self.next_round = now + HOUSEKEEPING_INTERVAL
        return True

    def check(self, now: float) -> None:
        """Declare lost every member silent for longer than the timeout, and every restored one
        that did not re-attach within the grace."""
        limit = self.heartbeat_timeout
        membership = self.membership
        closing: set[int] = set()  # a connection of many silent members is closed once
        for m in list(membership.live):
            if m.state is _ALIVE:
                conn = m.conn
                seen = heard(m)
                if now - seen > limit:
                    membership.lose(m, f"silent for {now - seen:.1f}s (heartbeat timeout {limit:g}s)")
                    if conn is not None and conn.id not in closing:
                        closing.add(conn.id)
                        self.fx.closes.append(
                            (conn.id, f"rank {m.rank} of job {m.round.job.name!r} went silent")
                        )
            elif m.state is _RESUMING and now - m.last_seen > self.resume_grace:
                membership.lose(
                    m, f"did not reconnect within {self.resume_grace:g}s after the coordinator restarted"
                )

    def _credit_stall(self, seconds: float) -> None:
        credited: set[int] = set()  # a connection carrying many members is credited once
        for m in self.membership.live:
            if m.state is _ALIVE and m.conn is not None:
                m.last_seen += seconds
                for conn in (m.conn, m.beat):
                    if conn is not None and conn.id not in credited:
                        credited.add(conn.id)
                        conn.last_seen += seconds
        log.warning("event=coordinator_stalled seconds=%.1f liveness clocks credited", seconds)
