"""What the coordinator shows of its jobs (the ``status`` op, ``/jobs``, `aiocoll status`): per
job its round, keys, connections, the progress cross-check's verdict, its recent events
(_events), and its members, at most STATUS_MEMBERS of them (a job of 100,000 ranks must not make
a status request take seconds or megabytes): the ones that matter first (not alive, holding the
job back, reporting progress), then the lowest ranks. Reads the parts it is handed (the jobs,
the membership and progress parts, the events); decides nothing. Imports the server modules of
those parts and aiocoll._host (the hostname of a host identity); never the dispatcher (_state).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiocoll._host import host_label

from ._events import JobEvents
from ._liveness import heard
from ._membership import Membership
from ._model import Job, MemberState
from ._progress_part import Progress

if TYPE_CHECKING:
    from ._rounds import Member

__all__ = ["STATUS_MEMBERS", "no_such_job", "status"]

STATUS_MEMBERS = 256
NAMED_JOBS = 20  # jobs a "no such job" answer names
_ALIVE = MemberState.ALIVE


def status(
    jobs: dict[str, Job],
    membership: Membership,
    progress: Progress,
    events: JobEvents,
    now: float,
    wall: float,
    job: str | None = None,
) -> list[dict[str, Any]]:
    """One entry per job of ``jobs`` (``job``: only that one), at monotonic time ``now`` and
    wall-clock time ``wall``. ``last_seen`` is seconds since the member was last heard from;
    ``members_total``/``members_alive`` count them all, ``members`` lists at most
    STATUS_MEMBERS."""
    out = []
    names = sorted(jobs) if job is None else ([job] if job in jobs else [])
    for name in names:
        j = jobs[name]
        rnd = j.round
        alive = membership.alive_ranks(j)
        held, summary = progress.held_back_by(j, alive)
        shown = _members_to_show(rnd.members if rnd else {}, set(held), j.progress.reporting())
        members = []
        for m in shown:
            seen = heard(m) if m.state is _ALIVE else m.last_seen
            members.append(
                {
                    "rank": m.rank,
                    "host": m.host,
                    "hostname": host_label(m.host),
                    "alive": m.state is _ALIVE,
                    "state": m.state.value,
                    "last_seen": round(now - seen, 3),
                    "reason": m.reason,
                    "progress": j.progress.progress_of(m.rank, now, wall),
                }
            )
        out.append(
            {
                "job": name,
                "world_size": rnd.world_size if rnd else None,
                "round": rnd.number if rnd else None,
                "complete": bool(rnd and rnd.complete),
                "keys": len(j.kv),
                "connections": len(j.conns),
                "members": members,
                "members_total": len(rnd.members) if rnd else 0,
                "members_alive": len(alive),
                "held_back_by": held,
                "summary": summary,
                "progress_reports": j.progress.reports_received,
                "events": events.of(name),
            }
        )
    return out


def no_such_job(jobs: dict[str, Job], job: str) -> str:
    """What a status request for ``job``, which this coordinator does not hold (``jobs``), is
    told: the name, and the jobs it does hold (the first NAMED_JOBS of them, by name)."""
    names = sorted(jobs)
    if not names:
        return f"no such job {job[:200]!r} (this coordinator holds no job)"
    listed = ", ".join(repr(n[:200]) for n in names[:NAMED_JOBS])
    more = f" and {len(names) - NAMED_JOBS} more" if len(names) > NAMED_JOBS else ""
    return f"no such job {job[:200]!r} (this coordinator holds {listed}{more})"


def _members_to_show(members: dict[int, Member], held: set[int], reporting: set[int]) -> list[Member]:
    """All of them, sorted by rank, when they are few; else the ones that matter, then the
    lowest ranks, up to STATUS_MEMBERS (sorted by rank; no sort of the whole round)."""
    if len(members) <= STATUS_MEMBERS:
        return sorted(members.values(), key=lambda m: m.rank)
    chosen: dict[int, Member] = {}
    for m in members.values():
        if m.state is not _ALIVE or m.rank in held or m.rank in reporting:
            chosen[m.rank] = m
            if len(chosen) >= STATUS_MEMBERS:
                break
    rank = 0
    highest = max(members)
    while len(chosen) < STATUS_MEMBERS and rank <= highest:
        at = members.get(rank)
        if at is not None:
            chosen.setdefault(rank, at)
        rank += 1
    return sorted(chosen.values(), key=lambda m: m.rank)
