"""The one background event loop that the blocking facade and the torch backend forward to.

Holds the loop thread (daemon, started lazily), the bridge that issues an async-core operation
from any thread and hands its outcome back, and the small completion pool on which user-visible
futures are completed.

A blocking call runs its operation on the calling thread when it can (the caller *drives* it):
the loop thread holds a *turn* at all times except while it sleeps in its selector, and a caller
that finds the turn free takes it, starts the operation itself (the loop set as its thread's
running loop) and gives the turn back. An operation that finished inside its call (the one-step
shared-memory operation whose peers were there, a small send handed off) then costs no wake-up at
all; one still running is settled by the loop thread later (one wake-up, the caller's). A caller
that finds the loop busy hands the call over as before (``call_soon_threadsafe``, one eventfd
write) and parks on its own thread's preallocated lock, which the loop thread releases when the
operation settles. No concurrent.futures future, no Task for the core's operations, and no pool
thread unless someone asked for a future. The turn needs asyncio's selector loop (its epoll is
wrapped), so the loop thread runs the standard loop, not uvloop, unless AIOCOLL_LOOP=uvloop
asks for uvloop by name (then every call is handed over).

Imports only the standard library and aiocoll foundations: aiocoll.sync and aiocoll.torch sit on
top of it and hold the argument conversions.

It exists because the async core is single-threaded asyncio while torch.distributed scripts,
DDP's autograd thread and comm-hook callbacks call from arbitrary threads. The rules that keep
that safe:

* One thread at a time runs the core: the loop thread, or the caller holding the turn.
* Issue order is launch order. ``Bridge.issue`` appends the call to the loop's ready queue on
  the calling thread (``call_soon_threadsafe`` is FIFO), so the core takes its per-group
  sequence number in the order the callers launched, whichever thread they ran on; a caller
  drives only when no call handed over before it is still waiting to start.
* CUDA tensors are ordered on the caller's streams, not the loop thread's:
  ``issue_on_caller_streams`` records events on the calling thread's current CUDA streams and
  hands them to the core with the call (aiocoll.device._staging.caller_context). Such calls are
  never driven: the core's device work stays on the threads it always ran on.
* Nothing a user supplies runs on the loop thread. A callback that blocks (PowerSGD's waits on
  another all_reduce) would otherwise deadlock the network; futures are completed on
  ``completion_pool()`` instead.
* A signal handler that interrupts a driven start runs inside the core, as it would in a script
  on the async API: a blocking aiocoll call it makes raises DistError at once (it could only
  wait for the turn its own thread holds), where a handler that interrupts a parked wait may
  make one.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import math
import os
import select
import selectors
import sys
import threading
import time
from asyncio import events as _events
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ._env import env_text
from ._errors import CALLER_SITE, DistError, Site, user_site
from ._run import new_event_loop
from ._work import Work as _CoreWork
from .device._device import Device, DeviceTensor
from .device._staging import CallerStreamContext, caller_context, record_caller_streams

__all__ = ["Outcome", "completion_pool", "get_loop_thread", "LoopThread"]

T = TypeVar("T")

# Enough threads that one blocking callback (PowerSGD waiting on its second all_reduce) never
# starves the completion of the operation it waits for.
_COMPLETION_THREADS = 4


_PENDING, _LAUNCHED, _DONE = 0, 1, 2

# A thread parked without a timeout looks this often whether the loop thread that would wake it
# still runs: a loop thread that died (SystemExit in a callback, the interpreter's exit) settles
# nothing, and its waiters would otherwise sleep for ever. Waking costs nothing on a normal wait,
# which is released long before.
_BACKSTOP_S = 2.0

# Guards every Outcome's lists of waiters and callbacks: held only to read or change them, never
# while a callback runs or a thread blocks.
_guard = threading.Lock()
_local = threading.local()

# What every driven call runs, bound once (a module attribute read each is an opcode each).
_get_running_loop = _events._get_running_loop
_set_running_loop = _events._set_running_loop
_copy_context = contextvars.copy_context


def _take_waiter() -> threading.Lock:
    """A lock for one wait of this thread: held, released once by whoever wakes the thread.

    Each thread keeps its spare waiters, so a blocked call costs one lock release (one wake-up)
    and nothing allocated, where a ``concurrent.futures.Future`` makes a Condition and a lock per
    wait. A wait nested in another on the same thread (a signal handler that calls
    ``dist.barrier()`` while the main thread is parked in an all_reduce) takes a second lock:
    sharing one would hand one wait the other's wake-up.
    """
    try:
        spare: list[threading.Lock] = _local.spare
    except AttributeError:
        spare = _local.spare = []
    if spare:
        return spare.pop()
    lock = threading.Lock()
    lock.acquire()
    return lock


def _keep_waiter(lock: threading.Lock) -> None:
    """Give back a waiter that is held again and has no release on its way."""
    _local.spare.append(lock)


class Outcome:
    """The result of one operation issued onto the loop, readable from any thread.

    It records whether the core accepted the call (``launched``: the core raises ValueError /
    TypeError for bad arguments at call time, and callers that must raise at call time wait for
    that instead of completion) and then its result or error. A thread that waits parks on its
    own preallocated lock, which the loop thread releases when it settles the operation: one
    wake-up, no future, no pool.
    """

    __slots__ = ("_error", "_inline", "_later", "_source", "_state", "_value", "_waiters")

    def __init__(self, source: LoopThread | None = None) -> None:
        self._source = source  # the loop thread that settles it (None: the process's)
        self._state = _PENDING
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[threading.Lock, int]] | None = None
        self._later: list[Callable[[Outcome], None]] | None = None  # run on the completion pool
        self._inline: list[Callable[[Outcome], None]] | None = None  # run by the settling thread

    # -- settled on the loop thread ------------------------------------------------------------
    def _set_launched(self) -> None:
        with _guard:
            if self._state != _PENDING:
                return
            self._state = _LAUNCHED
            waiters = self._waiters
            if not waiters:
                return
            woken = [w for w in waiters if w[1] == _LAUNCHED]
            self._waiters = [w for w in waiters if w[1] != _LAUNCHED]
        for lock, _ in woken:
            lock.release()

    def _set_result(self, value: Any) -> None:
        self._settle(value, None)

    def _set_exception(self, exc: BaseException) -> None:
        self._settle(None, exc)

    def _settle(self, value: Any, error: BaseException | None) -> None:
        with _guard:
            if self._state == _DONE:
                return
            self._value = value
            self._error = error
            self._state = _DONE
            waiters = self._waiters
            later = self._later
            inline = self._inline
            if waiters is None and later is None and inline is None:
                return  # (the usual driven call: nobody waits yet)
            self._waiters = self._later = self._inline = None
        if waiters:
            for lock, _ in waiters:
                lock.release()
        if inline:
            for fn in inline:
                fn(self)
        if later:
            pool = completion_pool()
            for fn in later:
                pool.submit(fn, self)

    # -- read from any thread ------------------------------------------------------------------
    def _block(self, target: int, timeout: float | None) -> bool:
        """Park this thread until the state reaches ``target``; False when ``timeout`` ran out."""
        if self._state >= target:
            return True
        source = self._source
        if source is not None and source._driver == threading.get_ident():
            raise DistError(_NESTED)
        lock = _take_waiter()
        entry = (lock, target)
        try:
            with _guard:
                if self._state >= target:
                    _keep_waiter(lock)
                    return True
                if self._waiters is None:
                    self._waiters = [entry]
                else:
                    self._waiters.append(entry)
            # The entry is released only once the state reached its target (_set_launched wakes
            # the entries waiting for launch, _settle every entry), and only this wait uses it.
            if timeout is None:
                while not lock.acquire(True, _BACKSTOP_S):
                    if self._settler_alive():
                        continue
                    if self._withdraw(entry):
                        _keep_waiter(lock)
                        raise DistError(
                            "the aiocoll loop thread stopped while this call waited for it (the "
                            "interpreter is exiting, or the loop thread died: see the log above); "
                            "the operation's outcome is unknown"
                        )
                    lock.acquire()  # settled as the thread ended: its release is under way
                    break
            elif not lock.acquire(True, max(timeout, 0.0)):
                if self._withdraw(entry):
                    _keep_waiter(lock)
                    return False
                lock.acquire()  # its release is under way: take it back, so it is held again
        except BaseException:  # KeyboardInterrupt while parked, say: leave nothing behind
            if self._withdraw(entry):
                _keep_waiter(lock)
            # else a release may be on its way to this lock: drop it, the next wait takes another
            raise
        _keep_waiter(lock)
        return True

    def _settler_alive(self) -> bool:
        """Whether the loop thread that settles this outcome still runs its loop."""
        source = self._source if self._source is not None else _loop_thread
        return source is not None and source.running and source.thread.is_alive()

    def _withdraw(self, entry: tuple[threading.Lock, int]) -> bool:
        """Take ``entry`` off the waiters; False when it is already being woken."""
        with _guard:
            if self._waiters is not None and entry in self._waiters:
                self._waiters.remove(entry)
                return True
        return False

    def wait_launched(self, timeout: float | None = None) -> None:
        """Block until the core accepted the call; re-raise the call-time error if it refused it.

        Raises:
            ValueError / TypeError: the core's argument checks. DistError: when the loop thread
            did not take the call within ``timeout`` seconds.
        """
        if not self._block(_LAUNCHED, timeout):
            raise DistError(f"the aiocoll loop thread did not accept the call within {timeout}s")
        if self._state == _DONE and isinstance(self._error, (ValueError, TypeError)):
            raise self._error

    def done(self) -> bool:
        return self._state == _DONE

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the operation finished (None: as long as it runs); False on timeout."""
        return self._state == _DONE or self._block(_DONE, timeout)

    def result(self, timeout: float | None = None) -> Any:
        """The operation's result, blocking up to ``timeout`` seconds (None: until it completes).

        Raises:
            Whatever the operation raised; TimeoutError when ``timeout`` runs out first (tell
            the two apart with ``done()``).
        """
        if self._state != _DONE and not self._block(_DONE, timeout):
            raise TimeoutError(f"the aiocoll operation did not complete within {timeout}s")
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The operation's error (None after success), blocking like ``result``."""
        if self._state != _DONE and not self._block(_DONE, timeout):
            raise TimeoutError(f"the aiocoll operation did not complete within {timeout}s")
        return self._error

    def add_done_callback(self, fn: Callable[[Outcome], None]) -> None:
        """Call ``fn(self)`` once done — on the completion pool, never on the loop thread."""
        if not self._register(fn, inline=False):
            completion_pool().submit(fn, self)

    def _add_inline_callback(self, fn: Callable[[Outcome], None]) -> None:
        # For aiocoll's own bookkeeping that only settles other Outcomes: runs on the settling
        # thread (the loop's), or here when already done.
        if not self._register(fn, inline=True):
            fn(self)

    def _register(self, fn: Callable[[Outcome], None], *, inline: bool) -> bool:
        """Keep ``fn`` for the settling; False when already settled (the caller runs it)."""
        with _guard:
            if self._state == _DONE:
                return False
            if inline:
                self._inline = [*(self._inline or ()), fn]
            else:
                self._later = [*(self._later or ()), fn]
            return True

    @classmethod
    def all_of(cls, outcomes: list[Outcome]) -> Outcome:
        """One Outcome that completes once all of ``outcomes`` did: None, or the first error."""
        # settled by its parts' loop thread: the backstop watches that one
        combined = cls(next((o._source for o in outcomes if o._source is not None), None))
        combined._set_launched()
        left = [len(outcomes)]
        lock = threading.Lock()

        def one_done(_: Outcome) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            errors = [o._error for o in outcomes if o._error is not None]
            combined._settle(None, errors[0] if errors else None)

        if not outcomes:
            combined._set_result(None)
        for outcome in outcomes:
            outcome._add_inline_callback(one_done)
        return combined


class _TurnPoll:
    """The selector's poll object, releasing the loop thread's turn while it sleeps in it.

    Only the kernel wait runs without the turn: the selector reads its key table before and
    after it, with the turn held again. ``until`` is when the sleep ends without events (on the
    loop's clock; inf: never), read by a caller holding the turn.
    """

    __slots__ = ("_clock", "_poll", "_turn", "until")

    def __init__(self, poll: Any, turn: threading.Lock) -> None:
        self._poll = poll
        self._turn = turn
        self._clock = time.monotonic  # asyncio's loop.time()
        self.until = 0.0

    def poll(self, timeout: float | None = None, *rest: Any) -> Any:
        # epoll takes seconds (-1: no limit), poll milliseconds (None: no limit)
        if timeout is None or timeout < 0:
            self.until = math.inf
        elif timeout == 0:
            self.until = 0.0
        else:
            self.until = self._clock() + (timeout if isinstance(self._poll, _EPOLL) else timeout / 1e3)
        turn = self._turn
        turn.release()
        try:
            return self._poll.poll(timeout, *rest)
        finally:
            turn.acquire()
            self.until = 0.0

    def __getattr__(self, name: str) -> Any:  # register, modify, unregister, fileno, close
        return getattr(self._poll, name)


_EPOLL: type = getattr(select, "epoll", type(None))


def _drivable_loop() -> tuple[asyncio.AbstractEventLoop, _TurnPoll | None]:
    """asyncio's selector loop whose thread gives up its turn while it sleeps, and its poller.

    None for the poller where the selector has no poll object to wrap (no epoll or poll), or
    where AIOCOLL_LOOP names uvloop (it has no selector to wrap): callers then always hand their
    calls over.
    """
    selector_cls = getattr(selectors, "EpollSelector", None) or getattr(selectors, "PollSelector", None)
    if (env_text("AIOCOLL_LOOP") or "").lower() == "uvloop":
        return new_event_loop(), None  # asked for by name: uvloop, every call handed over
    if selector_cls is None:
        return asyncio.SelectorEventLoop(), None
    selector = selector_cls()
    poller = _TurnPoll(selector._selector, threading.Lock())
    selector._selector = poller
    return asyncio.SelectorEventLoop(selector), poller


def _late(when: float, until: float) -> bool:
    """Whether a timer due at ``when``, set by a driven start, would fire too late if the loop
    slept on until ``until``: later than half its delay again. Its sleep is never long (the
    progress stamp's timer turns the loop every quarter second), so the shared-memory wait's
    backstop and an operation's deadline seldom cost the loop a wake-up of its own."""
    now = time.monotonic()
    return until - now > 1.5 * (when - now)


_NESTED = (
    "a blocking aiocoll call was made while this thread was starting another aiocoll call (from a "
    "signal handler that interrupted it?); it could only wait for ever. Make the call after the "
    "handler returns (set a flag in the handler), or from another thread"
)


class LoopThread:
    """An asyncio event loop running forever on a daemon thread, which callers may drive."""

    def __init__(self, name: str = "aiocoll-loop") -> None:
        self.loop, self._poller = _drivable_loop()
        self._turn = self._poller._turn if self._poller is not None else None
        self._ready_event = threading.Event()
        # Read on every call (cheaper than Thread.is_alive, which takes a lock): the loop
        # thread's id, and whether its loop still runs.
        self._ident = -1
        self.running = False
        # Calls handed over (written under _hand_over) and, of those, started on the loop
        # (written under the turn): a caller drives only when they are equal.
        self._handed = 0
        self._begun = 0
        self.driven = 0  # calls started on their caller's thread (diagnostics, tests)
        self._driver: int | None = None  # the thread that holds the turn to start a call
        self._hand_over = threading.Lock()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready_event.wait()

    def _main(self) -> None:
        turn = self._turn
        if turn is not None:
            turn.acquire()  # held from here on, except while the loop sleeps for events
        try:
            asyncio.set_event_loop(self.loop)
            self._ident = threading.get_ident()
            self.running = True
            self.loop.call_soon(self._ready_event.set)
            try:
                self.loop.run_forever()
            finally:
                self.running = False
                with contextlib.suppress(Exception):
                    self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            if turn is not None:
                turn.release()

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def _check_caller(self) -> None:
        if threading.get_ident() == self._ident:
            raise RuntimeError(
                "a blocking aiocoll call was made on the aiocoll loop thread itself (from a callback "
                "run by the async core?); it would deadlock. Use the async API there instead."
            )
        if not self.running:
            raise DistError("the aiocoll loop thread has stopped (interpreter shutting down?)")
        if self._driver == threading.get_ident():
            raise DistError(_NESTED)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it finishes.

        Args:
            coro: the coroutine; its own deadlines bound it, ``timeout`` is a backstop.
            timeout: seconds to wait; None waits as long as the coroutine runs.

        Raises:
            Whatever the coroutine raised; TimeoutError when ``timeout`` ran out (the coroutine is
            then cancelled).
        """
        try:
            self._check_caller()
        except BaseException:
            coro.close()
            raise
        # The coroutine runs in a copy of this thread's context: a warning it gives names the
        # line that called the facade, not this loop's (aiocoll._errors.warn).
        site = CALLER_SITE.set(user_site(sys._getframe(1)))
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        finally:
            CALLER_SITE.reset(site)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            if future.done():  # the coroutine's own TimeoutError (CollectiveTimeout, StoreTimeout)
                raise
            future.cancel()
            raise TimeoutError(f"aiocoll call did not finish within {timeout}s") from None

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run the plain function ``fn`` on the loop thread and return its value (or raise)."""

        async def invoke() -> T:
            return fn()

        return self.run(invoke(), timeout)

    def issue(self, start: Callable[[], Awaitable[Any]], *, drive: bool = True) -> Outcome:
        """Launch an operation of the async core from any thread, without waiting for it.

        ``start`` must call the core (which takes the sequence number then) and return the
        awaitable Work; its result or exception lands in the returned Outcome. It runs in the
        order issue() was called (FIFO across threads): on this thread, when the loop's turn is
        free and no call handed over earlier is still waiting to start, else on the loop thread.

        Args:
            start: calls the core.
            drive: False keeps the start on the loop thread.

        Raises:
            DistError: when the loop thread is gone.
        """
        ident = threading.get_ident()
        if ident == self._ident or ident == self._driver or not self.running:
            self._check_caller()  # raises what is wrong
        outcome = Outcome(self)
        # The call runs in a copy of this thread's context, which names the user's line for the
        # flight recorder and warnings (aiocoll._errors.CALLER_SITE), as ``run`` does.
        site = user_site(sys._getframe(1))
        if drive and self._drive(start, outcome, site, ident):
            return outcome
        token = CALLER_SITE.set(site)  # (call_soon_threadsafe copies the context with it)
        try:
            with self._hand_over:
                self._handed += 1
                self.loop.call_soon_threadsafe(self._start_handed, start, outcome)
        finally:
            CALLER_SITE.reset(token)
        return outcome

    @property
    def handed(self) -> int:
        """How many calls were handed to the loop thread to start (diagnostics, tests)."""
        return self._handed

    def _start_handed(self, start: Callable[[], Awaitable[Any]], outcome: Outcome) -> None:
        self._begun += 1
        _start_on_loop(start, outcome)

    def _drive(
        self, start: Callable[[], Awaitable[Any]], outcome: Outcome, site: Site | None, ident: int
    ) -> bool:
        """Start the operation on this thread if the loop's turn is free; False if it was not.

        The loop is this thread's running loop meanwhile (the core asks for it). What the start
        leaves for the loop: callbacks it made ready run here too, as the loop's next turn would
        run them, when the loop sleeps with nothing ready (the shared-memory scheduler's note
        that the loop turned, say); a timer earlier than the loop's sleep, or callbacks still
        ready, wake it (one self-pipe write). An operation that finished inside its start, with
        nothing left for the loop, costs no wake-up at all.
        """
        turn = self._turn
        if turn is None or not turn.acquire(False):
            return False
        try:
            loop: Any = self.loop
            if not self.running or self._handed != self._begun or loop._debug:
                # stopped; an earlier call still on its way to the loop; or asyncio's debug
                # mode, whose checks refuse a loop's calls from another thread
                return False
            self._driver = ident
            ready = loop._ready
            asleep = not ready and self._poller.until > 0.0  # type: ignore[union-attr]
            timers = loop._scheduled
            first = timers[0] if timers else None  # the loop's sleep ends by this one
            previous = _get_running_loop()
            _set_running_loop(loop)
            try:
                _copy_context().run(_start_driven, site, start, outcome)
                if asleep and ready:
                    for _ in range(len(ready)):
                        handle = ready.popleft()
                        if not handle._cancelled:
                            handle._run()
            finally:
                _set_running_loop(previous)
                self._driver = None
            if ready or (timers and timers[0] is not first and _late(timers[0]._when, self._poller.until)):  # type: ignore[union-attr]
                loop._write_to_self()
            self.driven += 1
            return True
        finally:
            turn.release()


def issue_on_caller_streams(
    start: Callable[[], Awaitable[Any]], tensors: Sequence[Any], *, wait_on_host: bool
) -> tuple[Outcome, CallerStreamContext | None]:
    """``get_loop_thread().issue(start)``, with the calling thread's device stream events.

    For device tensors among ``tensors`` (torch CUDA tensors, any aiocoll DeviceTensor; and the
    current CUDA device once CUDA is in use in this process), events recorded now on the calling
    thread's current streams go with the call (issue() hands the loop a copy of this thread's
    context), so the operation stages what the caller's streams computed before the call.
    ``wait_on_host``: the operation completes once its results are on the device (aiocoll.sync);
    else it leaves completion events in the returned context for the caller's stream to wait on
    (aiocoll.torch's Work). The context is None when no device is involved.
    """
    devices: list[Device] = []
    cuda = "aiocoll.device._cuda" in sys.modules
    for t in tensors:  # (one pass, no generator: this runs at every blocking call)
        if isinstance(t, DeviceTensor):
            devices.append(t.device)
        elif not cuda and getattr(t, "is_cuda", False):
            cuda = True
    if cuda:
        from .device._cuda import cuda_devices_of

        devices += cuda_devices_of(tensors)
    if not devices:
        return get_loop_thread().issue(start), None
    streams = record_caller_streams(devices)
    streams.wait_on_host = wait_on_host
    token = caller_context.set(streams)
    try:
        return get_loop_thread().issue(start, drive=False), streams
    finally:
        caller_context.reset(token)


def _start_on_loop(start: Callable[[], Awaitable[Any]], outcome: Outcome) -> None:
    try:
        work = start()
    except BaseException as exc:
        outcome._settle(None, exc)
        return
    _follow(work, outcome)


def _start_driven(site: Site | None, start: Callable[[], Awaitable[Any]], outcome: Outcome) -> None:
    """``_start_on_loop`` on the thread that drives the call, in the copy of its context.

    The outcome is this thread's alone until ``issue`` returns it (nobody waits on it, no
    callback is registered), so an operation born complete, the usual small one, settles it
    without the lock.
    """
    CALLER_SITE.set(site)  # (the copy is dropped after the call: nothing to reset)
    try:
        work = start()
    except BaseException as exc:
        outcome._settle(None, exc)
        return
    if type(work) is _CoreWork and work._future is None:  # born complete: its result is kept
        outcome._value = work._result
        outcome._state = _DONE
        return
    _follow(work, outcome)


def _follow(work: Any, outcome: Outcome) -> None:
    """Settle ``outcome`` with what the started operation ``work`` gives, once it does."""
    if isinstance(work, _CoreWork):
        # The core's Work: read its outcome directly, no Task needed (cheaper per operation);
        # one that finished inside its call (born complete) wakes the caller at once.
        if work.is_completed():
            _finish_core(work, outcome)
            return
        outcome._set_launched()
        work.add_done_callback(lambda w: _finish_core(w, outcome))
        return
    outcome._set_launched()
    task = asyncio.ensure_future(work)

    def finished(task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            outcome._settle(None, DistError("the aiocoll operation was cancelled"))
        else:
            exc = task.exception()
            outcome._settle(None if exc is not None else task.result(), exc)

    task.add_done_callback(finished)


def _finish_core(work: _CoreWork, outcome: Outcome) -> None:
    exc = work.exception()
    outcome._settle(None if exc is not None else work.result(), exc)


_lock = threading.Lock()
_loop_thread: LoopThread | None = None
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _forget_parent_threads() -> None:
    # A forked child has none of its parent's threads: the loop thread it inherited never runs,
    # and a lock another thread held at the fork stays held. It starts afresh on first use.
    global _guard, _local, _lock, _loop_thread, _pool
    _guard = threading.Lock()
    _local = threading.local()
    _lock = threading.Lock()
    _loop_thread = None
    _pool = None


os.register_at_fork(after_in_child=_forget_parent_threads)


def get_loop_thread() -> LoopThread:
    """The process-wide loop thread, started on first use."""
    global _loop_thread
    thread = _loop_thread
    if thread is not None and thread.running:
        return thread
    if _loop_thread is None or not _loop_thread.thread.is_alive():
        with _lock:
            if _loop_thread is None or not _loop_thread.thread.is_alive():
                _loop_thread = LoopThread()
    return _loop_thread


def completion_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The small pool on which user-visible futures are completed (never the loop thread)."""
    global _pool
    if _pool is None:
        with _lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(
                    _COMPLETION_THREADS, thread_name_prefix="aiocoll-completion"
                )
    return _pool


@atexit.register
def _stop_loop() -> None:
    # Stop the loop so a process exits promptly; groups still open are abandoned as at a crash
    # (peers see the links close), which is what torch does with groups never destroyed.
    thread = _loop_thread
    if thread is not None and thread.thread.is_alive():
        with contextlib.suppress(RuntimeError):
            thread.loop.call_soon_threadsafe(thread.loop.stop)
        thread.thread.join(timeout=2.0)
