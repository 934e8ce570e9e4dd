"""The execution engine: per-group sequencing, deadlines, and failure fan-out for every operation.

Imports foundations (aiocoll._errors, aiocoll._work, aiocoll.algorithms._transport), the
client's operation records (client/data/_op_record.py: GroupState, the engine's record, OpTransport;
client/data/_operation.py: the starter shape), its failure handling and control messages
(client/data/_failures.py: FailureFanout, the engine's base), its deadline timer
(client/data/_deadlines.py: Deadlines, which the engine owns) and progress tracking; never the
public surface, and not the algorithms either: a group's provider hands the engine a *starter* (a
function of the operation's tag, transport and finish callback) so the engine stays the one place
that decides *when* and *whether* operations run, not how. A row's straight path (an operation
begun before its record is made: _p2p_row.P2PProvider, _shm_arena.ArenaProvider) asks it first
(``straight_open``, ``next_seq``, ``site``) and ends through it (``ended_at_once``, or
``submit_op``/``went_on`` with the record once it does not end inside its call).

What it guarantees:

- A collective takes its group's next sequence number at call time, so operations match across
  ranks in call order however many are in flight. Its messages are tagged ``("c", group, seq, ...)``;
  point-to-point messages ``("p", group, user_tag)`` take no sequence number.
- Every operation has a deadline, watched by one loop timer per engine (``Deadlines``). When a
  deadline passes, the operation fails with CollectiveTimeout naming the ranks whose messages
  were still outstanding.
- A lost peer (a link closed, or the coordinator's notice) fails at once every pending operation of
  every group containing it, and those groups fail fast afterwards.
- A peer that leaves in order says so first: destroying a group (or closing the process group,
  which destroys every group) sends each other member a control message naming the groups it
  leaves and, for each, the first sequence number it did not complete (``{"k": "left"}``). The
  members fail that group's operations from there on, as PeerLostError with ``left`` set, and
  nothing else: operations the leaver completed complete here too, other groups go on, and so
  does point-to-point with the other members. Its links' goodbye that follows (or a link's
  orderly close without such a message) fails what is still waiting for it.
- A MismatchError detected on one rank is sent to the group's other ranks as a control message
  (tag ``("x",)``), so every rank involved raises it rather than hanging; ranks that completed that
  sequence number already mark the group broken, and their next call names the earlier seq.
- Cancelling a task that awaits a Work never cancels the operation (Work awaits are shielded), so
  the group stays in step on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from aiocoll._errors import DistError, MismatchError, PeerLostError, trim
from aiocoll._work import Work
from aiocoll.algorithms._transport import (
    Tag,
    Transport,
)

from .._progress import ProgressTracker
from .._recorder import call_sites as _call_sites
from .._recorder import caller_site as _caller_site
from .._recorder import code_at as _code_at
from ._deadlines import Deadlines
from ._failures import FailureFanout, for_op, ignore_outcome
from ._op_record import (
    DEFAULT_TIMEOUT,
    FINISHED,
    STARTING,
    GroupState,
    Operation,
    OpTransport,
    Stoppable,
    _describe,
)
from ._operation import Body, Starter, as_starter

__all__ = ["Body", "Engine", "GroupState", "OpTransport", "Operation", "Starter"]

# A process group closed within this long of a mismatch lingers that long before it says goodbye:
# a peer still waiting on this rank must handle the mismatch notice before it sees the goodbye
# (its receive from us would fail with PeerLostError), so every rank raises MismatchError.
_MISMATCH_LINGER = 1.0


class Engine(FailureFanout):
    """Runs operations over one transport for every group of this process.

    Args:
        transport: the job's transport (global ranks).
        default_timeout: seconds for operations called without ``timeout`` (DEFAULT_TIMEOUT; None:
            no deadline); the public layer sets it (ProcessGroup._set_default_timeout).
    """

    def __init__(self, transport: Transport, *, default_timeout: float | None = 1800.0) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.world_size = transport.world_size
        self.default_timeout = default_timeout
        self._groups: dict[str, GroupState] = {}
        self._orphan_notices: dict[str, dict[int, DistError]] = {}
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._leaving = False
        transport.on_peer_lost(self.peer_lost)
        transport.on_stray(self._on_stray)
        self._control = self._loop.create_task(self._control_loop())
        self.deadlines = Deadlines(self)
        # Progress hook: what this rank is doing, for the beat thread's progress reports and the
        # record logged on a failure (client/_progress.py).
        self.progress = ProgressTracker(self.rank, self._groups.values)
        self.progress.start(self._loop)
        # The straight path appends its operation's entry to the tracker's history itself
        # (ProgressTracker.done, without its call) unless a timeline is kept too.
        self._history_add = None if self.progress.timeline is not None else self.progress.history.append
        # Where operations are called from, for the flight recorder (client/_recorder.py): the
        # depths of the user's frames, or (made by the blocking facade) the site it passes along.
        self._sites, self._passed_sites = _call_sites(self.progress.capacity)
        self._recorded_losses: set[int] = set()
        self._lost_first: tuple[int, str] | None = None
        self._mismatch_at = -_MISMATCH_LINGER  # when this rank last failed an op with a mismatch

    # -- groups ----------------------------------------------------------------------------
    def group(self, gid: str, ranks: Sequence[int]) -> GroupState:
        """Register (or return) the group ``gid`` with members ``ranks`` (global ranks)."""
        existing = self._groups.get(gid)
        if existing is not None:
            return existing
        group = GroupState(gid, ranks, self.rank)
        group.loop = self._loop
        group.engine = self
        group.transport = self.transport
        lost = self._lost_ranks() & group.members
        if lost:
            rank = min(lost)
            group.broken = PeerLostError(
                rank, f"rank {rank} was already lost when group {group.label!r} formed"
            )
        notices = self._orphan_notices.pop(gid, None)
        if notices:
            group.notices.update(notices)
            for seq, notice in sorted(notices.items()):
                if group.broken is None and isinstance(notice, PeerLostError):
                    group.broken, group.broken_seq = notice, seq  # a member left it already
        self._groups[gid] = group
        return group

    def forget_group(self, gid: str) -> None:
        """This rank destroys the group ``gid``: tell its other members, then fail what is pending."""
        group = self._groups.get(gid)
        if group is None:
            return
        for task in self._farewell([group], closing=False):
            task.add_done_callback(ignore_outcome)
        del self._groups[gid]
        self._fail_pending(group, DistError(f"group {group.label!r} was destroyed"), from_seq=0)

    # -- submitting ------------------------------------------------------------------------
    def submit(
        self,
        group: GroupState,
        kind: str,
        body: Body,
        *,
        timeout: float | None,
        p2p_tag: Any = None,
        peers: Iterable[int] = (),
        signature: dict[str, Any] | None = None,
    ) -> Work:
        """Start an operation that runs as a task, ``await body(tag, transport)``, whose return
        value the Work completes with: ``submit_eager`` with the body's starter (one lifecycle).

        Args:
            group: where it runs. kind: its name, for errors.
            body: ``await body(tag, transport)`` runs it and returns the Work's result.
            timeout: seconds; None: no deadline.
            p2p_tag: for send/recv, the user's tag (no sequence number is taken); None for
                collectives.
            peers: global ranks the operation talks to (names the culprits when nothing else can).
            signature: kind, root, dtype, count, op as every rank must agree (progress reports).
        Raises:
            the group's failure, when an earlier operation broke it (fail fast).
        """
        return self.submit_eager(
            group, kind, as_starter(body), timeout=timeout, p2p_tag=p2p_tag, peers=peers, signature=signature
        )

    def submit_eager(
        self,
        group: GroupState,
        kind: str,
        start: Starter,
        *,
        timeout: float | None,
        p2p_tag: Any = None,
        peers: Iterable[int] = (),
        signature: dict[str, Any] | None = None,
        retire: bool = True,
    ) -> Work:
        """``submit_op`` of a record made of these fields (an operation with no arrays of its
        own: the starter holds what it runs on). The arguments are ``submit``'s and ``retire``'s
        (see ``submit_op``)."""
        op = Operation(kind, signature or {}, (), (), (), None, timeout)
        if p2p_tag is not None:
            op.p2p_tag = p2p_tag
        op.peers = tuple(peers)
        return self.submit_op(group, op, start, retire)

    def submit_op(
        self,
        group: GroupState,
        op: Operation,
        start: Starter,
        retire: bool = True,
        site: Any = None,
        begun: bool = False,
    ) -> Work:
        """Sequence the operation ``op`` (its record, as the public layer built it) in ``group``,
        start it now and return its Work: every operation's one lifecycle.

        ``start(tag, transport, finish)`` begins it inside this call (a collective of the
        message driver from message callbacks, aiocoll.algorithms._driver; an arena operation;
        a task, ``as_starter``) and arranges ``finish(result, None)`` or ``finish(None, error)``
        exactly once; it returns the operation's runner, whose ``stop()`` the engine calls when
        it fails the operation from outside (a deadline, a lost peer, a mismatch elsewhere).
        One that finishes inside ``start`` takes the straight path: its Work is born complete,
        with no future, pending entry or deadline. ``retire``: False for a collective that sends
        no message under its tag and completes only once every member ran it the same way (a
        shared-memory arena's all_reduce): no message under its tag can come later, so its tag
        is not kept as finished (what reports a message that comes after all as a mismatch).
        ``site``: where it was called, when its caller read it already (``site``: a row's
        straight path that did not end at once); None: read here. ``begun``: a point-to-point
        operation that a row's straight path began once ``straight_open`` said it may, and that
        goes on from there (``start``): it is not refused now for a group that broke meanwhile
        (its message may be consumed already); its end says what happened.

        Raises:
            the group's failure, when an earlier operation broke it (fail fast).
        """
        kind = op.kind
        if self._closed and not begun:
            raise DistError(f"{kind}: the process group is destroyed")
        p2p_tag = op.p2p_tag
        if p2p_tag is None:
            seq = group.next_seq
            if group.broken is not None:
                self._check_usable(group, kind, seq)
            group.next_seq = seq + 1
            tag = ("c", group.gid, seq)
            sig = op.meta or None
        else:
            seq = -1
            tag = ("p", group.gid, p2p_tag)
            sig = None  # (a message's meta is no signature: point-to-point has no sequence)
            if group.broken is not None and not begun:
                self._check_usable(group, kind, seq, op.peers, tag)
        op.seq = seq
        op.group = group
        started = _monotonic()
        if site is None:
            site = self.site()
        if group.notices:  # (a group with notices pending takes the usual path)
            _sequenced(op, tag, sig, started, site, retire)
            return self._start_noticed(op, start)
        # The straight path: nothing can abort an operation that is not pending yet, so its
        # ``lane`` stays None until it ends (FINISHED); the record takes the rest of its fields
        # (``_sequenced``) only if it does not end inside its starter.
        try:
            lane = start(tag, op, op.finish)
        except BaseException as exc:
            _sequenced(op, tag, sig, started, site, retire)
            self._promote(op, None)
            op.lane = STARTING
            op.finish(None, exc)
            if not isinstance(exc, Exception):
                raise
            return op.work
        if op.lane is FINISHED and op.abort_exc is None:
            # Known at once, so no future, no deadline, no pending entry.
            if retire and seq >= 0:  # (a point-to-point tag is the user's, used again)
                self.transport.retire(tag)
            if self._history_add is None:
                _sequenced(op, tag, sig, started, site, retire)
                self.progress.done(op)
            return self.ended_at_once(kind, group, seq, sig, started, site, op.result)
        _sequenced(op, tag, sig, started, site, retire)
        return self._went_on(op, lane)

    def _went_on(self, op: Operation, lane: Stoppable | None) -> Work:
        """The Work of an operation, its record complete (``_sequenced``), that did not end well
        inside its call: still running (``lane``, its runner), or failed there."""
        if op.lane is FINISHED:  # failed inside its starter
            failure = op.abort_exc
            op.abort_exc = None
            self._promote(op, None)
            self._settle(op, None, failure)
            self._finish(op)
            return op.work
        self._promote(op, STARTING if lane is None else lane)  # (a starter returns its runner)
        return op.work

    def next_seq(self, group: GroupState) -> int:
        """The sequence number of a collective begun on a row's straight path (see
        ``straight_open``), taken as ``submit_op`` takes it."""
        seq = group.next_seq
        group.next_seq = seq + 1
        return seq

    def went_on(
        self,
        group: GroupState,
        op: Operation,
        seq: int,
        started: float,
        site: Any,
        retire: bool,
        lane: Stoppable | None,
        failure: BaseException | None,
    ) -> Work:
        """The Work of a collective begun on a row's straight path (providers' ArenaProvider)
        that did not end well inside its call, once its record ``op`` is made: what
        ``submit_op`` gives one of its own that went on (``lane``: its runner), or that failed
        there (``failure``)."""
        op.seq = seq
        op.group = group
        _sequenced(op, ("c", group.gid, seq), op.meta or None, started, site, retire)
        if failure is not None:
            op.lane = FINISHED
            op.abort_exc = failure
        return self._went_on(op, lane)

    def site(self) -> Any:
        """Where the operation being submitted was called, for the flight recorder
        (client/_recorder.CallSites): the user's frame at the depth a direct call found, read
        (not made) and not kept; through the blocking facade, the line that called the facade;
        None when the recorder is off. Called by ``submit_op`` and by a row's straight path
        (P2PProvider, ArenaProvider), both three frames below the user's call: the API's method,
        the table's, and theirs."""
        sites = self._sites
        if sites is not None:
            try:
                site = _code_at(_getframe(sites.depth))
                if site[0] is not sites.code:  # (a loop calls from one function: checked once)
                    if id(site[0]) in sites.passed:  # aiocoll's frame: this call came another way
                        raise LookupError
                    sites.code = site[0]
                return site
            except (LookupError, ValueError):  # the first call, or another way: a walk
                return sites.first()
        if self._passed_sites:
            return _caller_site()
        return None

    def straight_open(self, group: GroupState) -> bool:
        """Whether an operation of ``group`` may begin without a record (a row's straight path:
        P2PProvider, ArenaProvider) and end by ``ended_at_once``: the engine is
        open, the group sound with no notices pending, and the recorder keeps no timeline
        (which reads records). Otherwise it is submitted as usual (``submit_op``), which also
        says what is wrong."""
        return (
            self._history_add is not None and group.broken is None and not group.notices and not self._closed
        )

    def ended_at_once(
        self, kind: str, group: GroupState, seq: int, sig: Any, started: float, site: Any, result: Any
    ) -> Work:
        """The Work of an operation that ended inside its call (``submit_op``'s straight path, a
        row's): born complete with ``result``, with no future, deadline or pending entry; its
        entry in the recorder's history (ProgressTracker.done's) unless ``submit_op`` gave the
        tracker its record (a timeline is kept)."""
        add = self._history_add
        if add is not None:
            add((kind, group.gid, seq, sig, started, _monotonic(), "ok", site))
        # (described by a function of its name, not the record: a Work the caller keeps would
        # keep the record's arrays, a staged copy among them)
        return _born(result, self._loop, _partial(_describe, kind, group, seq))

    def _start_noticed(self, op: Operation, start: Starter) -> Work:
        """``submit_op``'s usual path, for a group with failure notices pending: ``op`` is
        registered (pending, with its deadline) before it starts, or fails at once when its
        sequence number was said mismatched already."""
        seq = op.seq
        notice = op.group.notices.pop(seq, None) if seq >= 0 else None
        if notice is not None:  # said mismatched already: not registered, never started
            self._promote(op, None)
            op.future.set_exception(notice)
            return op.work
        self._promote(op, STARTING)  # pending, with its deadline, while it starts
        if op.lane is FINISHED:  # (failed at once: its group broke)
            return op.work
        try:
            lane = start(op.tag, op, op.finish)
        except BaseException as exc:
            op.finish(None, exc)
            if not isinstance(exc, Exception):
                raise
            return op.work
        if op.lane is STARTING:
            op.lane = lane
        elif op.abort_exc is not None:  # failed from outside while starting: stop its runner
            lane.stop()
        # else it finished by itself inside the call: its runner is over, nothing to stop
        return op.work

    def _promote(self, op: Operation, lane: Stoppable | None) -> None:
        """Give an operation of the straight path what every other has (a future, its Work; a
        pending entry and a deadline when it is still running, ``lane`` its runner)."""
        op.future = fut = self._loop.create_future()
        op.work = Work(fut, op.describer())
        if lane is None:
            return
        op.lane = lane
        group = op.group
        group.pending.add(op)
        timeout = op.timeout
        if timeout is DEFAULT_TIMEOUT:
            op.timeout = timeout = self.default_timeout
        if timeout is not None:
            op.deadline = deadline = self._loop.time() + timeout
            if deadline < self.deadlines.at:
                self.deadlines.arm(deadline)
        broken = group.broken
        if broken is not None and op.seq >= group.broken_seq:
            # the group broke while it started (nothing could fail it then): fail it now
            self._abort(op, for_op(broken, op))

    def _settle(self, op: Operation, result: Any, exc: BaseException | None) -> None:
        """Complete ``op``'s future with its outcome, and carry a failure to the group: a
        mismatch is named, told to the other ranks and breaks the group from its seq; a lost peer
        breaks the whole group."""
        fut = op.future
        if exc is None:
            if not fut.done():
                fut.set_result(result)
            return
        if type(exc) is asyncio.CancelledError:  # its task, cancelled from outside the engine
            exc = DistError(f"{op.describe()} was cancelled: the process group is closing")
        if isinstance(exc, MismatchError):
            if op.seq < 0:
                # A point-to-point message of the wrong dtype or size was consumed whole: the
                # streams stay in step, so only this receive fails.
                if not fut.done():
                    fut.set_exception(exc)
                return
            err = self._name_mismatch(op, exc)
            if not fut.done():
                fut.set_exception(err)
            self._notify_mismatch(op, err)
            self._break(op.group, err, from_seq=op.seq, except_op=op)
            return
        if isinstance(exc, PeerLostError):
            self._note_lost(exc)
            if not fut.done():
                fut.set_exception(for_op(exc, op))  # names the operation that failed
            self._break(op.group, exc, from_seq=0, except_op=op)
            return
        if not fut.done():
            fut.set_exception(trim(exc) if isinstance(exc, DistError) else exc)

    def _finish(self, op: Operation, succeeded: bool = False) -> None:
        """End ``op``, whose future is done (``succeeded``: with a result, said by the caller)."""
        op.work.wake()  # the awaiting task resumes in the next iteration, not the one after
        op.group.pending.discard(op)
        # Progress hook: the record of the last operations (logged on a failure)
        if succeeded:
            self.progress.done(op)
        else:
            fut = op.future
            outcome = "ok"
            if fut.done():
                if fut.cancelled():
                    outcome = "cancelled"
                else:
                    failure = fut.exception()
                    if failure is not None:
                        outcome = type(failure).__name__
            self.progress.record(op.kind, op.group, op.seq, op.sig, op.started, outcome, op.site, fut)
            if outcome != "ok":
                if op.seq >= 0:
                    self.transport.discard(op.tag)
                return
        if op.seq >= 0 and op.retires:
            # Every message of a collective is consumed when all ranks agree; one that is left
            # over (or arrives later) means some rank called something else (a root mismatch, say,
            # where the disagreeing ranks only send).
            self.transport.retire(op.tag)

    def _abort(self, op: Operation, exc: BaseException) -> None:
        """Fail ``op`` now (its Work completes at once) and stop its body."""
        if op.future.done():
            return
        op.abort_exc = exc
        op.future.set_exception(exc)
        lane = op.lane
        # Stop its runner before its receives are discarded (their callbacks then find it
        # stopped), and finish it here, once (a runner's late outcome is ignored).
        if lane is not FINISHED:
            op.lane = FINISHED
            if lane is not None:
                lane.stop()
            self._finish(op)

    # -- closing ---------------------------------------------------------------------------
    async def aclose(self) -> None:
        """Fail every pending operation and stop; the transport is closed by its owner."""
        if self._closed:
            return
        linger = self._mismatch_at + _MISMATCH_LINGER - _monotonic()
        if linger > 0:
            await asyncio.sleep(linger)
        self._leaving = True  # a peer that closed meanwhile may refuse the farewell: not a loss to log
        farewell = self._farewell(list(self._groups.values()), closing=True)
        if farewell:  # on the wire before the links' goodbye (bounded: a peer may be gone)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*farewell, return_exceptions=True), 1.0)
        self._closed = True
        self.progress.stop()
        for group in list(self._groups.values()):
            self._fail_pending(group, DistError(f"group {group.label!r} was destroyed"), from_seq=0)
        self.deadlines.stop()
        self._control.cancel()
        try:
            await self._control
        except (asyncio.CancelledError, Exception):
            pass


def _sequenced(op: Operation, tag: Tag, sig: Any, started: float, site: Any, retire: bool) -> None:
    """The fields ``Engine.submit_op`` found that the record of an operation that did not end
    inside its starter carries (its later end, failure and progress reports read them)."""
    op.tag = tag
    op.sig = sig
    op.started = started
    if site is not None:
        op.site = site
    if not retire:
        op.retires = False


_monotonic = time.monotonic
_getframe = sys._getframe
_partial = functools.partial
_born = Work.born
