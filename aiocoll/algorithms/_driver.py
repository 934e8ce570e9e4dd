"""The one step driver: runs any rank's Schedule over a Transport, for every kind and size.

Imports only foundations (_buffers, _errors, _types, the algorithms' _plan, _schedule and
_transport); never client/ or the public surface. Every operation, a 4-byte all_reduce or a
256 MiB ring, runs here the same way: the caller's own call starts the first step (sends go to
the kernel inline with ``send_nowait``), receives are posted with ``Transport.post_recv`` and
complete through callbacks, and the step whose last transfer completes is finished right in that
callback (reductions, the next step's sends, finally ``done``). No task per operation, no
coroutine per message, no loop iteration per wake-up: what small operations' latency needs.

What large operations need, on the same path: a step's single receive is posted a step early
when its range is free (``_may_prepost``), so a peer running ahead still lands its payload in
place; reduced payloads of at least ``PREPOST_BYTES`` are received with ``post_recv_landed`` (one
that arrived first is reduced where it landed, not copied into scratch); and reductions run in blocks
of ``REDUCE_BLOCK_BYTES``, one block per turn of the loop, so a large one never holds up a read
callback for long. Scratch, views, copies and reductions go through ``Buffers`` (``_buffers``):
the driver never touches numpy, so device memory plugs in as another Buffers implementation.

Every message is tagged ``(*tag, step_id)`` and carries the engine's ``meta`` (the operation's
signature); every received meta is compared with ours, so a mismatched call fails with
MismatchError on the first message instead of hanging or corrupting data.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import aiocoll._signature as _signature

from .._buffers import REDUCE_BLOCK_BYTES, Buffers
from .._errors import MismatchError, group_name
from . import _schedule as S
from ._plan import CollectiveSpec, Prepared, prepare
from ._transport import Tag, Transport

__all__ = ["PREPOST_BYTES", "Context", "Driver", "run_collective", "start_collective"]

PREPOST_BYTES = 32 * 1024
"""Lanes whose first receive is at least this large post each step's receive a step early (when
safe), and reduced receives this large are taken where they landed: a payload that arrives
before its receive is posted costs an extra copy through fresh memory."""

Done = Callable[[BaseException | None], None]


class Context:
    """What one running operation needs at every message: transport, tags, meta, op."""

    __slots__ = (
        "dtype_name",
        "global_ranks",
        "me_global",
        "meta",
        "op",
        "payload",
        "send_nowait",
        "tag",
        "transport",
    )

    def __init__(
        self,
        transport: Transport,
        tag: tuple[Any, ...],
        meta: dict[str, Any],
        global_ranks: Sequence[int],
        me: int,
        prepared: Prepared,
    ) -> None:
        self.transport = transport
        self.tag = tag
        self.meta = meta
        self.global_ranks = global_ranks
        self.me_global = global_ranks[me]
        self.op = prepared.op
        self.dtype_name = prepared.dtype_name
        self.payload = prepared.buffers.payload
        # Bound once: every send of the operation goes through it (see ``start_send``).
        self.send_nowait = transport.send_nowait

    def start_send(self, peer: int, tag: Tag, data: Any) -> Awaitable[None] | None:
        """Start sending ``data`` to group rank ``peer`` as message ``tag`` (the operation's tag
        and the step id) now, inline where the transport can (no task, no loop iteration per
        message); None when the payload was handed off at once, else an awaitable, not started
        yet, that finishes it (``Transport.send_nowait``).

        Raises:
            PeerLostError: the peer is gone (at once, when that is already known).
        """
        return self.send_nowait(self.global_ranks[peer], tag, self.payload(data), self.meta)

    def recv_error(self, src: int, exc: MismatchError) -> MismatchError:
        """The error to raise for a receive from global rank ``src`` that the transport failed
        with ``exc`` (a message of the wrong length): named by whatever differs in the calls."""
        remote = getattr(exc, "remote_meta", None)
        if isinstance(remote, dict) and not _signature.same(remote, self.meta):
            err = self._mismatch(src, remote)
        else:
            err = self._mismatch(src, remote, size_detail=str(exc))
        err.__cause__ = exc
        return err

    def meta_error(self, src: int, remote_meta: dict[str, Any]) -> MismatchError | None:
        """None when global rank ``src``'s signature matches ours, else the MismatchError."""
        if remote_meta == self.meta or _signature.same(remote_meta, self.meta):
            return None
        return self._mismatch(src, remote_meta)

    def _mismatch(self, src: int, remote: Any, size_detail: str | None = None) -> MismatchError:
        group, seq = "", -1
        if len(self.tag) >= 3 and self.tag[0] == "c":
            group, seq = str(self.tag[1]), self.tag[2] if isinstance(self.tag[2], int) else -1
        if isinstance(remote, dict) and not _signature.same(remote, self.meta):
            err = _signature.mismatch(group, seq, {self.me_global: self.meta, src: remote}, self.meta)
            keys = err.fields  # type: ignore[attr-defined]
        else:
            where = f" (group {group_name(group)!r}, seq {seq})" if group else ""
            keys = ["size"]
            message = (
                f"rank {self.me_global} received a message of the wrong size from rank {src}{where} "
                f"during {self.meta.get('kind', 'a collective')} ({size_detail}); the ranks passed "
                "tensors (or split sizes) that do not agree."
            )
            err = MismatchError(message, group=group, seq=seq, ranks=sorted({self.me_global, src}))
        err.local_meta = dict(self.meta)  # type: ignore[attr-defined]
        err.remote_meta = remote  # type: ignore[attr-defined]
        err.fields = keys  # type: ignore[attr-defined]
        return err


def _may_prepost(step: S.Step, nxt: S.Step) -> bool:
    """Whether ``nxt``'s single receive may be posted while ``step`` runs: its payload must not
    land on anything ``step`` receives or reduces into (reduced payloads land in the other
    scratch half, so only direct receives need checking), nor on what ``step`` sends to another
    rank. A range that ``step`` sends to the very peer ``nxt`` receives from is safe: that peer
    receives our step-k message in its own step k and sends its step-k+1 message only after that
    step completed (a lane runs its steps in order, ids increasing), so its payload cannot arrive
    before ours has been handed off whole. Halving-doubling relies on this: each all-gather step
    receives into the range the matching reduce-scatter step sent to the same partner."""
    if len(nxt.recvs) != 1:
        return False
    r = nxt.recvs[0]
    if r.reduce:
        return True
    for s in step.sends:
        if s.buf == r.buf and s.start < r.stop and r.start < s.stop and s.peer != r.peer:
            return False
    for q in step.recvs:
        if q.buf == r.buf and q.start < r.stop and r.start < q.stop:
            return False
    return True


def copies(copies: Sequence[S.Copy], bufs: dict[S.BufRef, Any], buffers: Buffers) -> None:
    for c in copies:
        if c.count:
            buffers.copy(
                buffers.view(bufs[c.dst], c.dst_start, c.dst_start + c.count),
                buffers.view(bufs[c.src], c.src_start, c.src_start + c.count),
            )


class Reduction:
    """One received payload to combine into ``target`` once its step's transfers completed.

    Attributes:
        target: where the result goes. landing: the received values (scratch, or the transport's
        own buffer when the payload arrived before its receive). first: the received values are
        the left operand. count: elements in each.
    """

    __slots__ = ("count", "first", "landing", "target")

    def __init__(self, target: Any, landing: Any, first: bool, count: int) -> None:
        self.target = target
        self.landing = landing
        self.first = first
        self.count = count


class _StepRun:
    """The receives of one step (posted at its start, or a step early) and what is outstanding.

    ``waiting`` counts receives and sends not completed yet, plus one while the step is being
    started, so a message that is already here cannot finish the step before it began."""

    __slots__ = ("reductions", "waiting")

    def __init__(self) -> None:
        self.waiting = 0
        self.reductions: list[Reduction] = []


class Driver:
    """One running collective (see the module docstring); ``done`` is called exactly once unless
    ``stop()`` comes first."""

    __slots__ = ("_ctx", "_done", "_lanes", "_lanes_left", "_prepared", "over")

    def __init__(self, prepared: Prepared, ctx: Context, done: Done) -> None:
        self._prepared = prepared
        self._ctx = ctx
        self._done = done
        self.over = False
        self._lanes: list[_Lane] = []
        self._lanes_left = 0

    def start(self) -> None:
        prepared = self._prepared
        sched = prepared.sched
        if sched.prologue:
            try:
                copies(sched.prologue, prepared.bufs, prepared.buffers)
            except BaseException as exc:
                self.fail(exc)
                return
        if not sched.lanes:
            self._lanes_done()
            return
        self._lanes = [
            _Lane(self, steps, need, first)
            for steps, need, first in zip(sched.lanes, sched.scratch, prepared.first_recv_bytes, strict=True)
        ]
        self._lanes_left = len(self._lanes)
        for lane in self._lanes:
            if self.over:
                return
            lane.run_from(0)

    def stop(self) -> None:
        """The operation was failed from outside (deadline, lost peer, cancellation): do nothing
        more, and drop what is still queued to send (it must not read the caller's memory any
        longer). Posted receives end with ``Transport.discard`` of the operation's tag."""
        self.over = True
        lanes, self._lanes = self._lanes, []  # see lane_done: no cycle outlives the operation
        for lane in lanes:
            lane.abandon()

    def fail(self, exc: BaseException) -> None:
        if self.over:
            return
        self.stop()
        self._done(exc)

    def lane_done(self) -> None:
        self._lanes_left -= 1
        if not self._lanes_left:
            self._lanes_done()
            # Every transfer completed: nothing writes into scratch now. Dropping the lanes also
            # breaks the driver <-> lane reference cycle, so the operation's objects (plan, buffer
            # map, the engine's op and its Work) are freed by reference counting the moment it
            # ends instead of piling up for the cyclic garbage collector: left to it, a small
            # all_reduce cost about 7 us more CPU per operation (collections every ~25 ops).
            lanes, self._lanes = self._lanes, []
            for lane in lanes:
                lane.release_scratch()

    def _lanes_done(self) -> None:
        prepared = self._prepared
        try:
            if prepared.sched.epilogue:
                copies(prepared.sched.epilogue, prepared.bufs, prepared.buffers)
            if prepared.averaged:
                prepared.finish()
        except BaseException as exc:
            self.fail(exc)
            return
        if not self.over:
            self.over = True
            self._done(None)


class _Lane:
    """One lane's steps, in order; each step's receives complete through callbacks."""

    __slots__ = (
        "_buffers",
        "_bufs",
        "_ctx",
        "_current",
        "_driver",
        "_early",
        "_itemsize",
        "_k",
        "_need",
        "_prepost",
        "_reduced",
        "_scratch",
        "_sending",
        "_steps",
    )

    def __init__(
        self,
        driver: Driver,
        steps: Sequence[S.Step],
        need: tuple[int, S.BufRef | None],
        first_recv_bytes: int,
    ) -> None:
        prepared = driver._prepared
        self._driver = driver
        self._ctx = driver._ctx
        self._steps = steps
        self._bufs = prepared.bufs
        self._buffers = prepared.buffers
        self._need, self._reduced = need
        # Reduced ranges all have the arrays' dtype (planned once per signature, as is the size
        # of the first receive).
        self._itemsize = prepared.itemsize
        # Large messages: post step k+1's receive before waiting for step k, so a peer that runs
        # a step ahead still lands its payload in place. Reduced payloads then alternate between
        # two scratch halves (step k's is still being reduced while step k+1's arrives).
        self._prepost = len(steps) > 1 and first_recv_bytes >= PREPOST_BYTES
        # Scratch per parity, allocated when first needed and reused by every later step.
        self._scratch: list[Any] = [None, None]
        self._k = 0
        self._current: _StepRun | None = None
        self._early: _StepRun | None = None
        # Sends the kernel did not take at once (made when first needed: small operations have none).
        self._sending: list[asyncio.Future[None]] | None = None

    def run_from(self, k: int) -> None:
        """Run steps from ``k`` on until one waits for a message (a callback resumes it)."""
        steps = self._steps
        driver = self._driver
        try:
            while k < len(steps):
                step = steps[k]
                self._k = k
                run = self._early
                self._early = None
                tag = (*self._ctx.tag, step.id)
                if run is None:
                    run = _StepRun()
                    run.waiting = 1
                    self._current = run
                    if step.sends:
                        self._start_sends(step, tag, run)
                    self._post(step, tag, k, run)
                else:
                    run.waiting += 1
                    self._current = run
                    if step.sends:
                        self._start_sends(step, tag, run)
                if driver.over:
                    return
                if self._prepost and k + 1 < len(steps) and _may_prepost(step, steps[k + 1]):
                    early = self._early = _StepRun()
                    nxt = steps[k + 1]
                    self._post(nxt, (*self._ctx.tag, nxt.id), k + 1, early)
                    if driver.over:
                        return
                run.waiting -= 1
                if run.waiting:
                    return
                if not self._reduce(run.reductions, 0, 0):
                    return  # handed off; _reduce resumes the lane once done
                k += 1
        except BaseException as exc:
            driver.fail(exc)
            return
        self._current = None
        driver.lane_done()

    def _start_sends(self, step: S.Step, tag: Tag, run: _StepRun) -> None:
        ctx, bufs, view = self._ctx, self._bufs, self._buffers.view
        pending: list[Awaitable[None]] | None = None
        try:
            for s in step.sends:
                aw = ctx.start_send(s.peer, tag, view(bufs[s.buf], s.start, s.stop))
                if aw is not None:
                    if pending is None:
                        pending = []
                    pending.append(aw)
        except BaseException:
            for aw in pending or ():  # abandoned: the operation fails with the error
                if isinstance(aw, Coroutine):
                    aw.close()
                elif isinstance(aw, asyncio.Future):
                    aw.cancel()
            raise
        if pending is None:
            return
        if self._sending is None:
            self._sending = []
        for aw in pending:
            run.waiting += 1
            sending = asyncio.ensure_future(aw)
            self._sending.append(sending)
            sending.add_done_callback(functools.partial(self._on_sent, run))

    def _post(self, step: S.Step, tag: Tag, k: int, run: _StepRun) -> None:
        """Post ``step``'s receives (message ``tag``). Reduced payloads land in scratch (the
        half of ``k``'s parity when receives are posted early); the others straight in their
        destination."""
        ctx, bufs, buffers = self._ctx, self._bufs, self._buffers
        offset = 0
        for r in step.recvs:
            target = buffers.view(bufs[r.buf], r.start, r.stop)
            src = ctx.global_ranks[r.peer]
            run.waiting += 1
            if r.reduce:
                scratch = self._scratch_for(k)
                landing = buffers.view(scratch, offset, offset + (r.stop - r.start))
                offset += r.stop - r.start
                reduction = Reduction(target, landing, r.first, r.stop - r.start)
                run.reductions.append(reduction)
                into = buffers.payload(landing)
                if len(into) >= PREPOST_BYTES:
                    # Large: one that arrived before its receive is reduced where it landed
                    # instead of being copied into scratch first.
                    ctx.transport.post_recv_landed(
                        src, tag, into, functools.partial(self._on_landed, run, reduction, src, into)
                    )
                    if self._driver.over:
                        return
                    continue
            else:
                into = buffers.payload(target)
            ctx.transport.post_recv(src, tag, into, functools.partial(self._on_received, run, src))
            if self._driver.over:
                return

    def _scratch_for(self, k: int) -> Any:
        half = k & 1 if self._prepost else 0
        scratch = self._scratch[half]
        if scratch is None:
            assert self._reduced is not None
            scratch = self._scratch[half] = self._buffers.scratch(self._bufs[self._reduced], self._need)
        return scratch

    # -- completions (callbacks) ------------------------------------------------------------
    def _on_received(
        self, run: _StepRun, src: int, result: tuple[int, dict[str, Any]] | None, exc: BaseException | None
    ) -> None:
        if self._accepted(src, result, exc):
            self._arrived(run)

    def _on_landed(
        self,
        run: _StepRun,
        reduction: Reduction,
        src: int,
        into: memoryview,
        result: tuple[int, dict[str, Any], memoryview] | None,
        exc: BaseException | None,
    ) -> None:
        if not self._accepted(src, result, exc):
            return
        assert result is not None
        landed = result[2]
        if landed is not into:
            reduction.landing = self._buffers.landed(landed, reduction.landing)
        self._arrived(run)

    def _accepted(self, src: int, result: tuple[Any, ...] | None, exc: BaseException | None) -> bool:
        """Whether a receive's outcome from global rank ``src`` lets the operation go on; else it
        fails with the error (named by the signatures where they differ), or was over already."""
        driver = self._driver
        if driver.over:
            return False
        if exc is not None:
            driver.fail(self._ctx.recv_error(src, exc) if isinstance(exc, MismatchError) else exc)
            return False
        assert result is not None
        err = self._ctx.meta_error(src, result[1])
        if err is not None:
            driver.fail(err)
            return False
        return True

    def _on_sent(self, run: _StepRun, fut: asyncio.Future[None]) -> None:
        """A send the kernel did not take at once has finished (or failed, or was cancelled)."""
        sending = self._sending
        if sending and fut in sending:
            sending.remove(fut)
        driver = self._driver
        if driver.over:
            if not fut.cancelled():
                fut.exception()  # retrieved: an abandoned transfer's outcome is no news
            return
        if fut.cancelled():
            driver.fail(asyncio.CancelledError())
            return
        exc = fut.exception()
        if exc is not None:
            driver.fail(exc)
            return
        self._arrived(run)

    def _arrived(self, run: _StepRun) -> None:
        run.waiting -= 1
        if run.waiting or run is not self._current:
            return  # more to come, or a step posted early whose turn has not come
        try:
            if not self._reduce(run.reductions, 0, 0):
                return
        except BaseException as exc:
            self._driver.fail(exc)
            return
        self.run_from(self._k + 1)

    # -- reductions -------------------------------------------------------------------------
    def _reduce(self, reductions: list[Reduction], i: int, at: int) -> bool:
        """Combine the step's landed payloads into their targets, from reduction ``i`` element
        ``at`` on (after the step's transfers completed: a reduced range may also have been the
        payload of one of the step's sends). True when finished here; False when the rest was
        handed to a later turn of the loop (at most REDUCE_BLOCK_BYTES run per turn, so a large
        reduction never holds up a read callback, or anything else, for long)."""
        ctx, buffers = self._ctx, self._buffers
        itemsize = self._itemsize
        budget = REDUCE_BLOCK_BYTES
        left = len(reductions)
        while i < left:
            r = reductions[i]
            if at == 0 and r.count * itemsize <= budget:  # the whole payload in one go
                buffers.reduce_into(ctx.op, r.target, r.landing, ctx.dtype_name, src_first=r.first)
                budget -= r.count * itemsize
                i += 1
            else:
                stop = min(r.count, at + (budget // itemsize or 1))
                buffers.reduce_into(
                    ctx.op,
                    buffers.view(r.target, at, stop),
                    buffers.view(r.landing, at, stop),
                    ctx.dtype_name,
                    src_first=r.first,
                )
                budget -= (stop - at) * itemsize
                if stop < r.count:
                    at = stop
                else:
                    i, at = i + 1, 0
            if budget <= 0 and i < left:
                asyncio.get_running_loop().call_soon(self._reduce_later, reductions, i, at)
                return False
        return True

    def _reduce_later(self, reductions: list[Reduction], i: int, at: int) -> None:
        if self._driver.over:
            return
        try:
            if not self._reduce(reductions, i, at):
                return
        except BaseException as exc:
            self._driver.fail(exc)
            return
        self.run_from(self._k + 1)

    def release_scratch(self) -> None:
        for half, scratch in enumerate(self._scratch):
            if scratch is not None:
                self._scratch[half] = None
                self._buffers.release(scratch)

    # -- stopping ---------------------------------------------------------------------------
    def abandon(self) -> None:
        """Cancel the sends in flight (on the next turn: a send task not started yet would be
        cancelled before its coroutine ever ran, and could not take its frame back out of the
        link's queue). Posted receives end with ``Transport.discard`` of the operation's tag."""
        pending, self._sending = self._sending, None
        if pending:
            call_soon = asyncio.get_running_loop().call_soon
            for fut in pending:
                call_soon(fut.cancel)


def start_collective(
    prepared: Prepared, spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any], done: Done
) -> Driver:
    """Start ``prepared`` now; ``done(None)`` or ``done(error)`` is called exactly once (possibly
    before this returns), unless ``stop()`` is called on the returned driver first."""
    ctx = Context(transport, tuple(tag), meta, spec.ranks, spec.me, prepared)
    driver = Driver(prepared, ctx, done)
    driver.start()
    return driver


async def run_collective(spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any]) -> None:
    """Run one collective operation for this rank, in place on ``spec``'s arrays.

    Args:
        spec: the operation (see CollectiveSpec).
        transport: carries the messages; peers are addressed by global rank.
        tag: the operation's unique tag prefix; message k is tagged ``(*tag, k)``.
        meta: the operation's signature, sent with every message and compared on receipt.
    Raises:
        ValueError: inconsistent spec (arrays, ranks, root, unknown algorithm for the kind).
        TypeError: a reduce op that means nothing for the dtype.
        MismatchError: a peer's signature or message size differs from ours.
        PeerLostError: a peer involved in the operation is gone.
    """
    prepared = prepare(spec, meta)
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def done(exc: BaseException | None) -> None:
        if finished.done():
            return
        if exc is None:
            finished.set_result(None)
        else:
            finished.set_exception(exc)

    driver = start_collective(prepared, spec, transport, tag, meta, done)
    try:
        await finished
    except BaseException:
        # Failed or cancelled: nothing of this operation may be left posted (a late message
        # would land in the caller's memory) or queued.
        driver.stop()
        transport.discard(tuple(tag))
        raise
