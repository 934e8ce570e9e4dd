"""What this rank is doing, for the coordinator's progress view, and a record of its last operations.

May import foundations only (aiocoll._errors, aiocoll.protocol), client/_timeline,
client/_recorder and client/_stacks; never the
engine (the engine owns a tracker and hands it its groups) nor the public surface.

Two consumers, two costs:

- The event loop pays one ``record`` per finished operation (a deque append) and a stamp every
  LOOP_STAMP_EVERY seconds. Nothing else: no message, no timer per operation.
- The beat thread (client/control/_beat.py) calls ``report`` about twice a second. It looks at the
  engine's pending operations from outside the loop and returns a ``progress`` report only when
  one has been pending longer than ``threshold`` (AIOCOLL_PROGRESS_AFTER, default 1 s), when the
  event loop itself has not run for that long, when such a report must be withdrawn, or when the
  coordinator asked for a full one. While operations complete quickly it returns None and nothing
  is sent (``reports_sent`` stays 0).

The record of finished operations is the flight recorder's ring: AIOCOLL_FLIGHT_RECORDER
operations (default 2000), each with the call site the engine took (client/_recorder.py, which
also writes the dump, from a thread: when an operation fails with a timeout, a lost peer or a
mismatch, and on SIGUSR1, when AIOCOLL_DUMP_DIR is set).

Reading the engine's state from another thread is safe under the GIL because every container is
copied by a single C call (``list(set)``, ``dict.copy``) before it is walked; a report may be a
moment stale, never torn.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from aiocoll._env import env_int, env_seconds, env_text
from aiocoll._errors import group_name, peer_gone
from aiocoll._signature import REPORTED, describe

from . import _recorder, _stacks
from ._timeline import Timeline, timeline_for_process

__all__ = ["DEFAULT_PROGRESS_AFTER", "HISTORY", "LOOP_STAMP_EVERY", "ProgressTracker", "signature"]

log = logging.getLogger("aiocoll.client.progress")

DEFAULT_PROGRESS_AFTER = 1.0
HISTORY = 64  # operations in the record logged on a timeout (and `done` in reports)
# Failures within this long of a dump are written by one dump, a moment later (a lost peer fails
# every pending operation of its groups at once).
_DUMP_EVERY = 0.2
_DUMPED_OUTCOMES = frozenset({"CollectiveTimeout", "PeerLostError", "MismatchError"})
LOOP_STAMP_EVERY = 0.25
_MAX_OPS = 64  # the coordinator's limit (server/_progress.MAX_OPS)
_SIG_KEYS = REPORTED  # aiocoll._signature: the fields every rank must agree on
_monotonic = time.monotonic


class _Group(Protocol):
    gid: str
    label: str
    index: int
    ranks: tuple[int, ...]
    next_seq: int
    pending: Any  # a set of operations


class _Record(Protocol):
    """What ``done`` reads of an operation (client/data/_op_record.Operation)."""

    @property
    def kind(self) -> str: ...
    @property
    def group(self) -> _Group: ...
    @property
    def seq(self) -> int: ...
    @property
    def sig(self) -> dict[str, Any] | None: ...
    @property
    def started(self) -> float: ...
    @property
    def site(self) -> Any: ...


def signature(kind: str, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The fields of an operation that every rank of its group must agree on, wire-safe."""
    sig: dict[str, Any] = {"kind": str(meta.get("kind", kind)) if meta else kind}
    if meta:
        for key in _SIG_KEYS:
            if key in meta and key != "kind":
                value = meta[key]
                if isinstance(value, (list, tuple)):
                    value = [int(v) for v in value]
                elif value is not None and not isinstance(value, (int, str, float, bool)):
                    value = str(value)
                sig[key] = value
    return sig


class ProgressTracker:
    """One engine's progress: the record of its last operations and the reports for the coordinator.

    Args:
        rank: this process's global rank (for log lines).
        groups: returns the engine's groups (called from the beat thread).
        threshold: seconds an operation may be pending before it is reported (None: the
            AIOCOLL_PROGRESS_AFTER environment variable, else DEFAULT_PROGRESS_AFTER).
    """

    def __init__(
        self,
        rank: int,
        groups: Callable[[], Iterable[_Group]],
        *,
        threshold: float | None = None,
        history: int = HISTORY,
    ) -> None:
        self.rank = rank
        self._groups = groups
        if threshold is None:
            threshold = env_seconds("AIOCOLL_PROGRESS_AFTER", DEFAULT_PROGRESS_AFTER)
        self.threshold = threshold
        # The flight recorder (client/_recorder.py): ``capacity`` operations, their call sites.
        capacity = self.capacity = _recorder.capacity()
        # (kind, group, seq, meta, start, end, outcome, site); start and end are time.monotonic().
        self.history: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=max(history, capacity))
        self.job = env_text("AIOCOLL_JOB") or "default"
        self.dump_dir = _recorder.dump_dir() if capacity else None
        self.dumps = 0  # dumps written
        self._dumped_at = -_DUMP_EVERY
        self._dump_lock = threading.Lock()
        self._dump_due: asyncio.TimerHandle | None = None
        self._failure: str | None = None  # what the next dump says (None: no failure since the last)
        self._reasons: list[str] = []  # every failure so far (the first few): a dump names them all
        self._loop: asyncio.AbstractEventLoop | None = None
        self.loop_stamp = time.monotonic()
        self._stamper: asyncio.TimerHandle | None = None
        self._last_sent: Any = None  # what the last report said (None: nothing reported)
        self.wanted = False  # a peer asked for a full report (store mode; see ask_progress)
        self.reports_sent = 0
        # Where finished operations are also written (client/_timeline.py), when one is kept.
        self.timeline: Timeline | None = timeline_for_process(rank)
        # (group, seq) -> (ranks the coordinator found behind, its message); see ``behind_at``.
        self._behind: collections.OrderedDict[tuple[str, int], tuple[list[int], str]] = (
            collections.OrderedDict()
        )

    # -- on the event loop ----------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Stamp ``loop_stamp`` every LOOP_STAMP_EVERY seconds while the loop runs."""
        self._loop = loop
        _stacks.watch_loop(loop)
        if self.dump_dir is not None:
            _recorder.register(self)

        def stamp() -> None:
            self.loop_stamp = time.monotonic()
            self._stamper = loop.call_later(LOOP_STAMP_EVERY, stamp)

        stamp()

    def stop(self) -> None:
        if self._stamper is not None:
            self._stamper.cancel()
            self._stamper = None
        if self.timeline is not None:
            self.timeline.flush()
        if self._dump_due is not None:
            self._dump_due.cancel()
            self._dump_due = None
        if self._failure is not None:  # failures since the last dump: the final state goes in one
            self._dump_now(self._failure)

    def record(
        self,
        kind: str,
        group: _Group,
        seq: int,
        sig: dict[str, Any] | None,
        start: float,
        outcome: str,
        site: Any = None,
        future: Any = None,
    ) -> None:
        """An operation of ``group`` finished (``outcome``: "ok", "cancelled" or the error's class
        name). ``sig`` is the operation's message meta as given (made wire-safe only when
        reported); ``site`` where it was called (the engine takes it, client/_recorder.site_of
        reads it); ``future`` its future (read only when it failed). With a timeline
        (AIOCOLL_TIMELINE), it is written there too; a timeout, lost peer or mismatch writes the
        dump (AIOCOLL_DUMP_DIR)."""
        end = _monotonic()
        self.history.append((kind, group.gid, seq, sig, start, end, outcome, site))
        if self.timeline is not None:
            self.timeline.add(kind, group.gid, group.label, seq, sig, start, end, outcome, group.index)
        if outcome != "ok" and outcome in _DUMPED_OUTCOMES and self.dump_dir is not None:
            error = future.exception() if future is not None else None
            said = f"{outcome}: {error}" if error is not None else outcome
            self.failed(
                f"{describe(sig or {'kind': kind})} (group {group.label!r}, seq {seq}) failed: {said}"
            )

    def done(self, op: _Record) -> None:
        """``record`` of an operation that succeeded (the commonest: the engine's straight path),
        read off the engine's record of it."""
        end = _monotonic()
        group = op.group
        self.history.append((op.kind, group.gid, op.seq, op.sig, op.started, end, "ok", op.site))
        if self.timeline is not None:
            self.timeline.add(
                op.kind, group.gid, group.label, op.seq, op.sig, op.started, end, "ok", group.index
            )

    def lost_peer(self, rank: int, reason: str, *, left: bool = False) -> None:
        """A peer is lost (or ``left`` while operations here wait for it): one line saying so and
        what follows; the record goes to the dump."""
        if left:
            gone = peer_gone(rank, reason, True)
        else:
            gone = f"lost rank {rank}" + (f" ({reason})" if reason else "")
        line = f"rank {self.rank}: {gone}; the operations of its groups fail with PeerLostError"
        restarts, most = env_int("AIOCOLL_RESTART_COUNT"), env_int("AIOCOLL_MAX_RESTARTS")
        if restarts is not None and most is not None and restarts < most:
            line += f", and the launcher restarts the job (restart {restarts + 1} of {most})"
        if self.dump_dir is not None:
            self.failed(gone)
            line += f"; this rank's record: {_recorder.dump_path(self.dump_dir, self.job, self.rank)}"
        log.warning(line)

    # -- the dump ---------------------------------------------------------------------------
    def failed(self, why: str) -> None:
        """An operation failed: dump now, or with the failures that follow within _DUMP_EVERY."""
        if self.dump_dir is None:
            return
        if why not in self._reasons and len(self._reasons) < 8:
            self._reasons.append(why)
        self._failure = "; ".join(self._reasons)
        if self._dump_due is not None:
            return
        wait = self._dumped_at + _DUMP_EVERY - time.monotonic()
        if wait <= 0 or self._loop is None or self._loop.is_closed():
            self._dump_now(self._failure)
        else:
            self._dump_due = self._loop.call_later(wait, self._dump_later)

    def _dump_later(self) -> None:
        self._dump_due = None
        if self._failure is not None:
            self._dump_now(self._failure)

    def _dump_now(self, reason: str) -> None:
        self._failure = None
        self._dumped_at = time.monotonic()
        # Written from a thread: a dump of 2,000 operations takes tens of milliseconds, which the
        # event loop (the other groups' operations) does not wait for. Not a daemon: a process
        # that ends now still finishes the dump first.
        try:
            threading.Thread(target=self._write, args=(reason,), name="aiocoll-dump").start()
        except RuntimeError:  # the interpreter is shutting down: no new threads
            self._write(reason)

    def _write(self, reason: str) -> None:
        try:
            self.dump(reason)
        except OSError as exc:
            log.warning("rank %d: could not write the flight recorder's dump: %s", self.rank, exc)

    def dump(self, reason: str) -> str | None:
        """Write the dump (AIOCOLL_DUMP_DIR) now; its path, or None when there is no directory.
        Safe from any thread (every container is copied in one call before it is read; one dump
        at a time)."""
        if self.dump_dir is None:
            return None
        with self._dump_lock:
            path = _recorder.write_dump(
                self.dump_dir,
                job=self.job,
                rank=self.rank,
                reason=reason,
                history=list(self.history)[-self.capacity :],
                groups=self._groups(),
                describe=describe,
            )
            self.dumps += 1
        return path

    def note_behind(self, gid: str, seq: int, ranks: Sequence[int], message: str) -> None:
        """The coordinator found ``ranks`` behind at (gid, seq) while others wait there."""
        self._behind[(gid, seq)] = ([int(r) for r in ranks], message)
        while len(self._behind) > HISTORY:
            self._behind.popitem(last=False)

    def behind_at(self, gid: str, seq: int) -> tuple[list[int], str] | None:
        return self._behind.get((gid, seq))

    def log_record(self, why: str) -> None:
        """Log the last operations (kind, group, seq, size, start, end) after a failure."""
        now_mono, now_wall = time.monotonic(), time.time()

        def wall(t: float) -> str:
            stamp = now_wall - (now_mono - t)
            return time.strftime("%H:%M:%S", time.localtime(stamp)) + f".{int(stamp * 1000) % 1000:03d}"

        done = list(self.history)[-HISTORY:]
        pending = [(group, op) for group in list(self._groups()) for op in list(group.pending)]
        head = f"rank {self.rank}: {why}"
        if len(done) > 1:
            head += f"; its last {len(done)} operations, oldest first:"
        elif done:
            head += "; its last operation:"
        elif pending:
            head += "; no operation had finished yet:"
        lines = [head]
        for kind, gid, seq, sig, start, end, outcome, _ in done:
            size = ""
            if sig and sig.get("count") is not None:
                size = f" count={sig['count']}" + (f" dtype={sig['dtype']}" if sig.get("dtype") else "")
            where = f"group={group_name(gid)!r}" + (f" seq={seq}" if seq >= 0 else "")
            took = f"{(end - start) * 1e3:.1f} ms"
            lines.append(f"  {kind} {where}{size} start={wall(start)} end={wall(end)} ({took}) {outcome}")
        for group, op in pending:
            lines.append(
                f"  {op.kind} group={group.label!r} seq={op.seq} start={wall(op.started)} still pending"
            )
        log.warning("\n".join(lines))

    # -- on the beat thread ---------------------------------------------------------------
    def report(self, full: bool = False) -> dict[str, Any] | None:
        """The ``progress`` request's fields, or None when there is nothing to say.

        Args:
            full: the coordinator asked: report every pending operation, however young.
        """
        for _ in range(3):
            try:
                return self._report(full)
            except RuntimeError:  # a container changed while it was read: look again
                continue
        return None

    def _report(self, full: bool) -> dict[str, Any] | None:
        now = time.monotonic()
        threshold = self.threshold
        ops: list[dict[str, Any]] = []
        seqs: dict[str, int] = {}
        for group in list(self._groups()):
            seqs[group.gid] = group.next_seq
            for op in list(group.pending):
                age = now - op.started
                if (age < threshold and not full) or op.future.done() or len(ops) >= _MAX_OPS:
                    continue
                recv = op.outstanding_recv.copy()
                send = op.outstanding_send.copy()
                waits = sorted(
                    {r for r, n in recv.items() if n > 0 and r is not None}
                    | {r for r, n in send.items() if n > 0}
                )
                if recv.get(None, 0) > 0:  # a receive from any source
                    waits = sorted(r for r in group.ranks if r != self.rank)
                ops.append(
                    {
                        "g": group.gid,
                        "n": list(group.ranks),
                        "s": op.seq,
                        "sig": signature(op.kind, op.sig),
                        "st": "waiting" if waits else "running",
                        "w": waits,
                        "age": round(age, 3),
                    }
                )
        stalled = now - self.loop_stamp
        busy = round(stalled, 3) if stalled > threshold + LOOP_STAMP_EVERY else None
        said = (
            tuple((o["g"], o["s"], o["st"], tuple(o["w"])) for o in ops),
            busy is not None,
        )
        if not full and said == (self._last_sent or ((), False)):
            return None  # nothing new: nothing stalled (the fast path), or the same stall as before
        self._last_sent = said
        history = list(self.history)[-HISTORY:]
        done = [[item[1], item[2], signature(item[0], item[3])] for item in history if item[2] >= 0]
        self.reports_sent += 1
        return {"ops": ops, "seqs": seqs, "done": done, "busy": busy}
