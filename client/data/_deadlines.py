"""The engine's deadlines: one loop timer, armed for the earliest deadline of its pending operations,
and the timeout of an operation whose deadline passed, naming the ranks it waited for.

Imports foundations (aiocoll._errors) and the engine's records (client/data/_op_record.py) and
failure handling (client/data/_failures.py: FailureFanout, whose groups' pending operations
expire here and which fails them); never the public surface, and not the engine itself: the engine
owns one ``Deadlines`` (``Engine.deadlines``), gives each operation that does not end inside its
call its deadline (``Engine._promote``) and arms the timer only for a deadline earlier than
``at``. One timer per engine, not one per operation: with the usual single timeout deadlines only
grow, so the hot path arms nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math

from aiocoll._errors import CollectiveTimeout

from ._failures import MAX_STUCK_REPORTS, FailureFanout
from ._op_record import Operation

__all__ = ["Deadlines"]

log = logging.getLogger("aiocoll.client.data.engine")


class Deadlines:
    """One engine's deadline timer, and what happens when it fires.

    Args:
        engine: the engine that owns it: its groups' pending operations are the ones that expire,
            and it fails them (``_break``, ``_abort``) and tells the other ranks (``_tell``).
    """

    def __init__(self, engine: FailureFanout) -> None:
        self._engine = engine
        self._loop = engine._loop
        self._timer: asyncio.TimerHandle | None = None
        self.at = math.inf  # when the timer fires; infinity while it is not armed

    def arm(self, when: float) -> None:
        """Fire at ``when`` (loop time) instead of ``at``."""
        if self._timer is not None:
            self._timer.cancel()
        self.at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def stop(self) -> None:
        """Fire no more (the engine closes)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.at = math.inf

    def _on_timer(self) -> None:
        self._timer = None
        self.at = math.inf
        engine = self._engine
        now = self._loop.time()
        nearest: float | None = None
        expired: list[Operation] = []
        for group in list(engine._groups.values()):
            for op in group.pending:
                if op.deadline is None or op.future.done():
                    continue
                if op.deadline <= now:
                    expired.append(op)
                elif nearest is None or op.deadline < nearest:
                    nearest = op.deadline
        for op in sorted(expired, key=lambda o: o.seq):
            self._expire(op)
        if nearest is not None and not engine._closed:
            self.arm(nearest)

    def _expire(self, op: Operation) -> None:
        """A deadline passed. For a collective, tell the group whom we wait for and fail a moment
        later: a rank waiting on a rank that itself waits (a ring, a tree) then names the rank
        at the end of the chain, the one that never called the operation, not its own neighbour."""
        if op.future.done():
            return
        engine = self._engine
        op.deadline = None
        direct = self._missing_ranks(op)
        if op.seq < 0 or len(op.group.ranks) <= 2 or engine._closed:
            self._fail_timeout(op, direct)
            return
        group = op.group
        stuck = group.stuck.setdefault(op.seq, {})
        while len(group.stuck) > MAX_STUCK_REPORTS:
            del group.stuck[next(iter(group.stuck))]
        stuck[engine.rank] = direct
        meta = {"k": "stuck", "g": group.gid, "s": op.seq, "r": engine.rank, "waits": direct}
        engine._tell(group.ranks, meta)
        grace = min(1.0, max(0.05, 0.1 * (op.timeout or 0.0)))
        self._loop.call_later(grace, self._fail_timeout, op, direct)

    def _fail_timeout(self, op: Operation, direct: list[int]) -> None:
        stuck = op.group.stuck.pop(op.seq, {}) if op.seq >= 0 else {}
        if op.future.done():
            return
        engine = self._engine
        rank = engine.rank
        progress = engine.progress
        # Ranks someone waits for that are not themselves stuck at this seq are the culprits.
        ends = sorted({w for waits in stuck.values() for w in waits if w not in stuck and w != rank})
        missing = ends or direct
        # Progress hook: the members' progress reports, compared, named the ranks behind.
        behind = progress.behind_at(op.group.gid, op.seq) if op.seq >= 0 else None
        if behind is not None:
            missing = behind[0]
            err = CollectiveTimeout(
                op.kind,
                op.group.label,
                op.seq,
                missing,
                op.timeout,
                message=f"{op.describe()}: Timed out after {op.timeout}s; the ranks' progress reports "
                f"show that {behind[1]}",
            )
        else:
            err = CollectiveTimeout(op.kind, op.group.label, op.seq, missing, op.timeout)
        # One log line (the exception tells the rest): what timed out, and the operations before it.
        progress.log_record(f"{op.describe()} timed out after {op.timeout}s waiting for rank(s) {missing}")
        # One rank's failure is every rank's news: the others stop waiting for this one now. They
        # hear what the progress reports showed, if anything: the rest they know.
        if op.seq >= 0 and not engine._closed:
            meta = {
                "k": "gave_up",
                "g": op.group.gid,
                "s": op.seq,
                "r": rank,
                "op": op.kind,
                "waits": missing,
                "t": op.timeout,
                "why": behind[1][:2000] if behind is not None else "",
            }
            engine._tell(op.group.ranks, meta)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d: transport state at the timeout: %r", rank, engine.transport.debug_state())
        # The operation may have exchanged part of its messages, so this rank is no longer in step
        # with the others on this group: break it rather than let a later call match stale data.
        engine._break(op.group, err, from_seq=op.seq if op.seq >= 0 else 0, except_op=op)
        engine._abort(op, err)

    def _missing_ranks(self, op: Operation) -> list[int]:
        rank = self._engine.rank
        others = [r for r in op.group.ranks if r != rank]
        recv = [src for src, n in op.outstanding_recv.items() if n > 0]
        if recv:
            if None in recv:
                return others
            return sorted(r for r in recv if r is not None)
        send = [dst for dst, n in op.outstanding_send.items() if n > 0]
        if send:
            return sorted(send)
        return sorted(op.peers) if op.peers else others
