"""The eager runner: small single-lane schedules driven by message callbacks, without a task.

Imports only foundations (the executor's helpers, _schedule, _transport). Why it exists: a
4-byte all_reduce is latency, and over loopback the bare exchange costs about 14 µs while a task
per operation, a coroutine per receive and a loop iteration per wake-up cost several times that.
Here the caller's own call starts the first step (its sends go to the kernel inline), every
receive is posted with ``Transport.post_recv``, and the step whose last message lands is finished
right in the transport's read callback: reductions, the next step's sends, and finally ``done``.

Semantics are the executor's: same schedules, tags ``(*tag, step_id)``, signatures compared on
every message, reductions after a step's transfers, prologue and epilogue copies. Only schedules
with at most one lane and messages up to ``EAGER_BYTES`` run here (large ones want the executor's early
posting and must not hold up the read callback while they are reduced).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from .._errors import MismatchError
from ._executor import (
    CollectiveSpec,
    Context,
    Prepared,
    Reduction,
    apply_reductions,
    context,
    copies,
    landing_zones,
    prepare,
    start_sends,
)
from ._transport import Tag, Transport

__all__ = ["EAGER_BYTES", "EagerLane", "eager_plan", "start_eager"]

EAGER_BYTES = 32 * 1024
"""Operations whose vector is at most this many bytes per rank run eagerly; the executor posts
receives of this size and above a step early, which the eager runner does not."""

Done = Callable[[BaseException | None], None]


def eager_plan(spec: CollectiveSpec, meta: dict[str, Any]) -> Prepared | None:
    """The prepared plan when ``spec`` can run eagerly, else None (run it with run_collective,
    which also raises any error the spec has: an invalid spec is never eager)."""
    if spec.algorithm is not None:
        return None  # an explicit algorithm is a benchmark's or a test's: run the executor
    # Judged before planning: run_collective plans a large operation itself, and planning some
    # (a ring reduce_scatter concatenates its inputs) is too costly to do twice.
    if _largest_array(spec) > EAGER_BYTES:
        return None
    try:
        prepared = prepare(spec, meta)
    except (TypeError, ValueError):
        return None
    return prepared if len(prepared.sched.lanes) <= 1 else None


def _largest_array(spec: CollectiveSpec) -> int:
    """Bytes of the largest array (a message never carries more than one array holds)."""
    return max((getattr(a, "nbytes", 0) for a in (*spec.send, *spec.recv)), default=0)


def start_eager(
    prepared: Prepared,
    spec: CollectiveSpec,
    transport: Transport,
    tag: Tag,
    meta: dict[str, Any],
    done: Done,
) -> EagerLane:
    """Start ``prepared`` now; ``done(None)`` or ``done(error)`` is called exactly once (possibly
    before this returns), unless ``stop()`` is called on the returned lane first."""
    lane = EagerLane(prepared, context(prepared, spec, transport, tag, meta), done)
    lane.start()
    return lane


class EagerLane:
    """One running eager operation (see the module docstring)."""

    __slots__ = (
        "_ctx",
        "_done",
        "_over",
        "_prepared",
        "_reductions",
        "_scratch",
        "_sending",
        "_step",
        "_waiting",
    )

    def __init__(self, prepared: Prepared, ctx: Context, done: Done) -> None:
        self._prepared = prepared
        self._ctx = ctx
        self._done = done
        self._over = False
        self._step = 0
        self._waiting = 0
        self._reductions: list[Reduction] = []
        self._sending: list[asyncio.Future[None]] = []  # sends the kernel did not take at once
        need, reduced = prepared.sched.scratch[0] if prepared.sched.lanes else (0, None)
        # One scratch for every step: reduced payloads of a step land in it, and the step's
        # reductions finish before the next step's receives are posted.
        self._scratch = None if reduced is None else np.empty(need, dtype=prepared.bufs[reduced].dtype)

    def start(self) -> None:
        try:
            copies(self._prepared.sched.prologue, self._prepared.bufs)
        except BaseException as exc:
            self._fail(exc)
            return
        self._run_from(0)

    def stop(self) -> None:
        """The operation was failed from outside (deadline, lost peer): do nothing more, and
        drop what is still queued to send (it must not read the caller's tensor any longer)."""
        self._over = True
        self._cancel_sends()

    def _cancel_sends(self) -> None:
        sending, self._sending = self._sending, []
        if not sending:
            return
        # Cancel on the next turn: a send task not started yet would be cancelled before its
        # coroutine ever ran, and could not take its frame back out of the link's queue.
        call_soon = asyncio.get_running_loop().call_soon
        for fut in sending:
            call_soon(fut.cancel)

    def _run_from(self, k: int) -> None:
        lanes = self._prepared.sched.lanes
        steps = lanes[0] if lanes else ()
        bufs = self._prepared.bufs
        ctx = self._ctx
        try:
            while k < len(steps):
                step = steps[k]
                self._step = k
                # One count for the step itself: a receive that completes while the step is still
                # being started (its message was already here) cannot finish the step early.
                self._waiting = 1
                for pending in start_sends(step, bufs, ctx):
                    self._waiting += 1
                    sending = asyncio.ensure_future(pending)
                    self._sending.append(sending)
                    sending.add_done_callback(self._on_sent)
                landings, self._reductions = landing_zones(step, bufs, self._scratch, 0)
                for peer, landing, _ in landings:
                    self._waiting += 1
                    ctx.transport.post_recv(
                        ctx.global_ranks[peer],
                        (*ctx.tag, step.id),
                        landing.view(np.uint8).data,
                        functools.partial(self._on_received, ctx.global_ranks[peer]),
                    )
                    if self._over:
                        return
                self._waiting -= 1
                if self._waiting:
                    return
                apply_reductions(self._reductions, ctx)
                k += 1
            copies(self._prepared.sched.epilogue, bufs)
            self._prepared.finish()
        except BaseException as exc:
            self._fail(exc)
            return
        if not self._over:
            self._over = True
            self._done(None)

    def _on_received(
        self, src: int, result: tuple[int, dict[str, Any]] | None, exc: BaseException | None
    ) -> None:
        if self._over:
            return
        if exc is not None:
            self._fail(self._ctx.recv_error(src, exc) if isinstance(exc, MismatchError) else exc)
            return
        assert result is not None
        err = self._ctx.meta_error(src, result[1])
        if err is not None:
            self._fail(err)
            return
        self._arrived()

    def _on_sent(self, fut: asyncio.Future[None]) -> None:
        if fut in self._sending:
            self._sending.remove(fut)
        if self._over:
            if not fut.cancelled():
                fut.exception()
            return
        if fut.cancelled():
            self._fail(asyncio.CancelledError())
            return
        exc = fut.exception()
        if exc is not None:
            self._fail(exc)
            return
        self._arrived()

    def _arrived(self) -> None:
        self._waiting -= 1
        if self._waiting:
            return
        try:
            apply_reductions(self._reductions, self._ctx)
        except BaseException as exc:
            self._fail(exc)
            return
        self._run_from(self._step + 1)

    def _fail(self, exc: BaseException) -> None:
        if self._over:
            return
        self._over = True
        self._cancel_sends()
        self._done(exc)

