"""One operation as the engine holds it: the group it runs in (``GroupState``), its record
(``_Op``: the fields every operation carries once, from its call to its end), and the transport
as it sees it (``OpTransport``, which counts the messages it still waits for, so a timeout can
name the ranks that did not answer).

Imports foundations only (aiocoll._errors, aiocoll._work, aiocoll.algorithms._transport);
client/data/engine.py, which creates and runs these records, re-exports GroupState and OpTransport.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

from aiocoll._errors import DistError, PeerLostError, group_name
from aiocoll._work import Work
from aiocoll.algorithms._transport import (
    LandedCallback,
    LostPeerHandler,
    RecvCallback,
    StrayHandler,
    Tag,
    Transport,
)

__all__ = ["GroupState", "OpTransport", "Stoppable"]

_T = TypeVar("_T")
_monotonic = time.monotonic


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
    )

    def __init__(self, gid: str, ranks: Sequence[int], my_rank: int) -> None:
        self.gid = gid
        self.label = group_name(gid)
        self.ranks = tuple(ranks)
        self.members = frozenset(ranks)
        self.index = self.ranks.index(my_rank)
        self.loop: asyncio.AbstractEventLoop | None = None  # its engine's (Engine.group)
        self.next_seq = 0
        self.pending: set[_Op] = set()
        self.broken: BaseException | None = None
        self.broken_seq = 0  # calls with seq >= broken_seq fail (p2p always, once broken)
        self.notices: dict[int, DistError] = {}  # failures reported for seqs not called yet
        # seq -> {rank: ranks it was still waiting for} from timeout reports (see Engine._expire)
        self.stuck: dict[int, dict[int, list[int]]] = {}
        # failures being carried to the pending operations (Engine._fail_pending), in turn
        self.failing: list[tuple[BaseException, int, _Op | None]] = []


class _Op:
    # Where it was called (the flight recorder, client/_recorder.py): set by Engine._open.
    site: Any

    __slots__ = (
        "abort_exc",
        "deadline",
        "future",
        "group",
        "kind",
        "lane",
        "outstanding_recv",
        "outstanding_send",
        "peers_hint",
        "result",
        "seq",
        "sig",
        "site",
        "started",
        "tag",
        "timeout",
        "work",
    )

    def __init__(
        self,
        group: GroupState,
        kind: str,
        seq: int,
        tag: Tag,
        future: asyncio.Future[Any] | None,
        sig: dict[str, Any] | None = None,
    ):
        self.group = group
        self.kind = kind
        self.seq = seq
        self.tag = tag
        # None only while its starter runs on the straight path (Engine.submit_eager): one that
        # completes inside it never gets a future, any other gets one (``Engine._promote``)
        # before anything else sees the operation.
        self.future: asyncio.Future[Any] = future  # type: ignore[assignment]
        self.lane: Stoppable | None = None  # its runner (client/data/_operation.Starter's return)
        self.deadline: float | None = None
        self.timeout: float | None = None
        self.abort_exc: BaseException | None = None
        self.result: Any = None  # (the straight path's, while its starter runs)
        self.outstanding_recv: dict[int | None, int] = {}
        self.outstanding_send: dict[int, int] = {}
        self.peers_hint: tuple[int, ...] = ()
        # Described only when something reads it, by a function that does not hold this op
        # (op -> work -> op would be a reference cycle: every operation would wait for the
        # cyclic garbage collector instead of being freed when it finishes).
        self.work: Work = None if future is None else Work(future, self.describer())  # type: ignore[assignment]
        self.sig = sig  # what every rank must agree on (progress reports)
        self.started = _monotonic()

    def describe(self) -> str:
        return _describe(self.kind, self.group, self.seq)

    def describer(self) -> Callable[[], str]:
        return functools.partial(_describe, self.kind, self.group, self.seq)


def _describe(kind: str, group: GroupState, seq: int) -> str:
    if seq >= 0:
        return f"{kind} (group {group.label!r}, seq {seq})"
    return f"{kind} (group {group.label!r})"


class OpTransport(Transport):
    """The transport as one operation sees it: it counts the messages the operation still waits
    for, so a timeout can name the ranks that did not answer."""

    __slots__ = ("_inner", "_op")

    def __init__(self, inner: Transport, op: _Op) -> None:
        self._inner = inner
        self._op = op
        self.rank = inner.rank
        self.world_size = inner.world_size

    @property
    def inner(self) -> Transport:
        return self._inner

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop its engine runs on (a call of the blocking facade starts operations
        from the caller's thread)."""
        loop = self._op.group.loop
        assert loop is not None  # every group is made by its engine
        return loop

    async def send(self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> None:
        await _counting(self._op.outstanding_send, dst, self._inner.send(dst, tag, payload, meta))

    def send_nowait(
        self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> Awaitable[None] | None:
        """Start a send inline where the inner transport can (see Transport.send_nowait). None:
        the payload was handed off at once."""
        rest = self._inner.send_nowait(dst, tag, payload, meta)
        if rest is None:
            return None
        return _counting(self._op.outstanding_send, dst, rest)

    def recv_now(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | None:
        return self._inner.recv_now(src, tag, into)

    async def recv(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        return await _counting(self._op.outstanding_recv, src, self._inner.recv(src, tag, into))

    async def recv_landed(
        self, src: int | None, tag: Tag, into: memoryview
    ) -> tuple[int, dict[str, Any], memoryview]:
        return await _counting(self._op.outstanding_recv, src, self._inner.recv_landed(src, tag, into))

    def post_recv(self, src: int | None, tag: Tag, into: memoryview, callback: RecvCallback) -> None:
        self._inner.post_recv(src, tag, into, self._counted(src, callback))

    def post_recv_landed(self, src: int | None, tag: Tag, into: memoryview, callback: LandedCallback) -> None:
        self._inner.post_recv_landed(src, tag, into, self._counted(src, callback))

    def _counted(self, src: int | None, callback: Callable[[Any, BaseException | None], None]) -> Any:
        """``callback``, counted as a receive outstanding from ``src`` until it runs."""
        pending = self._op.outstanding_recv
        pending[src] = pending.get(src, 0) + 1

        def counted(result: Any, exc: BaseException | None) -> None:
            pending[src] -= 1
            callback(result, exc)

        return counted

    def discard(self, tag_prefix: Tag) -> None:
        self._inner.discard(tag_prefix)

    def waiting_for(self, ranks: Iterable[int]) -> None:
        """An operation that waits without messages (shared memory) says whom it waits for now,
        so progress reports and a timeout name them as they name a missing message's sender."""
        pending = self._op.outstanding_recv
        pending.clear()
        for rank in ranks:
            pending[rank] = 1

    def holds(self, src: int, tag: Tag) -> bool:
        return self._inner.holds(src, tag)

    def retire(self, tag_prefix: Tag) -> None:
        self._inner.retire(tag_prefix)

    def on_stray(self, handler: StrayHandler) -> None:
        self._inner.on_stray(handler)

    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        self._inner.on_peer_lost(handler)

    def mark_lost(self, rank: int, reason: str) -> None:
        self._inner.mark_lost(rank, reason)

    def take_in_from(self, rank: int) -> PeerLostError | None:
        return self._inner.take_in_from(rank)

    @property
    def lost_peers(self) -> dict[int, str]:
        return self._inner.lost_peers

    def debug_state(self) -> dict[str, Any]:
        return self._inner.debug_state()

    async def aclose(self) -> None:  # an operation never closes the shared transport
        return None


async def _counting(pending: dict[Any, int], key: Any, transfer: Awaitable[_T]) -> _T:
    """Await ``transfer`` while ``pending[key]`` counts it (what a timeout reports as missing)."""
    pending[key] = pending.get(key, 0) + 1
    try:
        return await transfer
    finally:
        pending[key] -= 1
