"""The coordinator's stacks part: each rank's Python stack as it is now, on request.

`aiocoll status --stacks` sends ``stacks`` (admin, read-only); the coordinator pushes EV_STACK to
the beat connection of every alive member asked for, whose thread (client/control/_beat.py) answers with
``stack`` even while the rank's event loop is blocked. The ``stacks`` request is answered once
every member answered, or after STACK_WAIT seconds with the silent ranks named in ``missing``.
The status view (`/jobs`, the web page) shows the last stack of each rank holding a job back,
and asks those ranks again when what it has is older than FRESH seconds. When the progress
cross-check finds ranks behind, they are asked too, and the group hears the verdict again with
where they are (``ask_behind``): the waiting ranks' CollectiveTimeout then names those lines.

Sans-IO; imports _model, the protocol constants and aiocoll._progress_check (Verdict) only.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from aiocoll._progress_check import Verdict
from aiocoll.protocol._coordinator import ERR_INVALID, EV_BEHIND, EV_STACK

from ._model import Conn, Effects, Job, MemberState, Refused

__all__ = ["BEHIND_WAIT", "FRESH", "MAX_FRAMES", "STACK_WAIT", "Stacks"]

STACK_WAIT = 1.0  # seconds a rank has to answer
BEHIND_WAIT = 3.0  # ... when the cross-check asks where the ranks behind are (nobody waits on it)
FRESH = 3.0  # seconds a stack shown beside a rank holding a job back stays current
MAX_FRAMES = 64
_MAX_TEXT = 300
_MAX_QUERIES = 64  # queries in flight at once (each waits at most STACK_WAIT)


class _Query:
    """One ``stacks`` request (or a refresh for the status view, with no one to answer)."""

    __slots__ = ("answers", "asker", "job", "qid", "ranks", "req_id", "started", "verdict", "waiting")

    def __init__(
        self, qid: int, job: str, ranks: list[int], asker: Conn | None, req_id: int, now: float
    ) -> None:
        self.verdict: Verdict | None = None  # a "behind" verdict to tell again, with where they are
        self.qid = qid
        self.job = job
        self.ranks = ranks
        self.asker = asker
        self.req_id = req_id
        self.started = now
        self.answers: dict[int, list[dict[str, Any]]] = {}
        self.waiting = True


class _Later:
    """A "behind" verdict whose ranks are asked where they are at the next tick."""

    __slots__ = ("job", "verdict", "waiting")

    def __init__(self, job: Job, verdict: Verdict) -> None:
        self.job = job
        self.verdict = verdict
        self.waiting = True


def _frames(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise Refused(ERR_INVALID, "stack: 'frames' must be a list")
    out = []
    for frame in value[:MAX_FRAMES]:
        if not isinstance(frame, dict):
            raise Refused(ERR_INVALID, "stack: each frame must be a map of file, line and function")
        line = frame.get("line")
        out.append(
            {
                "file": str(frame.get("file", "?"))[:_MAX_TEXT],
                "line": line if type(line) is int else 0,
                "function": str(frame.get("function", "?"))[:_MAX_TEXT],
            }
        )
    return out


class Stacks:
    def __init__(self, fx: Effects, jobs: dict[str, Job]) -> None:
        self.fx = fx
        self.jobs = jobs
        self._ids = itertools.count(1)
        self.queries: dict[int, _Query] = {}
        # (job, rank) -> (clock value, frames) of the last answer; (job, rank) -> clock value of
        # the last ask (the status view asks a rank at most every FRESH seconds).
        self.latest: dict[tuple[str, int], tuple[float, list[dict[str, Any]]]] = {}
        self._asked: dict[tuple[str, int], float] = {}

    def handlers(self) -> dict[str, Any]:
        return {"stacks": self.op_stacks, "stack": self.op_stack}

    # -- asking ------------------------------------------------------------------------------
    def op_stacks(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        name = h.get("job", conn.job.name)
        if type(name) is not str or name not in self.jobs:
            raise Refused(ERR_INVALID, f"stacks: no such job {str(name)[:200]!r}")
        ranks = h.get("ranks")
        if ranks is not None and (not isinstance(ranks, list) or not all(type(r) is int for r in ranks)):
            raise Refused(ERR_INVALID, "stacks: 'ranks' must be a list of integer ranks")
        if len(self.queries) >= _MAX_QUERIES:
            raise Refused(ERR_INVALID, "stacks: too many stack requests in flight; ask again in a second")
        self._ask(self.jobs[name], ranks, conn, req_id)

    def ask_behind(self, job: Job, verdict: Verdict) -> None:
        """The cross-check found ``verdict.ranks`` behind: ask them where they are, and tell the
        group the verdict again with their call sites (a CollectiveTimeout then names them)."""
        if verdict.kind == "behind":
            # Asked at the next tick, not inside the request that completed the verdict: that
            # request's answer comes first on its connection.
            self.fx.push_timer(self.fx.clock(), _Later(job, verdict), self._ask_later)

    def _ask_later(self, later: _Later) -> None:
        later.waiting = False
        if len(self.queries) < _MAX_QUERIES and self.jobs.get(later.job.name) is later.job:
            self._ask(later.job, later.verdict.ranks, None, 0, BEHIND_WAIT).verdict = later.verdict

    def _ask(
        self,
        job: Job,
        ranks: Iterable[int] | None,
        asker: Conn | None,
        req_id: int,
        wait: float = STACK_WAIT,
    ) -> _Query:
        now = self.fx.clock()
        rnd = job.round
        members = rnd.members if rnd is not None else {}
        wanted = sorted(members) if ranks is None else sorted({r for r in ranks if r in members})
        query = _Query(next(self._ids), job.name, wanted, asker, req_id, now)
        for rank in wanted:
            member = members[rank]
            if member.state is MemberState.ALIVE and member.beat is not None:
                self.fx.outbox.append((member.beat.id, {"ev": EV_STACK, "q": query.qid}, b""))
                self._asked[(job.name, rank)] = now
        self.queries[query.qid] = query
        self.fx.push_timer(now + wait, query, self._expire)
        return query

    def _expire(self, query: _Query) -> None:
        self._answer(query)

    def _answer(self, query: _Query) -> None:
        query.waiting = False
        self.queries.pop(query.qid, None)
        if query.verdict is not None:
            self._tell_where(query, query.verdict)
        if query.asker is None:
            return
        missing = [r for r in query.ranks if r not in query.answers]
        header = {
            "id": query.req_id,
            "ok": True,
            "stacks": {str(r): frames for r, frames in sorted(query.answers.items())},
            "missing": missing,
            "wait": STACK_WAIT,
        }
        self.fx.reply(query.asker, query.req_id, "stacks", query.started, header)

    def _tell_where(self, query: _Query, verdict: Verdict) -> None:
        sites = [
            f"rank {rank} at {frames[0]['file']}:{frames[0]['line']} in {frames[0]['function']}"
            for rank, frames in sorted(query.answers.items())
            if frames
        ]
        job = self.jobs.get(query.job)
        rnd = job.round if job is not None else None
        if not sites or rnd is None:
            return
        event = {
            "ev": EV_BEHIND,
            "group": verdict.group,
            "seq": verdict.seq,
            "ranks": list(verdict.ranks),
            "msg": f"{verdict.message}; where they are now: {', '.join(sites)}",
        }
        for rank in verdict.members:
            member = rnd.members.get(rank)
            if member is not None and member.state is MemberState.ALIVE and member.conn is not None:
                self.fx.outbox.append((member.conn.id, event, b""))

    # -- answers -----------------------------------------------------------------------------
    def op_stack(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        member = conn.beat_of
        if member is None:
            raise Refused(ERR_INVALID, "stack: only a member's beat connection answers a stack request")
        frames = _frames(h.get("frames"))
        now = self.fx.clock()
        name = conn.job.name
        self.latest[(name, member.rank)] = (now, frames)
        self.fx.reply(conn, req_id, "stack", self.fx.started)
        qid = h.get("q")
        query = self.queries.get(qid) if type(qid) is int else None
        if query is None or not query.waiting or query.job != name:
            return  # late: its asker was answered already
        query.answers[member.rank] = frames
        if len(query.answers) >= len(query.ranks):
            self._answer(query)

    # -- the status view ---------------------------------------------------------------------
    def annotate(self, views: list[dict[str, Any]]) -> None:
        """Give each member holding a job back the last stack it sent (``stack``, with its age in
        ``stack_age``), and ask again those whose stack is older than FRESH."""
        now = self.fx.clock()
        for view in views:
            held = set(view.get("held_back_by") or ())
            if not held:
                continue
            name = view["job"]
            stale = []
            for member in view["members"]:
                rank = member["rank"]
                if rank not in held:
                    continue
                known = self.latest.get((name, rank))
                if known is not None:
                    member["stack"] = known[1]
                    member["stack_age"] = round(now - known[0], 3)
                if (known is None or now - known[0] > FRESH) and now - self._asked.get(
                    (name, rank), -FRESH
                ) > FRESH:
                    stale.append(rank)
            job = self.jobs.get(name)
            if stale and job is not None and len(self.queries) < _MAX_QUERIES:
                self._ask(job, stale, None, 0)

    def forget_job(self, name: str) -> None:
        for key in [k for k in self.latest if k[0] == name]:
            del self.latest[key]
        for key in [k for k in self._asked if k[0] == name]:
            del self._asked[key]
