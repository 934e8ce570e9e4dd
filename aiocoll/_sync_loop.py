"""The one background event loop that the blocking facade and the torch backend forward to.

Holds the loop thread (daemon, started lazily, uvloop when installed), the bridge that issues an
async-core operation from any thread and hands its outcome back, and the small completion pool
on which user-visible futures are completed. Imports only the standard library and aiocoll
foundations: aiocoll.sync and aiocoll.torch sit on top of it and hold the argument conversions.

It exists because the async core is single-threaded asyncio while torch.distributed scripts,
DDP's autograd thread and comm-hook callbacks call from arbitrary threads. Two rules keep that
safe:

* Issue order is launch order. ``Bridge.issue`` appends the call to the loop's ready queue on
  the calling thread (``call_soon_threadsafe`` is FIFO), so the core takes its per-group
  sequence number in the order the callers launched, whichever thread they ran on.
* CUDA tensors are ordered on the caller's streams, not the loop thread's:
  ``issue_on_caller_streams`` records events on the calling thread's current CUDA streams and
  hands them to the core with the call (aiocoll.device._staging.caller_context).
* Nothing a user supplies runs on the loop thread. A callback that blocks (PowerSGD's waits on
  another all_reduce) would otherwise deadlock the network; futures are completed on
  ``completion_pool()`` instead.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

from ._errors import CALLER_SITE, DistError, user_site
from ._run import new_event_loop
from ._work import Work as _CoreWork
from .device._device import Device, DeviceTensor
from .device._staging import CallerStreamContext, caller_context, record_caller_streams

__all__ = ["Outcome", "completion_pool", "get_loop_thread", "LoopThread"]

T = TypeVar("T")

# Enough threads that one blocking callback (PowerSGD waiting on its second all_reduce) never
# starves the completion of the operation it waits for.
_COMPLETION_THREADS = 4


class Outcome:
    """The result of one operation issued onto the loop, readable from any thread.

    A thin wrapper over ``concurrent.futures.Future`` that records whether the operation was
    accepted by the core (``launched``): the core raises ValueError/TypeError for bad arguments
    at call time, and callers that must raise at call time wait for that instead of completion.
    """

    __slots__ = ("_future", "_launched")

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._launched = threading.Event()

    # Called on the loop thread.
    def _set_launched(self) -> None:
        self._launched.set()

    def _set_result(self, value: Any) -> None:
        if not self._future.done():
            self._future.set_result(value)
        self._launched.set()

    def _set_exception(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)
        self._launched.set()

    def wait_launched(self, timeout: float | None = None) -> None:
        """Block until the core accepted the call; re-raise the call-time error if it refused it.

        Raises:
            ValueError / TypeError: the core's argument checks. DistError: when the loop thread
            did not take the call within ``timeout`` seconds.
        """
        if not self._launched.wait(timeout):
            raise DistError(f"the aiocoll loop thread did not accept the call within {timeout}s")
        if self._future.done() and not self._future.cancelled():
            exc = self._future.exception()
            if isinstance(exc, (ValueError, TypeError)):
                raise exc

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """The operation's result, blocking up to ``timeout`` seconds (None: until it completes).

        Raises:
            Whatever the operation raised; concurrent.futures.TimeoutError (a TimeoutError) when
            ``timeout`` runs out first.
        """
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[Outcome], None]) -> None:
        """Call ``fn(self)`` once done — on the completion pool, never on the loop thread."""

        def forward(_: concurrent.futures.Future[Any]) -> None:
            completion_pool().submit(fn, self)

        self._future.add_done_callback(forward)

    @classmethod
    def all_of(cls, outcomes: list[Outcome]) -> Outcome:
        """One Outcome that completes once all of ``outcomes`` did: None, or the first error."""
        combined = cls()
        combined._set_launched()
        left = [len(outcomes)]
        lock = threading.Lock()

        def one_done(_: concurrent.futures.Future[Any]) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            errors = [o._future.exception() for o in outcomes if o._future.exception() is not None]
            if errors:
                combined._set_exception(errors[0])  # type: ignore[arg-type]
            else:
                combined._set_result(None)

        if not outcomes:
            combined._set_result(None)
        for outcome in outcomes:
            outcome._future.add_done_callback(one_done)
        return combined


class LoopThread:
    """An asyncio event loop running forever on a daemon thread."""

    def __init__(self, name: str = "aiocoll-loop") -> None:
        self.loop = new_event_loop()
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._started.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._started.set)
        try:
            self.loop.run_forever()
        finally:
            with contextlib.suppress(Exception):
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def _check_caller(self) -> None:
        if self.on_loop_thread():
            raise RuntimeError(
                "a blocking aiocoll call was made on the aiocoll loop thread itself (from a callback "
                "run by the async core?); it would deadlock. Use the async API there instead."
            )
        if not self.thread.is_alive():
            raise DistError("the aiocoll loop thread has stopped (interpreter shutting down?)")

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

    def issue(self, start: Callable[[], Awaitable[Any]]) -> Outcome:
        """Launch an operation of the async core from any thread, without waiting for it.

        ``start`` runs on the loop thread, in the order issue() was called (FIFO across threads),
        and must call the core (which takes the sequence number then) and return the awaitable
        Work. Its result or exception lands in the returned Outcome.

        Raises:
            DistError: when the loop thread is gone.
        """
        self._check_caller()
        outcome = Outcome()
        # The call runs in a copy of this thread's context, which names the user's line for the
        # flight recorder and warnings (aiocoll._errors.CALLER_SITE), as ``run`` does.
        site = CALLER_SITE.set(user_site(sys._getframe(1)))
        try:
            self.loop.call_soon_threadsafe(_start_on_loop, start, outcome)
        finally:
            CALLER_SITE.reset(site)
        return outcome


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
    devices: list[Device] = [t.device for t in tensors if isinstance(t, DeviceTensor)]
    if "aiocoll.device._cuda" in sys.modules or any(getattr(t, "is_cuda", False) for t in tensors):
        from .device._cuda import cuda_devices_of

        devices += cuda_devices_of(tensors)
    if not devices:
        return get_loop_thread().issue(start), None
    streams = record_caller_streams(devices)
    streams.wait_on_host = wait_on_host
    token = caller_context.set(streams)
    try:
        return get_loop_thread().issue(start), streams
    finally:
        caller_context.reset(token)


def _start_on_loop(start: Callable[[], Awaitable[Any]], outcome: Outcome) -> None:
    try:
        work = start()
    except BaseException as exc:
        outcome._set_exception(exc)
        return
    outcome._set_launched()
    if isinstance(work, _CoreWork):
        # The core's Work: read its outcome directly, no Task needed (cheaper per operation).
        work.add_done_callback(lambda w: _finish_core(w, outcome))
        return
    task = asyncio.ensure_future(work)

    def finished(task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            outcome._set_exception(DistError("the aiocoll operation was cancelled"))
        elif task.exception() is not None:
            outcome._set_exception(task.exception())  # type: ignore[arg-type]
        else:
            outcome._set_result(task.result())

    task.add_done_callback(finished)


def _finish_core(work: _CoreWork, outcome: Outcome) -> None:
    exc = work.exception()
    if exc is not None:
        outcome._set_exception(exc)
    else:
        outcome._set_result(work.result())


_lock = threading.Lock()
_loop_thread: LoopThread | None = None
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def get_loop_thread() -> LoopThread:
    """The process-wide loop thread, started on first use."""
    global _loop_thread
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
