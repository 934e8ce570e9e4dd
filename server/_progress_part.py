"""The coordinator's progress part: the ``progress`` reports members send on their beat connection,
fed to each job's cross-check (aiocoll._progress_check.JobProgress), its verdicts announced to
the group (``mismatch``, ``behind``), and what holds a job back for the status view (only while
a member still waits). Sans-IO; imports _model, _rendezvous and aiocoll foundations only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiocoll._errors import group_name
from aiocoll._progress_check import ProgressError, Verdict
from aiocoll.protocol._coordinator import ERR_INVALID, EV_BEHIND, EV_MISMATCH

from ._model import Conn, Effects, Job, MemberState, Refused

__all__ = ["Progress"]

log = logging.getLogger("aiocoll.server")


class Progress:
    def __init__(self, fx: Effects) -> None:
        self.fx = fx
        self.events = fx.events
        # Told of each "behind" verdict once announced (the stacks part asks those ranks where
        # they are, and the group hears it).
        self.on_behind: Callable[[Job, Verdict], None] | None = None

    def handlers(self) -> dict[str, Any]:
        return {"progress": self.op_progress}

    def op_progress(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        # A member reports on its beat connection, or on the main one when that carries it alone.
        member = conn.beat_of or (conn.members[0] if len(conn.members) == 1 else None)
        if member is None or member.state is not MemberState.ALIVE:
            raise Refused(ERR_INVALID, "progress: only an alive member of a completed round reports progress")
        member.last_seen = conn.last_seen
        job = conn.job
        try:
            verdicts = job.progress.update(member.rank, h, self.fx.started, self.fx.wall_clock())
        except ProgressError as exc:
            raise Refused(ERR_INVALID, f"progress from rank {member.rank}: {exc}") from None
        self.fx.reply(conn, req_id, "progress", self.fx.started)
        self.settle(job)
        self.announce(job, verdicts)

    def settle(self, job: Job) -> None:
        """Drop the 'behind' verdicts whose stall point no member waits at any more.

        A verdict names the ranks that had not reached an operation others waited in; once
        those waiters' operations completed (their report withdrawn) or the waiters left or were
        lost (their report forgotten), it no longer says anything about the job, and a job whose
        members all left cleanly must not go on saying it is held back.
        """
        progress = job.progress
        unseen = set(progress.behind)
        for rank in progress.reporting() if unseen else ():
            unseen.difference_update((e["group"], e["seq"]) for e in progress.progress_of(rank, 0.0, 0.0))
            if not unseen:
                return
        for point in unseen:
            del progress.behind[point]

    def held_back_by(self, job: Job, alive: Iterable[int]) -> tuple[list[int], str]:
        """The ranks holding ``job`` back and a sentence saying why (empty when none), from the
        members' reports that still stand (the ``status`` view's held_back_by and summary)."""
        self.settle(job)
        return job.progress.held_back_by(alive)

    def recheck(self, jobs: dict[str, Job], now: float) -> None:
        """Stall points waiting for reports whose patience ran out get their verdict."""
        for job in jobs.values():
            if job.progress.waiting:
                self.announce(job, job.progress.recheck(now))

    def announce(self, job: Job, verdicts: list[Verdict]) -> None:
        """Tell every member of the group what the cross-check found (EV_MISMATCH, EV_BEHIND)."""
        rnd = job.round
        if rnd is None:
            return
        for v in verdicts:
            log.warning(
                "job=%s event=%s group=%s seq=%d ranks=%s %s",
                job.name,
                v.kind,
                group_name(v.group),
                v.seq,
                list(v.ranks),
                v.message,
            )
            self.events.record(job.name, v.kind, rnd=rnd.number, ranks=v.ranks, detail=v.message)
            event = {
                "ev": EV_MISMATCH if v.kind == "mismatch" else EV_BEHIND,
                "group": v.group,
                "seq": v.seq,
                "ranks": list(v.ranks),
                "msg": v.message,
            }
            for rank in v.members:
                m = rnd.members.get(rank)
                if m is not None and m.state is MemberState.ALIVE and m.conn is not None:
                    self.fx.outbox.append((m.conn.id, event, b""))
            if v.kind == "behind" and self.on_behind is not None:
                self.on_behind(job, v)
