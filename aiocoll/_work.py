"""Work: the handle every operation returns at call time.

Imports only the standard library and aiocoll._errors (a foundation, so the engine in
aiocoll.client can create it).

A Work wraps the asyncio future the engine completes, or, for an operation that completed
inside its call (the commonest small operation), is born complete with its result and has no
future at all. It is awaitable on the loop (awaiting is
shielded: cancelling the awaiting task does not cancel the operation, which keeps the group's
sequence consistent on every rank), and ``wait`` blocks a thread outside the loop, as torch's
``Work.wait`` does for scripts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any

__all__ = ["Work"]


class Work:
    """An operation in flight.

    Awaiting it gives the operation's result: the (in-place) tensor or list, the source rank for
    ``recv``, the object for the object operations.
    """

    __slots__ = ("_description", "_future", "_hooked", "_loop", "_result", "_waiters")

    def __init__(
        self, future: asyncio.Future[Any], description: str | Callable[[], str] = "operation"
    ) -> None:
        """Made by the engine, never by users.

        Args:
            future: the future the engine completes (on its loop).
            description: what the operation is, for ``repr`` and errors ("all_reduce seq 3 of
                group '0'"), or a function that says it (called once, when first needed: most
                operations never need it, and formatting it costs more than the rest of a small
                operation's start).
        """
        self._future: asyncio.Future[Any] | None = future
        self._loop = future.get_loop()
        self._result: Any = None
        self._description = description
        # One future per pending ``await``: cancelling an awaiting task cancels only its own
        # waiter, never the operation (what asyncio.shield does, minus a loop iteration: the
        # engine calls ``wake`` right after completing the operation).
        self._waiters: list[asyncio.Future[Any]] = []
        self._hooked = False

    @property
    def description(self) -> str:
        """What the operation is ("all_reduce (group 'w', seq 3)")."""
        described = self._description
        if not isinstance(described, str):
            described = self._description = described()
        return described

    @classmethod
    def completed(cls, result: Any, description: str = "operation") -> Work:
        """A Work that is already done with ``result`` (needs a running loop)."""
        return cls.born(result, asyncio.get_running_loop(), description)

    @classmethod
    def born(
        cls, result: Any, loop: asyncio.AbstractEventLoop, description: str | Callable[[], str] = "operation"
    ) -> Work:
        """A Work born complete with ``result``, without a future.

        Engine use: an operation that completed inside its call needs nothing more.
        """
        work = _new(_Born)
        work._result = result
        work._loop = loop
        work._description = description
        return work

    def __await__(self) -> Generator[Any, None, Any]:
        fut = self._future
        if fut is None:  # (a Work born complete is a _Born, which awaits without this call)
            return _ready(self._result)
        if fut.done():
            # the future's own iterator (C) ends at once with its result or error: no generator
            # frame for the usual small operation, finished inside its call
            return fut.__await__()
        return self._wait(fut)

    def _wait(self, fut: asyncio.Future[Any]) -> Generator[Any, None, Any]:
        waiter = self._loop.create_future()
        self._waiters.append(waiter)
        if not self._hooked:  # completions that do not call wake() still reach the waiters
            self._hooked = True
            fut.add_done_callback(self.wake)  # (called with the future, which it ignores)
        try:
            return (yield from waiter.__await__())
        finally:
            if not waiter.done() or waiter.cancelled():
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def wake(self, _fut: Any = None) -> None:
        """Hand the finished operation's outcome to every pending ``await`` now (engine use)."""
        waiters = self._waiters
        if not waiters:
            return
        fut = self._future
        if fut is None or not fut.done():
            return
        self._waiters = []
        cancelled = fut.cancelled()
        failure = None if cancelled else fut.exception()
        for waiter in waiters:
            if waiter.done():
                continue
            if cancelled:
                waiter.cancel()
            elif failure is not None:
                waiter.set_exception(failure)
            else:
                waiter.set_result(fut.result())

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        fut = self._future
        return fut is None or fut.done()

    def is_success(self) -> bool:
        """True once the operation finished without an error."""
        fut = self._future
        if fut is None:
            return True
        return fut.done() and not fut.cancelled() and fut.exception() is None

    def exception(self) -> BaseException | None:
        """The operation's error once it failed; None while running or after success."""
        fut = self._future
        if fut is None or not fut.done():
            return None
        if fut.cancelled():
            return asyncio.CancelledError(f"{self.description} was cancelled")
        return fut.exception()

    def result(self) -> Any:
        """The result of a finished operation.

        Raises:
            DistError: the operation's own error (CollectiveTimeout, PeerLostError, ...).
            asyncio.InvalidStateError: while the operation is still running.
        """
        fut = self._future
        if fut is None:
            return self._result
        return fut.result()

    def add_done_callback(self, fn: Callable[[Work], Any]) -> None:
        """Run ``fn(work)`` on the loop once the operation finished (at once if it has)."""
        fut = self._future
        if fut is None:
            self._loop.call_soon(fn, self)
            return
        fut.add_done_callback(lambda _fut: fn(self))

    def wait(self, timeout: float | None = None) -> bool:
        """Block this thread until the operation finished; returns True (as torch's Work.wait).

        Must not be called on the loop's own thread (that would deadlock it: ``await`` instead).

        Args:
            timeout: seconds to wait, None for as long as the operation's own deadline allows.

        Returns:
            True once the operation completed.

        Raises:
            DistError: the operation's own error (CollectiveTimeout, PeerLostError, ...).
            TimeoutError: ``timeout`` passed first (the operation keeps running).
            RuntimeError: when called on the event loop's own thread.
        """
        fut = self._future
        if fut is None:
            return True
        if fut.done():
            fut.result()
            return True
        if self._loop.is_running() and _on_loop_thread(self._loop):
            raise RuntimeError(
                f"Work.wait() was called on the event loop's thread for {self.description}; "
                f"use 'await work' there"
            )
        done = threading.Event()

        def _set(_: asyncio.Future[Any]) -> None:
            done.set()

        self._loop.call_soon_threadsafe(fut.add_done_callback, _set)
        if not done.wait(timeout):
            raise TimeoutError(f"{self.description} did not finish within {timeout}s")
        fut.result()
        return True

    def get_future(self) -> concurrent.futures.Future[Any]:
        """A thread-safe concurrent.futures.Future completed with the result (or error)."""
        out: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut = self._future
        if fut is None:
            out.set_result(self._result)
            return out

        def _copy(fut: asyncio.Future[Any]) -> None:
            if fut.cancelled():
                out.cancel()
            elif fut.exception() is not None:
                out.set_exception(fut.exception())
            else:
                out.set_result(fut.result())

        self._loop.call_soon_threadsafe(fut.add_done_callback, _copy)
        return out

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.description} {state}>"


class _Born(Work):
    """A Work born complete (``Work.born``): awaiting it ends at once with its result.

    It has no future, so nothing ever waits on it (its waiters are never read, nor set).
    """

    __slots__ = ()
    _future = None  # (read as the slot would be: every method's test for "born complete")

    def __await__(self) -> Generator[Any, None, Any]:
        return self._result
        yield  # (a generator: ``await`` needs an iterator)

    def wake(self, _fut: Any = None) -> None:
        return None


_new = object.__new__


def _on_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _ready(result: Any) -> Generator[Any, None, Any]:
    """What awaiting a Work born complete runs: it ends at once with ``result``."""
    return result
    yield  # (a generator: ``await`` needs an iterator)
