"""What a collective provider is handed and what it implements (see client/providers.py).

Imports foundations only (aiocoll._types, aiocoll.algorithms); the providers (client/_shm_coll.py,
client/routing.py, client/providers.py) import it, so none imports another for these names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec

__all__ = ["Finish", "Operation", "Provider", "finish_with_copy_back", "spec_of"]

Finish = Callable[[Any, BaseException | None], None]


class Operation:
    """One collective call as the public layer built it: what every provider is handed.

    Attributes:
        kind: the operation ("all_reduce", ...). meta: its signature (aiocoll._signature).
        send, recv: the arrays it reads and writes (host numpy arrays or device spans).
        workings: the call's tensors (aiocoll.device._tensors.Working), copied back on success.
        result: what the Work completes with. root: group rank of a rooted kind. op: reduce op.
    """

    __slots__ = ("kind", "meta", "op", "recv", "result", "root", "send", "workings")

    def __init__(
        self,
        kind: str,
        meta: dict[str, Any],
        send: Sequence[Any],
        recv: Sequence[Any],
        workings: Sequence[Any],
        result: Any,
        root: int = 0,
        op: ReduceOp = ReduceOp.SUM,
    ) -> None:
        self.kind = kind
        self.meta = meta
        self.send = send
        self.recv = recv
        self.workings = workings
        self.result = result
        self.root = root
        self.op = op


class Provider(Protocol):
    """What a collective provider implements (see the module header).

    ``eager`` providers return an engine starter from ``prepare`` (``start(tag, transport,
    finish)``, Engine.submit_eager: runs from callbacks); the others an engine body (``await
    body(tag, transport)``, Engine.submit: runs as a task). ``prepare`` returns None for an
    operation this provider declines; the table then asks the next one for that kind.
    """

    name: ClassVar[str]
    eager: ClassVar[bool]
    kinds: frozenset[str]

    def prepare(self, operation: Operation) -> Any: ...

    def close(self) -> None: ...


def finish_with_copy_back(workings: Sequence[Any], result: Any, finish: Finish) -> Finish:
    """The one copy-back-then-finish: a ``Finish`` callback (its first argument ignored) that, on
    success, copies every working array back to its tensor (aiocoll.device._tensors.Working.finish)
    and then completes the operation with ``result``; a failed copy-back fails it instead."""

    def done(_: Any, exc: BaseException | None) -> None:
        if exc is None:
            try:
                for w in workings:
                    w.finish()
            except Exception as copy_back:  # e.g. a tensor's copy_ refused the result
                exc = copy_back
        finish(result, exc)

    return done


def spec_of(operation: Operation, ranks: tuple[int, ...], me: int) -> CollectiveSpec:
    """The algorithms' description of ``operation`` for member ``me`` of the group ``ranks``."""
    return CollectiveSpec(
        operation.kind,
        ranks,
        me,
        tuple(operation.send),
        tuple(operation.recv),
        operation.root,
        operation.op,
        None,
        operation.meta.get("dtype"),
    )  # (positional: keywords cost more than the rest of building it)
