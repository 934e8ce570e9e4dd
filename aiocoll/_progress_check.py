"""The cross-check of the ranks' progress reports: what each rank is doing, and whether their calls
at the same (group, seq) disagree or some ranks are behind.

Pure: no sockets, no asyncio, no clock of its own (callers pass ``now``). A foundation module:
imports nothing of aiocoll but _errors (the groups' names in messages) and _signature (the
signature's fields and the one wording of a mismatch), so both sides use the one mechanism. The
coordinator (server/_state.py) keeps one ``JobProgress`` per job and feeds it the ``progress`` reports that
workers send over their beat connection (protocol._coordinator, "Progress"); it turns the
verdicts into ``mismatch`` / ``behind`` events and the ``status`` view into `aiocoll status`
lines. A job that rendezvoused through a store and has no coordinator (the torch backend,
file://) runs the same check on its stalled ranks over reports kept in that store
(client/control/_store_progress.py).

Why: two ranks whose calls disagree but never exchange a message (ranks 0 and 1 in an
all_reduce ring, rank 2 in a broadcast from 0) cannot find out from each other; only someone who
hears every rank can compare what they called at the same (group, seq). Workers report only what
waits longer than a threshold, so this costs nothing while operations complete quickly.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiocoll._signature as _signature

from ._errors import group_name

__all__ = ["MAX_DONE", "MAX_OPS", "JobProgress", "ProgressError", "Verdict", "describe_sig"]

MAX_OPS = 64  # pending operations one report may carry
MAX_DONE = 64  # recently completed collectives one report may carry
MAX_GROUPS = 1024
MAX_GROUP_RANKS = 1 << 20
_MAX_TEXT = 256
# Seconds a stall point waits for the members asked for a report before a mismatch is announced
# with what is known (a rank that never answers must not hold the verdict back).
PATIENCE = 2.0
_SIG_KEYS = _signature.REPORTED


class ProgressError(ValueError):
    """A report that does not follow the protocol (the request is refused, nothing is kept)."""


@dataclass(frozen=True)
class Verdict:
    """What the cross-check found at one (group, seq).

    Attributes:
        kind: "mismatch" (the members called different operations) or "behind" (some members have
            not called it yet while others wait there). group, seq: where. members: the group's
            global ranks (who must hear of it). ranks: the ranks concerned (all disagreeing ranks,
            or the ones behind). message: what to tell the user, naming what each rank called.
    """

    kind: str
    group: str
    seq: int
    members: tuple[int, ...]
    ranks: tuple[int, ...]
    message: str


def _text(value: Any, what: str) -> str:
    if type(value) is not str or len(value) > _MAX_TEXT:
        raise ProgressError(f"{what} must be a string of at most {_MAX_TEXT} characters")
    return value


def _int(value: Any, what: str) -> int:
    if type(value) is not int:
        raise ProgressError(f"{what} must be an integer")
    return value


def _seconds(value: Any, what: str) -> float:
    if type(value) not in (int, float) or not 0 <= value < 1e9:
        raise ProgressError(f"{what} must be a non-negative number of seconds")
    return float(value)


def _ranks(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_GROUP_RANKS or any(type(r) is not int for r in value):
        raise ProgressError(f"{what} must be a list of integer ranks")
    return tuple(value)


def _sig(value: Any) -> tuple[tuple[str, Any], ...]:
    """A signature as a hashable, bounded tuple of the fields that must agree across ranks."""
    if not isinstance(value, dict):
        raise ProgressError("'sig' must be a map")
    out = []
    for key in _SIG_KEYS:
        if key not in value:
            continue
        v = value[key]
        if isinstance(v, list):
            v = _ranks(v, f"sig {key}")
        elif v is not None and type(v) not in (int, str, float, bool):
            raise ProgressError(f"sig {key} has an unexpected type {type(v).__name__}")
        if type(v) is str:
            v = _text(v, f"sig {key}")
        out.append((key, v))
    return tuple(out)


def describe_sig(sig: tuple[tuple[str, Any], ...]) -> str:
    """``all_reduce(dtype=float32, count=4, op=sum)`` for a signature tuple (aiocoll._signature)."""
    return _signature.describe(dict(sig))


class _Op:
    __slots__ = ("age", "group", "members", "seq", "sig", "state", "waiting_for")

    def __init__(self, raw: Any) -> None:
        if not isinstance(raw, dict):
            raise ProgressError("each entry of 'ops' must be a map")
        self.group = _text(raw.get("g"), "op 'g'")
        self.members = _ranks(raw.get("n"), "op 'n'")
        self.seq = _int(raw.get("s"), "op 's'")
        self.sig = _sig(raw.get("sig"))
        state = raw.get("st")
        if state not in ("running", "waiting"):
            raise ProgressError("op 'st' must be 'running' or 'waiting'")
        self.state = state
        self.waiting_for = _ranks(raw.get("w", []), "op 'w'")
        self.age = _seconds(raw.get("age"), "op 'age'")


class _Report:
    """One rank's latest report, as received at ``received`` (the caller's clock)."""

    __slots__ = ("busy", "done", "ops", "received", "seqs", "wall")

    def __init__(self, header: dict[str, Any], received: float, wall: float) -> None:
        ops = header.get("ops", [])
        if not isinstance(ops, list) or len(ops) > MAX_OPS:
            raise ProgressError(f"'ops' must be a list of at most {MAX_OPS} entries")
        self.ops = [_Op(o) for o in ops]
        seqs = header.get("seqs", {})
        if not isinstance(seqs, dict) or len(seqs) > MAX_GROUPS:
            raise ProgressError(f"'seqs' must be a map of at most {MAX_GROUPS} groups")
        self.seqs = {_text(g, "a 'seqs' group"): _int(s, "a 'seqs' value") for g, s in seqs.items()}
        done = header.get("done", [])
        if not isinstance(done, list) or len(done) > MAX_DONE:
            raise ProgressError(f"'done' must be a list of at most {MAX_DONE} entries")
        self.done: dict[tuple[str, int], tuple[tuple[str, Any], ...]] = {}
        for entry in done:
            if not isinstance(entry, list) or len(entry) != 3:
                raise ProgressError("each entry of 'done' must be [group, seq, sig]")
            self.done[(_text(entry[0], "done group"), _int(entry[1], "done seq"))] = _sig(entry[2])
        busy = header.get("busy")
        self.busy = None if busy is None else _seconds(busy, "'busy'")
        self.received = received
        self.wall = wall

    def sig_at(self, group: str, seq: int) -> tuple[tuple[str, Any], ...] | None:
        for op in self.ops:
            if op.group == group and op.seq == seq:
                return op.sig
        return self.done.get((group, seq))


class JobProgress:
    """Every member's latest report for one job, and what the coordinator concluded from them.

    Attributes:
        reports_received: progress reports taken (the no-stall path must leave it at 0).
        wanted: ranks the coordinator wants a full report from (their next beat is answered
            with ``want``).
    """

    def __init__(self) -> None:
        self._reports: dict[int, _Report] = {}
        self._announced: set[tuple[str, int]] = set()
        self._first_seen: dict[tuple[str, int], float] = {}  # when a stall point was first reported
        self.behind: dict[tuple[str, int], tuple[int, ...]] = {}
        self.wanted: set[int] = set()
        self.reports_received = 0
        self.waiting = False  # a stall point waits for reports: ``recheck`` it as time passes

    def reset(self) -> None:
        """A new round: ranks, groups and sequence numbers start over."""
        self._reports.clear()
        self._announced.clear()
        self._first_seen.clear()
        self.behind.clear()
        self.wanted.clear()

    def forget(self, rank: int) -> None:
        self._reports.pop(rank, None)
        self.wanted.discard(rank)

    def update(self, rank: int, header: dict[str, Any], now: float, wall: float) -> list[Verdict]:
        """Take ``rank``'s report and cross-check it against the others'.

        Raises:
            ProgressError: the report is malformed (nothing is kept).
        """
        report = _Report(header, now, wall)
        self.reports_received += 1
        self.wanted.discard(rank)
        # Kept even when nothing waits any more: what it called (seqs, done) serves others' checks.
        self._reports[rank] = report
        return self._check(now)

    def recheck(self, now: float) -> list[Verdict]:
        """Look at the stall points again (a rank asked for a report may never answer)."""
        return self._check(now)

    def _check(self, now: float) -> list[Verdict]:
        self.waiting = False
        verdicts = []
        points: dict[tuple[str, int], tuple[int, ...]] = {}
        for report in self._reports.values():
            for op in report.ops:
                if op.seq >= 0:
                    points.setdefault((op.group, op.seq), op.members)
        for (group, seq), members in sorted(points.items()):
            if (group, seq) in self._announced:
                continue
            seen = self._first_seen.setdefault((group, seq), now)
            while len(self._first_seen) > MAX_GROUPS:
                del self._first_seen[next(iter(self._first_seen))]
            verdict = self._check_point(group, seq, members, now - seen)
            if verdict is not None:
                verdicts.append(verdict)
        return verdicts

    def _check_point(self, group: str, seq: int, members: tuple[int, ...], waited: float) -> Verdict | None:
        seen = self._first_seen[(group, seq)]
        sigs: dict[int, tuple[tuple[str, Any], ...]] = {}
        behind: list[int] = []
        unknown: list[int] = []
        stale: list[int] = []
        for rank in members:
            report = self._reports.get(rank)
            sig = None if report is None else report.sig_at(group, seq)
            if sig is not None:
                sigs[rank] = sig  # what a rank called at a seq never changes: never stale
            elif report is None or report.received < seen:
                stale.append(rank)  # ask for a report made after the stall began
            elif report.seqs.get(group, 0) <= seq:
                behind.append(rank)
            else:
                unknown.append(rank)  # past seq, but its record of it is gone
        if stale and waited < PATIENCE:
            # Wait a moment for every member's report, so the verdict names what each one called.
            self.wanted.update(stale)
            self.waiting = True
            return None
        if len(set(sigs.values())) > 1:
            self._announced.add((group, seq))
            calls = {rank: describe_sig(sig) for rank, sig in sigs.items()}
            message = _signature.mismatch_message(group, seq, calls)
            if behind:
                said, _, advice = message.partition(". Every rank")
                message = f"{said}; rank(s) {behind} had not called it yet. Every rank{advice}"
            return Verdict("mismatch", group, seq, members, tuple(sorted(sigs)), message)
        if stale:
            self.wanted.update(stale)
            self.waiting = True
            return None
        if unknown:
            return None
        if behind:
            self._announced.add((group, seq))
            self.behind[(group, seq)] = tuple(behind)
            while len(self.behind) > MAX_OPS:
                del self.behind[next(iter(self.behind))]
            waiting = sorted(sigs)
            what = describe_sig(next(iter(sigs.values()))) if sigs else "an operation"
            # A rank's ``seqs`` entry is the seq its next call on the group takes: one that equals
            # ``seq`` finished everything before it, so only one further back is worth naming.
            earlier = [(r, self._reports[r].seqs.get(group, 0)) for r in behind]
            last = "".join(
                f"; rank {r} is further back: its next call is seq {at}" for r, at in earlier if at < seq
            )
            return Verdict(
                "behind",
                group,
                seq,
                members,
                tuple(behind),
                f"rank(s) {behind} have not called seq {seq} of group {group_name(group)!r} ({what}), "
                f"which rank(s) {waiting} wait in: they are busy elsewhere or stuck before it{last}",
            )
        return None

    # -- views ------------------------------------------------------------------------------
    def reporting(self) -> set[int]:
        """The ranks whose report is kept (each has something pending, or had)."""
        return set(self._reports)

    def progress_of(self, rank: int, now: float, wall: float) -> list[dict[str, Any]]:
        """`aiocoll status --json`'s ``progress`` list for ``rank``: what it reported waiting in."""
        report = self._reports.get(rank)
        if report is None:
            return []
        out: list[dict[str, Any]] = []
        for op in report.ops:
            since = report.wall - op.age
            out.append(
                {
                    "group": op.group,
                    "group_name": group_name(op.group),  # as messages name it: "world", not "w"
                    "seq": op.seq,
                    "op": describe_sig(op.sig),
                    "state": op.state,
                    "waiting_for": list(op.waiting_for),
                    "since": round(since, 3),
                    "age": round(now - report.received + op.age, 3),
                }
            )
        if report.busy is not None:
            out.append(
                {
                    "group": None,
                    "group_name": None,
                    "seq": None,
                    "op": "event loop busy (not running: a long step on the loop thread)",
                    "state": "slow",
                    "waiting_for": [],
                    "since": round(report.wall - report.busy, 3),
                    "age": round(now - report.received + report.busy, 3),
                }
            )
        return out

    def held_back_by(self, alive: Iterable[int]) -> tuple[list[int], str]:
        """The ranks holding the job back, and a sentence saying why (empty when none)."""
        alive = set(alive)
        waiting: set[int] = set()
        waited_for: dict[int, set[int]] = {}
        busy: list[int] = []
        for rank, report in self._reports.items():
            if report.busy is not None:
                busy.append(rank)
            for op in report.ops:
                waiting.add(rank)
                for w in op.waiting_for:
                    waited_for.setdefault(w, set()).add(rank)
        behind = sorted({r for ranks in self.behind.values() for r in ranks if r not in waiting})
        ends = sorted(r for r in waited_for if r not in waiting or r in busy)
        held = sorted(set(ends) | set(behind) | set(busy))
        if not held:
            if waiting:
                return sorted(waiting), f"rank(s) {sorted(waiting)} wait on each other (see their operations)"
            return [], ""
        reasons = []
        for r in held:
            why = []
            if r in busy:
                why.append("its event loop is busy")
            if r not in alive:
                why.append("it is not alive")
            if r in waited_for:
                why.append(f"rank(s) {sorted(waited_for[r])} wait for it")
            if r in behind:
                why.append("it has not reached the operation the others wait in")
            reasons.append(f"rank {r} ({'; '.join(why) or 'slow'})")
        return held, "held back by " + ", ".join(reasons)
