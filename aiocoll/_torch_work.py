"""The torch.distributed ``Work`` that the aiocoll backend returns, and the error-carrying future.

Imports torch, the loop-thread bridge (aiocoll._sync_loop) and the queries both Works share
(aiocoll._sync_work); only aiocoll.torch imports it. It exists apart from torch.py so that the
backend module reads as the list of methods c10d calls.

Two torch facts shape it: ``Future.set_exception`` stores the exception as a plain value at the
C++ level (DDP's reducer would read it as a result), so errors are raised inside a ``.then``
callback, which marks the chained future failed for C++ and Python alike; and ``.then``
callbacks run inline on the completing thread, so futures are completed on aiocoll's
completion pool, never on the network loop thread.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as td

from ._deadline import to_seconds
from ._sync_loop import Outcome
from ._sync_work import OutcomeQueries
from .device._device import DeviceError
from .device._staging import CallerStreamContext

__all__ = ["AiocollWork"]

# Guards the making and the completing of every Work's torch future (short sections only).
_futures_lock = threading.Lock()


class _Failed:
    """Marks a failed operation inside the raw future; the chained callback raises ``error``."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(raw: torch.futures.Future[Any]) -> Any:
    value = raw.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class AiocollWork(OutcomeQueries, td.Work):
    """One launched aiocoll operation, as torch.distributed's Work.

    Args:
        outcome: the bridge's handle on the async core's Work.
        op: the operation's name, for messages.
        tensors: the future's value and ``result()``: the output tensors, as c10d returns them.
        source_rank: for recv from any source, turns the core's result (the group rank of the
            sender) into what ``_source_rank()`` returns.
        streams: for CUDA tensors, the caller's stream context (aiocoll.device._staging); the operation
            leaves its completion events there. ``wait()`` makes the caller's current stream wait
            for them; the future completes once they were reached.
    """

    # The torch future is made on the first get_future() (DDP's reducer and comm hooks ask for it;
    # a plain torch.distributed call only waits): a future, its .then chain and a turn of the
    # completion pool cost more than the rest of a small operation's call. (Class defaults until
    # then: nothing to set per call.)
    _raw: torch.futures.Future[Any] | None = None
    _future: torch.futures.Future[Any] | None = None
    _completed = False

    def __init__(
        self,
        outcome: Outcome,
        op: str,
        tensors: list[torch.Tensor],
        source_rank: Callable[[Any], int] | None = None,
        streams: CallerStreamContext | None = None,
    ) -> None:
        super().__init__()
        self._streams = streams
        self._outcome = outcome
        self._op = op
        self._tensors = tensors
        self._source_rank_of = source_rank

    def _complete(self, outcome: Outcome) -> None:
        # Runs on the completion pool, or on a thread returning from wait() or asking for the
        # future of a finished operation; set_result runs the .then chain (and DDP's or a comm
        # hook's callbacks) inline on that thread. Whichever comes first completes the future,
        # so value() right after wait() never sees it pending.
        with _futures_lock:
            if self._completed or self._raw is None:
                return
            self._completed = True
            raw = self._raw
        exc = outcome.exception()
        if exc is None and self._streams is not None:
            # On the completion pool: the future's users (DDP's reducer, comm hooks) read the
            # results on their own streams, so they must be on the device first.
            try:
                for _device, event in self._streams.completion:
                    event.wait(None)
            except DeviceError as failed:
                exc = failed
        raw.set_result(_Failed(exc) if exc is not None else self._tensors)

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Block until the operation completes; a timeout of 0 or None waits without limit.

        Returns:
            True once the operation completed.

        Raises:
            DistError: the operation's own error (CollectiveTimeout, PeerLostError,
                MismatchError, ...).
            TimeoutError: ``timeout`` ran out first.
        """
        outcome = self._outcome
        if not outcome.done():  # (a call that finished inside its start needs no timeout read)
            seconds = to_seconds(timeout) if timeout is not None else None
            if not outcome.wait(seconds or None):
                raise TimeoutError(f"aiocoll {self._op} did not complete within {seconds}s of Work.wait()")
        streams = self._streams
        if streams is not None and streams.completion:  # (_on_device, at every blocking call)
            # CUDA tensors: the network part was waited for on the host; the caller's current
            # stream waits for the copies back (as torch's collectives do), not the host. The
            # future completes on the completion pool once they were reached.
            outcome.result()  # raises the operation's own error
            for device, event in streams.completion:
                device.current_stream().wait_event(event)
            return True
        if self._raw is not None:
            self._complete(outcome)
            # Another thread may have won the race to complete it and still be inside
            # set_result: wait until the future is marked done (that precedes its callbacks).
            assert self._future is not None
            with contextlib.suppress(Exception):
                self._future.wait()
        outcome.result()  # raises the operation's own error
        return True

    def _on_device(self) -> bool:
        """True when the operation left completion events (CUDA tensors); final once it is done."""
        return self._streams is not None and bool(self._streams.completion)

    @property
    def outcome(self) -> Outcome:
        """The bridge's handle on the operation (to combine several, as coalescing does)."""
        return self._outcome

    @property
    def result_tensors(self) -> list[torch.Tensor]:
        """The output tensors (what the future's value and ``result()`` hold)."""
        return self._tensors

    def get_future(self) -> torch.futures.Future[Any]:
        """A torch Future whose value is the list of output tensors (or that fails with the error)."""
        with _futures_lock:
            future = self._future
            if future is not None:
                return future
            raw: torch.futures.Future[Any] = torch.futures.Future()
            future = self._future = raw.then(_unwrap)
            # (after the future: wait() reads _raw without the lock, then the future)
            self._raw = raw
        if self._outcome.done() and not self._on_device():
            self._complete(self._outcome)  # finished: complete it here, so value() works at once
        else:
            self._outcome.add_done_callback(self._complete)
        return future

    def _source_rank(self) -> int:
        return self._sender("_source_rank")

    source_rank = _source_rank

    def __repr__(self) -> str:
        return f"<aiocoll torch Work {self._op} {'completed' if self.is_completed() else 'pending'}>"
