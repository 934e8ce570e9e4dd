"""Each job's recent events, for the coordinator's page and ``/jobs`` (``events``): ranks joining,
rounds completing, members leaving and lost (with the reason), joins refused or timed out,
connections refused for their token, mismatches and ranks behind. A bounded ring per job
(EVENTS_PER_JOB), kept since the coordinator started (not journalled), forgotten with the job.

Sans-IO and cheap on the hot paths: the parts that decide (_rendezvous, _membership,
_progress_part) record plain fields, and the sentences are written only when a view asks.
Consecutive joins into one round, and consecutive refusals for the same reason, fold into one
event with a count, so a round of 100,000 joins is one line, and an outsider knocking with a
wrong token over and over cannot push the job's real history out of the ring. Imports only the
standard library; the state machine's Effects (_model.py) holds one JobEvents for all jobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

__all__ = ["EVENTS_PER_JOB", "RANKS_PER_EVENT", "JobEvents"]

EVENTS_PER_JOB = 50
RANKS_PER_EVENT = 16  # ranks an event lists; ``count`` says how many there were
DETAIL_CHARS = 500  # an event's reason or message is cut here

# Kinds whose consecutive events fold into one (same kind, round and detail).
_FOLDING = frozenset({"join", "connection_refused", "join_refused"})


class _Event:
    __slots__ = ("count", "detail", "kind", "peer", "ranks", "round", "time", "total")

    def __init__(
        self, time: float, kind: str, rnd: int | None, ranks: list[int], count: int, detail: str
    ) -> None:
        self.time = time
        self.kind = kind
        self.round = rnd
        self.ranks = ranks
        self.count = count
        self.detail = detail
        self.peer = ""
        self.total = 0  # joins: how many ranks the round held after it; its world size is in detail


def _who(ranks: list[int], count: int) -> str:
    if count <= 1 and ranks:
        return f"rank {ranks[0]}"
    listed = ", ".join(map(str, sorted(ranks)))
    if count > len(ranks):
        return f"{count} ranks ({listed}, ...)"
    return f"ranks {listed}"


def _text(e: _Event) -> str:
    who = _who(e.ranks, e.count)
    kind = e.kind
    if kind == "join":
        return f"{who} joined round {e.round} ({e.total} of {e.detail} ranks in)"
    if kind == "round_complete":
        return f"round {e.round} complete: {e.count} ranks"
    if kind == "left":
        return f"{who} left round {e.round}"
    if kind == "lost":
        return f"{who} lost from round {e.round}: {e.detail}"
    if kind == "resumed":
        return f"{who} resumed round {e.round} after a coordinator restart"
    if kind == "join_refused":
        times = f" ({e.count} times)" if e.count > 1 else ""
        return f"join refused{times}: {e.detail}"
    if kind == "join_timeout":
        return f"{who}: rendezvous of round {e.round} timed out; {e.detail}"
    if kind == "connection_refused":
        times = f"{e.count} connections" if e.count > 1 else "a connection"
        return f"{times} trying to join refused ({e.detail}); last from {e.peer or 'an unknown address'}"
    return e.detail  # mismatch, behind: the cross-check's own sentence


class JobEvents:
    """The recent events of every job of one coordinator state.

    Args:
        wall_clock: seconds since 1970, the events' ``time``.
    """

    def __init__(self, wall_clock: Any) -> None:
        self._wall_clock = wall_clock
        self._rings: dict[str, deque[_Event]] = {}

    def record(
        self,
        job: str,
        kind: str,
        *,
        rnd: int | None = None,
        ranks: Iterable[int] = (),
        count: int | None = None,
        detail: str = "",
        peer: str = "",
        total: int = 0,
    ) -> None:
        """Note that ``kind`` happened in ``job`` now, in round ``rnd``. ``ranks``: the ranks it concerns (the
        first RANKS_PER_EVENT are kept); ``count``: how many there were (default: the ranks
        given, at least one); ``detail``: a reason, a message or, for a join, the world size."""
        listed = list(ranks)
        n = count if count is not None else max(1, len(listed))
        detail = detail[:DETAIL_CHARS]
        ring = self._rings.get(job)
        if ring is None:
            ring = self._rings[job] = deque(maxlen=EVENTS_PER_JOB)
        now = self._wall_clock()
        last = ring[-1] if ring else None
        if (
            last is not None
            and kind in _FOLDING
            and (last.kind, last.round, last.detail) == (kind, rnd, detail)
        ):
            last.time = now
            last.count += n
            room = RANKS_PER_EVENT - len(last.ranks)
            if room > 0:
                last.ranks.extend(listed[:room])
        else:
            last = _Event(now, kind, rnd, listed[:RANKS_PER_EVENT], n, detail)
            ring.append(last)
        if peer:
            last.peer = peer[:300]
        if total:
            last.total = total

    def of(self, job: str) -> list[dict[str, Any]]:
        """``job``'s recent events, oldest first: ``time`` (seconds since 1970), ``kind``,
        ``round``, ``ranks``, ``count`` and ``text`` (a sentence)."""
        return [
            {
                "time": round(e.time, 3),
                "kind": e.kind,
                "round": e.round,
                "ranks": sorted(e.ranks),
                "count": e.count,
                "text": _text(e),
            }
            for e in self._rings.get(job, ())
        ]

    def forget(self, job: str) -> None:
        """The job is gone: so is its history."""
        self._rings.pop(job, None)
