"""The blocking Work handle that aiocoll.sync returns for ``async_op=True`` and isend/irecv.

It also holds the queries (done? failed? result?) it shares with the Work of aiocoll.torch.

Imports only aiocoll foundations and the loop-thread bridge; torch is imported lazily, and only
when the caller's process already loaded it, so a numpy-only script never pays for it. It exists
apart from sync.py so that the facade module reads as the list of torch.distributed's functions.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import sys
from collections.abc import Callable
from typing import Any

from ._deadline import to_seconds
from ._sync_loop import Outcome

__all__ = ["OutcomeQueries", "Work"]


class OutcomeQueries:
    """The queries a Work answers from the bridge's Outcome, shared with aiocoll.torch's Work.

    The class that uses it sets ``_outcome``, ``_op``, ``_tensors`` and ``_source_rank_of`` (as
    this module's Work does) and defines ``wait``; only waiting differs between the two Works.
    """

    _outcome: Outcome
    _op: str
    _tensors: list[Any]
    _source_rank_of: Callable[[Any], int] | None

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        raise NotImplementedError

    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""
        return self._outcome.done()

    def is_success(self) -> bool:
        """True once the operation finished without an error."""
        return self._outcome.done() and self._outcome.exception() is None

    def exception(self) -> BaseException | None:
        """The operation's error, or None (also None while it is still running)."""
        if not self._outcome.done():
            return None
        return self._outcome.exception()

    def result(self) -> list[Any]:
        """The output tensors, after waiting for completion (torch's ``Work.result``)."""
        self.wait()
        return list(self._tensors)

    def _sender(self, method: str) -> int:
        """What ``method`` (source_rank or _source_rank) returns.

        That is the rank a recv from any source received from, once it completed.

        Raises:
            RuntimeError: for an operation that is not a recv from any source.
        """
        if self._source_rank_of is None:
            raise RuntimeError(f"{method}() is only defined for recv from any source, not {self._op}")
        return self._source_rank_of(self._outcome.result())


class Work(OutcomeQueries):
    """A launched operation: torch.distributed's ``Work`` for the blocking facade.

    Args:
        outcome: the bridge's handle on the async core's Work.
        op: the operation's name, for messages.
        tensors: what ``result()`` and the future's value hold (torch returns the output tensors).
        source_rank: for a recv from any source, turns the core's result into the global source
            rank (None for every other operation).
    """

    def __init__(
        self,
        outcome: Outcome,
        op: str,
        tensors: list[Any],
        source_rank: Callable[[Any], int] | None = None,
    ) -> None:
        self._outcome = outcome
        self._op = op
        self._tensors = tensors
        self._source_rank_of = source_rank

    def wait(self, timeout: float | datetime.timedelta | None = None) -> bool:
        """Block until the operation completes; returns True like torch.

        Args:
            timeout: seconds or timedelta to wait at most; None (or 0, as in torch) waits until
                the operation's own deadline ends it.

        Returns:
            True once the operation completed.

        Raises:
            DistError: the operation's own error (CollectiveTimeout, PeerLostError,
                MismatchError, ...).
            TimeoutError: ``timeout`` ran out first (the operation keeps running).
        """
        seconds = to_seconds(timeout)
        if seconds == 0:
            seconds = None
        if not self._outcome.wait(seconds):
            raise TimeoutError(
                f"{self._op} did not complete within the {seconds:.3g}s given to Work.wait(); it is "
                f"still running (its own deadline is the group timeout)"
            )
        self._outcome.result()  # raises the operation's own error
        return True

    def source_rank(self) -> int:
        """The global rank a recv from any source received from (waits for completion).

        Raises:
            RuntimeError: for an operation that is not a recv from any source.
        """
        return self._sender("source_rank")

    _source_rank = source_rank

    def get_future(self) -> Any:
        """A future completed with the output tensors (a list) or the operation's error.

        Returns:
            ``torch.futures.Future`` when torch is loaded in this process, else a
            ``concurrent.futures.Future``. It is completed on aiocoll's completion threads, never
            on the network loop, so its callbacks may block.
        """
        torch = sys.modules.get("torch")
        future: Any = torch.futures.Future() if torch is not None else concurrent.futures.Future()

        def complete(outcome: Outcome) -> None:
            exc = outcome.exception()
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(list(self._tensors))

        if self._outcome.done():
            # Already finished: complete it here, so that value() right after wait() works.
            complete(self._outcome)
        else:
            self._outcome.add_done_callback(complete)
        return future

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<aiocoll.sync.Work {self._op} {state}>"
