"""What a collective provider implements and is handed (see client/providers.py).

Imports foundations only (aiocoll._types, aiocoll.algorithms); the providers (client/_shm_coll.py,
client/routing.py, client/providers.py) import it, so none imports another for these names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec

__all__ = ["Finish", "Provider", "finish_with_copy_back", "spec_of"]

Finish = Callable[[Any, BaseException | None], None]


class Provider(Protocol):
    """What a collective provider implements (see client/providers.py).

    An operation reaches ``prepare`` as the public layer built it, field by field (no object is
    made for it: this runs on every call): ``kind`` ("all_reduce", ...); ``meta``, its signature
    (aiocoll._signature); ``send`` and ``recv``, the arrays it reads and writes (host numpy arrays
    or device spans); ``workings``, the call's tensors (aiocoll.device._tensors.Working), copied
    back on success; ``result``, what the Work completes with; ``root``, the group rank of a
    rooted kind; ``op``, the reduce op.

    ``eager`` providers return an engine starter from ``prepare`` (``start(tag, transport,
    finish)``, Engine.submit_eager: runs from callbacks); the others an engine body (``await
    body(tag, transport)``, Engine.submit: runs as a task). ``prepare`` returns None for an
    operation this provider declines; the table then asks the next one for that kind.
    """

    name: ClassVar[str]
    eager: ClassVar[bool]
    kinds: frozenset[str]

    def prepare(
        self,
        kind: str,
        meta: dict[str, Any],
        send: Sequence[Any],
        recv: Sequence[Any],
        workings: Sequence[Any],
        result: Any,
        root: int,
        op: ReduceOp,
    ) -> Any: ...

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


def spec_of(
    kind: str,
    meta: dict[str, Any],
    send: Sequence[Any],
    recv: Sequence[Any],
    root: int,
    op: ReduceOp,
    ranks: tuple[int, ...],
    me: int,
) -> CollectiveSpec:
    """The algorithms' description of an operation for member ``me`` of the group ``ranks``."""
    return CollectiveSpec(
        kind, ranks, me, tuple(send), tuple(recv), root, op, None, meta.get("dtype")
    )  # (positional: keywords cost more than the rest of building it)
