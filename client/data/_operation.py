"""What a provider of the group's table implements (``Provider``), the one shape it returns
(``Starter``), and the operation's one record (``Operation``, defined in _op_record.py with the
engine's part of it) that the public layer builds and every provider reads.

Imports foundations only (aiocoll.algorithms) and the operation record (_op_record.py:
Operation, OpTransport, Stoppable); every provider (_shm_arena.py, routing.py, providers.py,
_p2p_row.py, _device_rows.py, _objects.py) and the engine import it, so none imports another
for these names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, ClassVar, Protocol

from aiocoll.algorithms import KINDS, CollectiveSpec, Tag

from ._op_record import DEFAULT_TIMEOUT, DEVICE, HOST, Operation, OpTransport, Stoppable

__all__ = [
    "COLLECTIVE_KINDS",
    "DEFAULT_TIMEOUT",
    "DEVICE",
    "HANDED_OFF",
    "HOST",
    "OBJECT_KINDS",
    "P2P_KINDS",
    "Body",
    "Finish",
    "Operation",
    "Provider",
    "Starter",
    "all_reduce_operation",
    "as_starter",
    "awaiting",
    "copying_back",
    "finish_with_copy_back",
    "p2p_operation",
    "spec_of",
]

COLLECTIVE_KINDS = frozenset(KINDS)  # what the algorithms run
P2P_KINDS = frozenset({"send", "recv"})
# Operations on picklable objects, and the forming of a sub-group (the parent's agreement on
# what the new group's providers may use): host memory, run in steps over the links.
OBJECT_KINDS = frozenset(
    {"broadcast_object", "all_gather_object", "gather_object", "scatter_object", "new_group"}
)

Finish = Callable[[Any, BaseException | None], None]
# What a provider returns for an operation it takes: ``start(tag, transport, finish)`` begins it
# inside the engine's call and arranges ``finish(result, None)`` or ``finish(None, error)``
# exactly once (Engine.submit_op, which hands it the record's own ``op.finish``; a wrapper, as a
# staged chain's, may hand its own); the engine calls the returned runner's ``stop()`` if it fails
# the operation from outside.
Starter = Callable[[Tag, OpTransport, Finish], Stoppable]
Body = Callable[[Tag, OpTransport], Coroutine[Any, Any, Any]]


class Provider(Protocol):
    """A row of a group's provider table (see client/data/providers.py).

    It declares, once, what it takes: ``kinds`` (of COLLECTIVE_KINDS, P2P_KINDS, OBJECT_KINDS),
    ``memory`` (HOST, DEVICE) and ``priority`` (the table asks the rows that serve an operation's
    kind and memory highest first); ``why`` says why it serves the group (the table's DEBUG log).
    ``prepare`` returns a ``Starter`` for an operation it takes, or None for one it declines
    (the arena runs only in-place all_reduces); the table then asks the next row.
    """

    name: ClassVar[str]
    memory: ClassVar[frozenset[str]]
    priority: ClassVar[int]
    kinds: frozenset[str]
    why: str

    def prepare(self, op: Operation) -> Starter | None: ...

    def close(self) -> None: ...


def finish_with_copy_back(op: Operation, finish: Finish) -> Finish:
    """``finish`` after the copy-back of ``op``'s working arrays (Operation.finish_copied): the
    record's bound method when ``finish`` is the record's own, else one bound to ``finish``."""
    if finish == op.finish:
        return op.finish_copied
    return partial(op.finish_copied, finish=finish)


class _TaskRunner:
    """An operation run as a task (``as_starter``): ``stop`` cancels it."""

    __slots__ = ("_task",)

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self._task = task

    @property
    def task(self) -> asyncio.Task[Any]:
        """Its task (the flight recorder tells a queued operation, whose task has not run yet)."""
        return self._task

    def stop(self) -> None:
        self._task.cancel()


class _HandedOff:
    """The runner of an operation that finished inside its starter: nothing to stop."""

    __slots__ = ()

    def stop(self) -> None:
        return None


HANDED_OFF: Stoppable = _HandedOff()


def awaiting(rest: Awaitable[Any]) -> Body:
    """The body of an operation whose remaining work is ``rest`` (begun already)."""

    async def body(tag: Tag, transport: OpTransport) -> Any:
        return await rest

    return body


def as_starter(body: Body) -> Starter:
    """The starter of an operation that runs as a task: ``await body(tag, transport)``, whose
    return value (or error) finishes it from inside the task (no loop turn between the two).
    A task cancelled from outside finishes it with CancelledError (the engine says which
    operation; when the engine stopped it, that outcome is ignored)."""

    def start(tag: Tag, transport: OpTransport, finish: Finish) -> Stoppable:
        ran = False

        async def run() -> None:
            nonlocal ran
            ran = True
            try:
                result = await body(tag, transport)
            except asyncio.CancelledError:
                finish(None, asyncio.CancelledError())
                raise
            except BaseException as exc:
                finish(None, exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                finish(result, None)

        task = transport.loop.create_task(run())

        def never_ran(task: asyncio.Task[None]) -> None:
            # A task cancelled before its first step never runs ``run``: finish it here, so
            # whatever waits on ``finish`` (a staged chain's next operation) is let go.
            if not ran:
                finish(None, asyncio.CancelledError())

        task.add_done_callback(never_ran)
        return _TaskRunner(task)

    return start


def copying_back(op: Operation, body: Body) -> Starter:
    """The starter of an operation that runs as a task (``as_starter``) and then copies its
    results back into the caller's tensors (``finish_with_copy_back``): it completes with
    ``op.result``, which the body may set (a receive: the sender's group rank)."""
    run = as_starter(body)

    def start(tag: Tag, transport: OpTransport, finish: Finish) -> Stoppable:
        return run(tag, transport, finish_with_copy_back(op, finish))

    return start


def spec_of(op: Operation, ranks: tuple[int, ...], me: int) -> CollectiveSpec:
    """The algorithms' description of an operation for member ``me`` of the group ``ranks``."""
    return CollectiveSpec(
        op.kind, ranks, me, tuple(op.inputs), tuple(op.outputs), op.root, op.op, None, op.meta.get("dtype")
    )  # (positional: keywords cost more than the rest of building it)


def p2p_operation(
    kind: str,
    meta: dict[str, Any],
    array: Any,
    working: Any,
    memory: str,
    peer: int | None,
    tag: int,
    timeout: Any,
) -> Operation:
    """The record of a send (of ``array``) or a receive (into ``array``, the working
    ``working``'s) with the user's ``tag``, to or from global rank ``peer`` (None: from any)."""
    if kind == "send":
        o = Operation(kind, meta, (array,), (), (), None, timeout, memory)
    else:
        o = Operation(kind, meta, (), (array,), (working,), None, timeout, memory)
    o.p2p_tag = tag
    if peer is not None:
        o.peers = (peer,)
    return o


def all_reduce_operation(
    meta: dict[str, Any], array: Any, working: Any, reduce_op: Any, tensor: Any, timeout: Any, memory: str
) -> Operation:
    """The record of an all_reduce of ``array`` in place (``working``'s, the caller's
    ``tensor``'s), by ``reduce_op``; it completes with ``tensor``."""
    arrays = (array,)  # in place: one tuple for what it reads and writes
    o = Operation("all_reduce", meta, arrays, arrays, (working,), tensor, timeout, memory)
    o.op = reduce_op
    return o
