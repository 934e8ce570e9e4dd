"""The coordinator's liveness part: heartbeats, and the once-a-second look at the live members
whose silence may have run out, which declares the silent ones lost and the ones that did not come
back after a restart. Sans-IO; imports _model, _membership, _rounds and aiocoll foundations only.

Each member is looked at when its silence could first exceed the limit (when it was last heard,
plus the limit), not every second: a member heard since is scheduled again for its new time. So a
pass costs the members due in it, and 100,000 members beating steadily are looked at once per
heartbeat timeout each, not once a second.

Silence is measured in time the coordinator could listen: when its own loop stalled (an embedded
coordinator in a rank busy importing torch, a paused VM), the members' heartbeats wait unread in
socket buffers, so the stall is credited to everyone instead of declaring them all lost on waking.
"""

from __future__ import annotations

import heapq
import logging
import math
from typing import Any

from ._membership import Membership
from ._model import Conn, Effects, MemberState
from ._rounds import Member

__all__ = ["HOUSEKEEPING_INTERVAL", "Liveness"]

log = logging.getLogger("aiocoll.server")

# Housekeeping (the members due, and expiry, which walks every job) runs once a second: plenty
# for a 10 s heartbeat timeout.
HOUSEKEEPING_INTERVAL = 1.0

_ALIVE, _RESUMING = MemberState.ALIVE, MemberState.RESUMING

# Members are scheduled in slots of a quarter of a second: a member's silence is noticed at most
# that much after the pass that could first have noticed it.
_SLOTS_PER_SECOND = 4


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
        self._slots: dict[int, list[Member]] = {}  # slot -> members to look at in it (some moved on)
        self._due_slots: list[int] = []  # a heap of the slots in use

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
        that did not re-attach within the grace; look only at the members due by ``now``."""
        membership = self.membership
        live = membership.live
        current = math.floor(now * _SLOTS_PER_SECOND)
        newly, membership.newly_live = membership.newly_live, []
        newly = [m for m in newly if m in live]
        self._schedule(newly, [self._expiry(m) for m in newly], current)  # due: looked at below
        limit, grace = self.heartbeat_timeout, self.resume_grace
        closing: set[int] = set()  # a connection of many silent members is closed once
        slots, due = self._slots, self._due_slots
        # heard since: scheduled again below (two lists, not a tuple each: no garbage to collect)
        not_due: list[Member] = []
        expiries: list[float] = []
        while due and due[0] <= current:
            slot = heapq.heappop(due)
            for m in slots.pop(slot, ()):
                if m.look_at != slot:
                    continue  # scheduled again since, for another slot
                m.look_at = -1
                if m not in live:
                    continue
                expiry = self._expiry(m)
                if now <= expiry:
                    not_due.append(m)
                    expiries.append(expiry)
                elif m.state is _ALIVE:
                    conn = m.conn
                    membership.lose(
                        m, f"silent for {now - expiry + limit:.1f}s (heartbeat timeout {limit:g}s)"
                    )
                    if conn is not None and conn.id not in closing:
                        closing.add(conn.id)
                        self.fx.closes.append(
                            (conn.id, f"rank {m.rank} of job {m.round.job.name!r} went silent")
                        )
                elif m.state is _RESUMING:
                    membership.lose(m, f"did not reconnect within {grace:g}s after the coordinator restarted")
        self._schedule(not_due, expiries, current + 1)

    def _expiry(self, m: Member) -> float:
        """When ``m``'s silence runs out: the heartbeat's limit after it was last heard, or for a
        member restored after a restart, the grace after the restart."""
        if m.state is _RESUMING:
            return m.last_seen + self.resume_grace
        return heard(m) + self.heartbeat_timeout

    def _schedule(self, members: list[Member], expiries: list[float], earliest: int) -> None:
        """Put each member in the slot of the first pass that could find it past its expiry (the
        same place in ``expiries``), and not before slot ``earliest``. Members heard together
        share a slot, so the last slot's list is kept at hand."""
        slots, due = self._slots, self._due_slots
        bucket: list[Member] = []
        bucket_slot = -1
        for m, expiry in zip(members, expiries, strict=True):
            slot = math.ceil(expiry * _SLOTS_PER_SECOND)
            if slot < earliest:
                slot = earliest
            if m.look_at == slot:
                continue
            m.look_at = slot  # an entry left in an earlier slot is skipped there
            if slot != bucket_slot:
                got = slots.get(slot)
                if got is None:
                    got = slots[slot] = []
                    heapq.heappush(due, slot)
                bucket, bucket_slot = got, slot
            bucket.append(m)

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
