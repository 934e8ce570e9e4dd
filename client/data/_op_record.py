"""One operation's record (``Operation``: the fields every operation carries once, from its
call to its end, built by the public layer and carried by the provider table, the provider and
the engine), which is also the transport as the operation sees it (``OpTransport``, the same
class: it counts the messages the operation still waits for, so a timeout can name the ranks that
did not answer); and the group it runs in (``GroupState``).

Imports foundations only (aiocoll._errors, aiocoll._types, aiocoll._work,
aiocoll.algorithms._transport, the device span type); client/data/_operation.py re-exports
Operation, and client/data/engine.py, which sequences and runs these records, GroupState and
OpTransport.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from aiocoll._deadline import to_seconds
from aiocoll._errors import DistError, PeerLostError, group_name
from aiocoll._types import ReduceOp
from aiocoll._work import Work
from aiocoll.algorithms._transport import (
    LandedCallback,
    LostPeerHandler,
    RecvCallback,
    StrayHandler,
    Tag,
    Transport,
)
from aiocoll.device._tensors import DEVICE, HOST

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEVICE",
    "FINISHED",
    "HOST",
    "STARTING",
    "GroupState",
    "OpTransport",
    "Operation",
    "Stoppable",
    "checked_timeout",
]

# An operation's timeout when its call gave none: its engine's default (Engine.default_timeout),
# read only if it does not complete inside its call.
DEFAULT_TIMEOUT: Any = object()

_T = TypeVar("_T")
_monotonic = time.monotonic
_NO_COUNTS: Mapping[Any, int] = MappingProxyType({})


class Stoppable(Protocol):
    """What an eager operation's starter returns: ``stop()`` when the engine failed it."""

    def stop(self) -> None: ...


class GroupState:
    """One process group as the engine sees it.

    Attributes:
        gid: the group id (the same string on every member). ranks: members' global ranks, in
        group-rank order. index: this process's rank within the group. label: the name messages
        give the group (``group_name(gid)``: "world" for the world group, unless the layer above
        names it, as the torch backend does with torch's group name).
    """

    __slots__ = (
        "broken",
        "broken_seq",
        "engine",
        "failing",
        "gid",
        "index",
        "label",
        "loop",
        "members",
        "next_seq",
        "notices",
        "pending",
        "ranks",
        "stuck",
        "transport",
    )

    def __init__(self, gid: str, ranks: Sequence[int], my_rank: int) -> None:
        self.gid = gid
        self.label = group_name(gid)
        self.ranks = tuple(ranks)
        self.members = frozenset(ranks)
        self.index = self.ranks.index(my_rank)
        self.loop: asyncio.AbstractEventLoop | None = None  # its engine's (Engine.group)
        self.engine: Any = None  # the engine that made it (client/data/engine.Engine)
        self.transport: Transport = None  # type: ignore[assignment]  # its engine's (Engine.group)
        self.next_seq = 0
        self.pending: set[Operation] = set()
        self.broken: BaseException | None = None
        self.broken_seq = 0  # calls with seq >= broken_seq fail (p2p always, once broken)
        self.notices: dict[int, DistError] = {}  # failures reported for seqs not called yet
        # seq -> {rank: ranks it was still waiting for} from timeout reports (see Deadlines._expire)
        self.stuck: dict[int, dict[int, list[int]]] = {}
        # failures being carried to the pending operations (Engine._fail_pending), in turn
        self.failing: list[tuple[BaseException, int, Operation | None]] = []


class Operation(Transport):
    """One operation, from its call to its end: the public layer builds it with the fields every
    provider reads (aiocoll/api.py), the group's table hands it to the provider that takes it and
    to the engine (client/data/providers.ProviderTable.submit), the engine sequences it
    (``group``, ``seq``, ``tag``) and finishes it. It is also the transport as the operation sees
    it (its starter's ``transport``): it counts the messages the operation still waits for, so a
    timeout can name the ranks that did not answer.

    Attributes (the public layer's):
        kind: "all_reduce", "send", "broadcast_object", ... meta: its signature
        (aiocoll._signature: what every rank must agree on; a message's meta for send).
        inputs, outputs: the arrays it reads and writes (host numpy arrays or device spans; for
        the object kinds, the pickled objects and nothing). workings: the call's tensors
        (aiocoll.device._tensors.Working), copied back on success. result: what the Work completes
        with (the object kinds and a receive compute theirs). root: the group rank of a rooted
        kind. op: the reduce op. timeout: seconds (None: no deadline; DEFAULT_TIMEOUT: the
        engine's default, until the engine reads it). p2p_tag: the user's tag of a
        point-to-point operation (None for the rest). peers: the global ranks a point-to-point
        operation talks to (none: a receive from any rank). memory: HOST or DEVICE (any array a
        device span: the public layer says which, from its tensors' Workings).

    The fields every operation sets are slots. Those only some kinds set (root, op, p2p_tag,
    peers: the public layer sets them after making the record) and those most operations never
    set (a future, a deadline, the message counts, ...) are class attributes until set (then in
    the instance's dict, which the Transport base gives it), so an operation that completes
    inside its call (the commonest small one) pays only for the few it uses.
    """

    __slots__ = (
        "group",
        "inputs",
        "kind",
        "memory",
        "meta",
        "outputs",
        "result",
        "seq",
        "sig",
        "started",
        "tag",
        "timeout",
        "workings",
    )
    # set by the engine when it sequences the operation (Engine.submit_op)
    group: GroupState
    seq: int  # its group's sequence number (-1: point-to-point)
    # and, when it does not end inside its starter (whose ``tag`` argument it is), kept with it
    tag: Tag  # its messages' tag
    sig: dict[str, Any] | None  # what every rank must agree on (None: point-to-point)
    started: float  # time.monotonic() at its call

    # The fields only some kinds set (the public layer sets them after making the record).
    root = 0  # the group rank of a rooted kind
    op = ReduceOp.SUM  # the reduce op
    p2p_tag: int | None = None  # the user's tag of a point-to-point operation
    peers: tuple[int, ...] = ()  # the global ranks a point-to-point operation talks to
    # Where it was called (the flight recorder, client/_recorder.py), set by the engine when
    # the recorder is on.
    site: Any = None
    # None only while its starter runs on the straight path (Engine.submit_op): one that
    # completes inside it never gets a future, any other gets one (``Engine._promote``) before
    # anything else sees the operation.
    future: asyncio.Future[Any] = None  # type: ignore[assignment]
    work: Work = None  # type: ignore[assignment]
    # its runner (client/data/_operation.Starter's return); None while its starter runs on the
    # straight path, FINISHED once it ended
    lane: Stoppable | None = None
    deadline: float | None = None
    abort_exc: BaseException | None = None
    # messages still awaited, by peer: read-only empty until the operation counts one (``_counts``)
    outstanding_recv: Mapping[int | None, int] = _NO_COUNTS
    outstanding_send: Mapping[int, int] = _NO_COUNTS
    # whether the engine retires its tag once it succeeded: False for an operation that sends no
    # message under its tag and completes only once every member ran it the same way (see
    # Engine.submit_op), so that no message under the tag can come
    retires = True

    def __init__(
        self,
        kind: str,
        meta: dict[str, Any],
        inputs: Sequence[Any],
        outputs: Sequence[Any],
        workings: Sequence[Any],
        result: Any,
        timeout: Any,
        memory: str = HOST,
    ) -> None:
        self.kind = kind
        self.meta = meta
        self.inputs = inputs
        self.outputs = outputs
        self.workings = workings
        self.result = result
        self.timeout = checked_timeout(timeout)
        self.memory = memory

    def describe(self) -> str:
        return _describe(self.kind, self.group, self.seq)

    def describer(self) -> Callable[[], str]:
        # Described only when something reads it, by a function that does not hold this op
        # (op -> work -> op would be a reference cycle: every operation would wait for the
        # cyclic garbage collector instead of being freed when it finishes).
        return functools.partial(_describe, self.kind, self.group, self.seq)

    def finish(self, result: Any, exc: BaseException | None) -> None:
        """The starter's ``finish``: the operation's outcome, taken once (a late one is ignored)."""
        lane = self.lane
        if lane is None:  # inside its starter: kept for the straight path (Engine.submit_op)
            self.lane = FINISHED
            self.result = result
            self.abort_exc = exc
            return
        if lane is FINISHED:
            return
        self.lane = FINISHED
        engine = self.group.engine
        future = self.future
        if exc is None and not future.done():
            future.set_result(result)
            engine._finish(self, True)
            return
        engine._settle(self, result, exc)
        engine._finish(self)

    def finish_copied(self, _: Any, exc: BaseException | None, finish: Any = None) -> None:
        """The one copy-back-then-finish, a ``finish`` callback (its first argument ignored):
        on success, copy every working array back to its tensor
        (aiocoll.device._tensors.Working.finish), then complete the operation with ``result``
        (by ``finish`` when given, a starter's own that wraps this record's); a failed
        copy-back fails it instead. A bound method, so a starter handed the record's own
        ``finish`` makes no closure for it."""
        if exc is None:
            try:
                for w in self.workings:
                    if w.staged:  # (an array that is the tensor's own memory has nothing to copy)
                        w.finish()
            except Exception as copy_back:  # e.g. a tensor's copy_ refused the result
                exc = copy_back
        if finish is None:
            self.finish(self.result, exc)
        else:
            finish(self.result, exc)

    # -- the transport as the operation sees it ----------------------------------------------
    def _counts(self, sending: bool) -> dict[Any, int]:
        """The operation's own counts of messages still awaited (made at its first)."""
        counts = self.outstanding_send if sending else self.outstanding_recv
        if counts is _NO_COUNTS:
            counts = {}
            if sending:
                self.outstanding_send = counts
            else:
                self.outstanding_recv = counts
        return counts  # type: ignore[return-value]

    @property
    def rank(self) -> int:  # type: ignore[override]
        return self.group.transport.rank

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return self.group.transport.world_size

    @property
    def inner(self) -> Transport:
        return self.group.transport

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop its engine runs on (a call of the blocking facade starts operations
        from the caller's thread)."""
        loop = self.group.loop
        assert loop is not None  # every group is made by its engine
        return loop

    async def send(self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> None:
        await _counting(self._counts(True), dst, self.group.transport.send(dst, tag, payload, meta))

    def send_nowait(
        self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> Awaitable[None] | None:
        """Start a send inline where the inner transport can (see Transport.send_nowait). None:
        the payload was handed off at once."""
        rest = self.group.transport.send_nowait(dst, tag, payload, meta)
        if rest is None:
            return None
        return self.sending(dst, rest)

    def sending(self, dst: int, rest: Awaitable[None]) -> Awaitable[None]:
        """``rest``, the hand-off of a send to ``dst`` that the transport did not finish at once,
        counted among what the operation still awaits (a timeout names ``dst``)."""
        return _counting(self._counts(True), dst, rest)

    def recv_now(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | None:
        return self.group.transport.recv_now(src, tag, into)

    async def recv(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        return await _counting(self._counts(False), src, self.group.transport.recv(src, tag, into))

    async def recv_landed(
        self, src: int | None, tag: Tag, into: memoryview
    ) -> tuple[int, dict[str, Any], memoryview]:
        return await _counting(self._counts(False), src, self.group.transport.recv_landed(src, tag, into))

    def post_recv(self, src: int | None, tag: Tag, into: memoryview, callback: RecvCallback) -> None:
        self.group.transport.post_recv(src, tag, into, self._counted(src, callback))

    def post_recv_landed(self, src: int | None, tag: Tag, into: memoryview, callback: LandedCallback) -> None:
        self.group.transport.post_recv_landed(src, tag, into, self._counted(src, callback))

    def _counted(self, src: int | None, callback: Callable[[Any, BaseException | None], None]) -> Any:
        """``callback``, counted as a receive outstanding from ``src`` until it runs."""
        pending = self._counts(False)
        pending[src] = pending.get(src, 0) + 1

        def counted(result: Any, exc: BaseException | None) -> None:
            pending[src] -= 1
            callback(result, exc)

        return counted

    def discard(self, tag_prefix: Tag) -> None:
        self.group.transport.discard(tag_prefix)

    def waiting_for(self, ranks: Iterable[int]) -> None:
        """An operation that waits without messages (shared memory) says whom it waits for now,
        so progress reports and a timeout name them as they name a missing message's sender."""
        pending = self._counts(False)
        pending.clear()
        for rank in ranks:
            pending[rank] = 1

    def holds(self, src: int, tag: Tag) -> bool:
        return self.group.transport.holds(src, tag)

    def retire(self, tag_prefix: Tag) -> None:
        self.group.transport.retire(tag_prefix)

    def on_stray(self, handler: StrayHandler) -> None:
        self.group.transport.on_stray(handler)

    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        self.group.transport.on_peer_lost(handler)

    def mark_lost(self, rank: int, reason: str) -> None:
        self.group.transport.mark_lost(rank, reason)

    def take_in_from(self, rank: int) -> PeerLostError | None:
        return self.group.transport.take_in_from(rank)

    @property
    def lost_peers(self) -> dict[int, str]:
        return self.group.transport.lost_peers

    def debug_state(self) -> dict[str, Any]:
        return self.group.transport.debug_state()

    async def aclose(self) -> None:  # an operation never closes the shared transport
        return None


# The transport a starter is handed: the operation's record itself.
OpTransport = Operation


def checked_timeout(timeout: Any) -> Any:
    """A call's timeout as an operation keeps it, checked at the call before anything runs:
    DEFAULT_TIMEOUT as it is (the engine's default), else seconds (None: no deadline).

    Raises:
        ValueError: a negative or NaN timeout.
    """
    return timeout if timeout is DEFAULT_TIMEOUT else to_seconds(timeout)


def _describe(kind: str, group: GroupState, seq: int) -> str:
    if seq >= 0:
        return f"{kind} (group {group.label!r}, seq {seq})"
    return f"{kind} (group {group.label!r})"


class _Finished:
    """Marks an eager operation the engine has finished (its runner's late outcome is ignored)."""

    def stop(self) -> None:
        return None


FINISHED: Stoppable = _Finished()
STARTING: Stoppable = _Finished()  # an eager operation whose starter has not returned yet


async def _counting(pending: dict[Any, int], key: Any, transfer: Awaitable[_T]) -> _T:
    """Await ``transfer`` while ``pending[key]`` counts it (what a timeout reports as missing)."""
    pending[key] = pending.get(key, 0) + 1
    try:
        return await transfer
    finally:
        pending[key] -= 1
