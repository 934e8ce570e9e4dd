"""How a group's collectives run: the provider interface, the one selection function, the table.

Imports foundations (aiocoll.algorithms, the device staging of aiocoll.device) and the client's
engine, arenas (client/_shm_coll.py) and routes (client/routing.py); never the public surface.
The public layer checks a call's arguments and builds the operation (its kind, signature,
arrays, tensors, root and reduce op); the group's ``ProviderTable`` hands it to the provider
chosen for it. Nothing else decides how a collective runs.

A provider serves some operation kinds over some groups. It says so once, when a group is made:
``select_providers`` takes the providers available to the group (``ProviderTable.select`` lists
them, most specific first) with the kinds each serves, logs at DEBUG why it chose what it
chose, and fills the table; the table is chosen again only when the process's links change (a
link added or lost).
Per call, a provider may still decline one operation (the arena runs only in-place
all_reduces); the table then takes the next provider for that kind. The providers:

  - ``arena``: every member on this host, linked by shared memory: the members' arenas
    (client/_shm_coll.py), in a region the members agree on when the group forms (``forming``).
  - ``routed``: a group spanning hosts with several members on one: all_reduce by host, then
    among host leaders, then back (client/routing.py), with its intra-host parts on the arenas.
  - ``driver``: every kind, any group: the algorithms over the links, run by the message driver
    (aiocoll/algorithms/_driver.py) from message callbacks, without a task.
  - ``ipc`` and ``staged``, for device tensors (chosen per call by where the tensors are):
    device to device between the ranks of one host by CUDA IPC (aiocoll/device/_ipc.py) for the
    all_reduces and broadcasts it can take, else chunk by chunk through pinned host staging
    (aiocoll/device/_staged_ops.py); each wraps the group's route: every staged chunk runs as a
    host operation by it.

A new provider (UCX, a GPU-direct link) is a class with ``name``, ``eager``, ``kinds`` and
``prepare`` (and ``close``, and ``why`` for the log) plus a line in ``ProviderTable.select``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec, Tag
from aiocoll.algorithms._driver import start_collective
from aiocoll.algorithms._plan import prepare
from aiocoll.device._ipc import IPC_KINDS, IPC_OPS, ipc_groups
from aiocoll.device._staged_ops import StagedOp
from aiocoll.device._staging import DeviceSpan

from ._operation import Finish, Provider, finish_with_copy_back, spec_of
from ._shm_arena import ArenaForming, ArenaProvider
from .engine import Engine, GroupState, OpTransport
from .routing import HostLayout, RoutedProvider, host_layout, run_routed
from .transports._link import LinkTransport

__all__ = [
    "Provider",
    "ProviderTable",
    "finish_with_copy_back",
    "select_providers",
]

log = logging.getLogger("aiocoll.providers")


class DriverProvider:
    """Every kind over the links, by the message driver (no task per operation)."""

    name: ClassVar[str] = "driver"
    eager: ClassVar[bool] = True
    kinds: frozenset[str] = frozenset({"*"})
    why = "serves every kind over the links"

    def __init__(self, ranks: tuple[int, ...], me: int) -> None:
        self._ranks = ranks
        self._me = me

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
    ) -> Callable[[Tag, OpTransport, Finish], Any]:
        spec = spec_of(kind, meta, send, recv, root, op, self._ranks, self._me)

        def start(tag: Tag, transport: OpTransport, finish: Finish) -> Any:
            done = finish_with_copy_back(workings, result, finish)
            return start_collective(
                prepare(spec, meta), spec, transport, tag, meta, lambda exc: done(None, exc)
            )

        return start

    def close(self) -> None:
        pass


class StagedProvider:
    """Device tensors: wraps the group's route over the links (``inner``: each chunk's host
    operation runs by it), chunk by chunk through pinned staging; chosen per call by where the
    tensors are."""

    name: ClassVar[str] = "staged"
    eager: ClassVar[bool] = False
    kinds: frozenset[str] = frozenset({"*"})
    why = "device tensors, whatever the kind"
    _ipc = False  # whether its operations may go device to device (IpcProvider)

    def __init__(
        self,
        ranks: tuple[int, ...],
        me: int,
        rank: int,
        group_key: tuple[Any, ...],
        gid: str,
        inner: Callable[[CollectiveSpec, Any, Tag, dict[str, Any]], Awaitable[None]],
    ) -> None:
        self._inner = inner
        self._ranks = ranks
        self._me = me
        self._rank = rank
        self._key = group_key
        self._gid = gid

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
    ) -> Callable[[Tag, OpTransport], Any] | None:
        if self._ipc and (kind not in IPC_KINDS or op not in IPC_OPS):
            return None
        key = self._key if self._ipc else None  # (no IPC state: the operation is staged)
        staged = StagedOp(kind, len(self._ranks), send, recv, rank=self._rank, group_key=key)
        ranks, me, gid, inner = self._ranks, self._me, self._gid, self._inner

        async def body(tag: Tag, transport: OpTransport) -> Any:
            what = f"{kind} (group {gid!r}, seq {tag[2]})"
            await staged.collective(
                transport, tag, meta, ranks=ranks, me=me, root=root, op=op, what=what, run=inner
            )
            for w in workings:
                w.finish()
            return result

        return body

    def close(self) -> None:
        if self._ipc:
            ipc_groups.forget(self._key)


class IpcProvider(StagedProvider):
    """Device tensors of an all_reduce or a broadcast, device to device between the ranks of one
    host (CUDA IPC, aiocoll/device/_ipc.py): the members open each other's mailbox and event once,
    together, at the group's first such operation of several chunks, and agree whether every one
    could; where not (or for one chunk, or AVG), the operation is staged as StagedProvider's are."""

    name: ClassVar[str] = "ipc"
    kinds: frozenset[str] = frozenset(IPC_KINDS)
    why = "device tensors of all_reduce and broadcast, device to device where the group can"
    _ipc = True


class ProviderTable:
    """A group's providers by kind, chosen by ``select_providers``; ``submit`` runs an operation.

    Attributes:
        layout: the group's members by host (client/routing.HostLayout), None when unknown.
        chosen: kind -> the names of the providers that serve it, in the order they are asked.
    """

    def __init__(
        self,
        engine: Engine,
        state: GroupState,
        links: LinkTransport,
        hosts: Mapping[int, str],
        arena: ArenaProvider | None,
        group_key: tuple[Any, ...],
    ) -> None:
        self._engine = engine
        self._state = state
        self._links = links
        self._hosts = hosts
        self._arena = arena
        self._key = group_key
        ranks = tuple(state.ranks)
        self._ranks = ranks
        self._me = state.index
        self.layout: HostLayout | None = host_layout(ranks, ranks[state.index], hosts)
        self._routed = RoutedProvider(links, ranks, self._me, self.layout, f"{state.gid}/host")
        self._staged = StagedProvider(ranks, self._me, links.rank, group_key, state.gid, self.run_within)
        self._ipc = IpcProvider(ranks, self._me, links.rank, group_key, state.gid, self.run_within)
        self._driver = DriverProvider(ranks, self._me)
        self._by_kind: dict[str, tuple[Provider, ...]] = {}
        self._any: tuple[Provider, ...] = ()
        self._links_seen = -1
        self._retired: list[Any] = []
        self.chosen: dict[str, list[str]] = {}
        self.select()

    # -- selection ---------------------------------------------------------------------------
    def select(self) -> None:
        """Choose the providers for every kind (once per group, and again when links change)."""
        self._links_seen = self._links.links_version
        if self._arena is not None and not self._arena.usable(self._links):
            log.debug("group %r: arena dropped: a member is now linked by another kind", self._state.gid)
            self._retired.append(self._arena)  # closed with the table (its operations failed)
            self._arena = None
        self._by_kind, self._any = select_providers(
            self._state.gid, (self._arena, self._routed, self._driver)
        )
        self.chosen = {kind: [p.name for p in ps] for kind, ps in self._by_kind.items()}
        self.chosen["*"] = [p.name for p in self._any]

    @property
    def arena(self) -> Any:
        """The group's shared-memory collectives (client._shm_coll.ShmGroup), or None."""
        return None if self._arena is None else self._arena.group

    # -- running -----------------------------------------------------------------------------
    def submit(
        self,
        kind: str,
        meta: dict[str, Any],
        send: Sequence[Any],
        recv: Sequence[Any],
        workings: Sequence[Any],
        result: Any,
        root: int,
        op: ReduceOp,
        timeout: float | None,
    ) -> Any:
        """Run the operation (the fields of Provider.prepare) on the first provider that takes
        it; returns its Work."""
        if self._links_seen != self._links.links_version:
            self.select()
        for a in send:  # (inline, not has_device_arrays: this runs on every collective)
            if isinstance(a, DeviceSpan):
                return self._submit_staged(kind, meta, send, recv, workings, result, root, op, timeout)
        if recv is not send:  # (an in-place operation hands one tuple for both)
            for a in recv:
                if isinstance(a, DeviceSpan):
                    return self._submit_staged(kind, meta, send, recv, workings, result, root, op, timeout)
        for provider in self._by_kind.get(kind, self._any):
            run = provider.prepare(kind, meta, send, recv, workings, result, root, op)
            if run is None:
                continue
            if provider.eager:
                return self._engine.submit_eager(self._state, kind, run, timeout=timeout, signature=meta)
            return self._engine.submit(self._state, kind, run, timeout=timeout, signature=meta)
        raise AssertionError(f"no provider took {kind}")  # the driver takes every kind

    def _submit_staged(
        self,
        kind: str,
        meta: dict[str, Any],
        send: Sequence[Any],
        recv: Sequence[Any],
        workings: Sequence[Any],
        result: Any,
        root: int,
        op: ReduceOp,
        timeout: float | None,
    ) -> Any:
        # signature None: staged chunks check each chunk's signature themselves
        body = self._ipc.prepare(kind, meta, send, recv, workings, result, root, op)
        if body is None:
            body = self._staged.prepare(kind, meta, send, recv, workings, result, root, op)
        assert body is not None  # staging takes every kind
        return self._engine.submit(self._state, kind, body, timeout=timeout)

    async def run_within(self, spec: CollectiveSpec, transport: Any, tag: Tag, meta: dict[str, Any]) -> None:
        """Run ``spec`` as a part of an operation already running (object collectives, a group's
        formation): over the links, by the group's route."""
        await run_routed(spec, transport, tag, meta, self.layout)

    # -- groups ------------------------------------------------------------------------------
    def forming(self, members: Sequence[int]) -> Forming:
        """Begin forming a sub-group of ``members`` (global ranks): see ``Forming``."""
        return Forming(self, members)

    def close(self) -> None:
        for provider in (self._arena, *self._retired, self._routed, self._ipc, self._staged, self._driver):
            if provider is not None:
                provider.close()


class Forming:
    """A sub-group being formed: the words its providers must agree on (``offers``, ANDed over
    the parent group's ranks by the caller's all_reduce, which is also the formation's barrier),
    then ``formed`` makes the new group's table, and ``release`` frees what was held back."""

    def __init__(self, parent: ProviderTable, members: Sequence[int]) -> None:
        self._parent = parent
        self._members = list(members)
        self._arena = ArenaForming(parent._links, self._members)
        self.offers = np.array([self._arena.offered], np.uint64)

    def formed(self, engine: Engine, state: GroupState) -> ProviderTable:
        parent = self._parent
        arena = self._arena.formed(int(self.offers[0]), state.gid)
        return ProviderTable(
            engine, state, parent._links, parent._hosts, arena, (*parent._key[:1], state.gid)
        )

    def release(self) -> None:
        self._arena.release()


def select_providers(
    gid: str, candidates: Sequence[Provider | None]
) -> tuple[dict[str, tuple[Provider, ...]], tuple[Provider, ...]]:
    """The one selection: for every kind, the providers that serve it, most specific first
    (``candidates`` in that order; None: not available for this group); the last, which serves
    every kind ("*"), ends every list. Logs at DEBUG what was chosen and why."""
    available = [p for p in candidates if p is not None]
    named = sorted({k for p in available for k in p.kinds if k != "*"})
    fallback = tuple(p for p in available if "*" in p.kinds)
    by_kind = {kind: tuple(p for p in available if kind in p.kinds) + fallback for kind in named}
    if log.isEnabledFor(logging.DEBUG):
        for p in candidates:
            if p is None:
                continue
            why = getattr(p, "why", "")
            log.debug("group %r: provider %s serves %s: %s", gid, p.name, sorted(p.kinds), why)
        log.debug(
            "group %r: providers by kind: %s; others: %s",
            gid,
            {k: [p.name for p in ps] for k, ps in by_kind.items()},
            [p.name for p in fallback],
        )
    return by_kind, fallback


def world_table(
    engine: Engine, state: GroupState, links: LinkTransport, hosts: Mapping[int, str], runtime_key: Any
) -> ProviderTable:
    """The world group's table: its arena (region 0, free on every rank at start, no agreement
    needed) when every other rank is linked by shared memory."""
    arena = ArenaProvider.for_world(links, state.gid)
    return ProviderTable(engine, state, links, hosts, arena, (runtime_key, state.gid))
