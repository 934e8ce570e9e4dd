"""How a group's operations run: the providers (the rows of a group's table), the one selection
function, the table.

Imports foundations (aiocoll.algorithms, aiocoll._work, the working arrays of aiocoll.device) and
the client's engine, operation record, rows (the p2p row client/data/_p2p_row.py, the device rows
client/data/_device_rows.py, the arenas client/data/_shm_arena.py and client/data/_shm_coll.py,
routes client/data/routing.py, the object row client/data/_objects.py) and the links' transport
(client/data/transports/_link.py); never the public surface. The public layer
checks a call's arguments, builds its record (client/data/_operation.Operation) and submits it to
the group's ``ProviderTable``, which hands it to the first row that takes it; a send or receive of
host memory, and an all_reduce of host memory, it hands to the table's ``send``, ``recv`` or
``all_reduce`` with the call's fields, and the p2p or arena row makes the record only for one that
does not end inside the call. Nothing else decides how an operation runs: collective, point-to-
point, object or group formation, host or device memory.

Every row declares, once, what it takes: its kinds, its memory (host or device) and its
priority. ``select_providers`` queries the rows available to the group when the group is made
(as Open MPI's coll framework queries its components per communicator), logs at DEBUG why it
chose what it chose, and fills the table: for every memory and kind, the rows that serve it,
highest priority first. The table is chosen again only when the process's links change (a link
added or lost). Per call, a row may still decline one operation (the arena runs only in-place
all_reduces; IPC only the kinds and reduce ops it can); the table then asks the next. The rows:

  - ``arena`` (host, 30): every member on this host, linked by shared memory: the members'
    arenas (client/data/_shm_coll.py), in a region the members agree on when the group forms.
  - ``routed`` (host, 20): a group spanning hosts with several members on one: all_reduce by
    host, then among host leaders, then back (client/data/routing.py), its intra-host parts on arenas.
  - ``driver`` (host, 0): every collective, any group: the algorithms over the links, run by the
    message driver (aiocoll/algorithms/_driver.py) from message callbacks, without a task.
  - ``p2p`` (host, 0): send and recv over the links (client/data/_p2p_row.py).
  - ``objects`` (host, 0): object operations and group formation (client/data/_objects.py).
  - ``ipc`` (device, 20): device to device between the ranks of one host by CUDA IPC
    (aiocoll/device/_ipc.py), for the all_reduces and broadcasts it can take
    (client/data/_device_rows.py).
  - ``staged`` (device, 10): every collective and send/recv, chunk by chunk through pinned host
    staging (aiocoll/device/_staged_ops.py; the row in client/data/_device_rows.py).

The rows that run in steps (ipc, staged, objects) run each step as a host operation by the
group's route (``ProviderTable._run_part``) inside their one operation.

A new provider (UCX, a GPU-direct link) is a class with ``name``, ``memory``, ``priority``,
``kinds``, ``why``, ``prepare`` and ``close`` (client/data/_operation.Provider), plus a line in
``ProviderTable.__init__``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from aiocoll._errors import DistError
from aiocoll._work import Work
from aiocoll.algorithms import CollectiveSpec, Tag, Transport
from aiocoll.algorithms._driver import start_collective
from aiocoll.algorithms._plan import prepare
from aiocoll.device._tensors import Working

from ._device_rows import IpcProvider, StagedProvider
from ._objects import ObjectProvider
from ._operation import (
    COLLECTIVE_KINDS,
    DEVICE,
    HOST,
    Finish,
    Operation,
    Provider,
    Starter,
    all_reduce_operation,
    finish_with_copy_back,
    spec_of,
)
from ._p2p_row import P2PProvider
from ._shm_arena import ArenaForming, ArenaProvider
from ._shm_coll import ShmGroup
from .engine import Engine, GroupState, OpTransport, Stoppable
from .routing import HostLayout, RoutedProvider, host_layout, run_routed
from .transports._link import LinkTransport

__all__ = [
    "Provider",
    "ProviderTable",
    "select_providers",
]

log = logging.getLogger("aiocoll.providers")

# The arena's kinds that complete on a member only once it read every member's part: it sends
# nothing over the links under the operation's tag, and once one completed, every member ran it
# on the arena, so no message under its tag can come (the engine need not watch for one). Not a
# broadcast: its root may finish before the others, one of which may have called something else.
_ARENA_SEALED = frozenset({"all_reduce", "all_gather", "reduce_scatter", "barrier"})


class DriverProvider:
    """Every collective over the links, by the message driver (no task per operation)."""

    name: ClassVar[str] = "driver"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 0
    kinds: frozenset[str] = COLLECTIVE_KINDS
    why = "serves every collective over the links"

    def __init__(self, ranks: tuple[int, ...], me: int) -> None:
        self._ranks = ranks
        self._me = me

    def prepare(self, op: Operation) -> Starter:
        spec = spec_of(op, self._ranks, self._me)
        meta = op.meta

        def start(tag: Tag, transport: OpTransport, finish: Finish) -> Stoppable:
            done = finish_with_copy_back(op, finish)
            return start_collective(
                prepare(spec, meta), spec, transport, tag, meta, lambda exc: done(None, exc)
            )

        return start

    def close(self) -> None:
        pass


class ProviderTable:
    """A group's rows, chosen by ``select_providers``; ``submit`` runs an operation.

    Attributes:
        layout: the group's members by host (client/data/routing.HostLayout), None when unknown.
        chosen: memory -> kind -> the names of the rows that serve it, in the order they are asked.
        ran: the name of the row that took the group's latest operation ("-": none yet).
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
        me, rank, gid = state.index, links.rank, state.gid
        self.layout: HostLayout | None = host_layout(ranks, ranks[me], hosts)
        self._routed = RoutedProvider(links, ranks, me, self.layout, f"{gid}/host")
        # (host point-to-point has this one row: the API reaches it through ``send``/``recv``)
        self._p2p = P2PProvider(ranks, gid, engine, state)
        # the rows other than the arena, which may be dropped (``select``)
        self._rows: tuple[Provider, ...] = (
            self._routed,
            DriverProvider(ranks, me),
            self._p2p,
            ObjectProvider(ranks, me, gid, self._run_part),
            IpcProvider(ranks, me, rank, group_key, gid, self._run_part),
            StagedProvider(ranks, me, rank, group_key, gid, self._run_part),
        )
        self._by: dict[str, dict[str, tuple[tuple[Provider, bool], ...]]] = {}
        self._links_seen = -1
        self._destroyed = False
        self._retired: list[Provider] = []
        self.chosen: dict[str, dict[str, list[str]]] = {}
        self.ran = "-"
        self.select()

    # -- selection ---------------------------------------------------------------------------
    def select(self) -> None:
        """Choose the rows for every memory and kind (once per group, and again when links change)."""
        self._links_seen = self._links.links_version
        if self._arena is not None and not self._arena.usable(self._links):
            log.debug("group %r: arena dropped: a member is now linked by another kind", self._state.gid)
            self._retired.append(self._arena)  # closed with the table (its operations failed)
            self._arena = None
        rows = self._rows if self._arena is None else (self._arena, *self._rows)
        by = select_providers(self._state.gid, rows)
        # each row with whether the engine retires the tag of an operation it runs (see
        # _ARENA_SEALED), looked up once here rather than per call
        arena = self._arena
        self._by = {
            m: {k: tuple((p, k not in _ARENA_SEALED or p is not arena) for p in ps) for k, ps in t.items()}
            for m, t in by.items()
        }
        self.chosen = {m: {k: [p.name for p in ps] for k, ps in t.items()} for m, t in by.items()}
        # the row whose straight path takes a host all_reduce: the arena, when it is the first
        # row for it (it takes every in-place one, as the API's all_reduce is)
        first = by.get(HOST, {}).get("all_reduce", ())
        self._reduce_row = arena if arena is not None and first and first[0] is arena else None

    @property
    def arena(self) -> ShmGroup | None:
        """The group's shared-memory collectives (client.data._shm_coll.ShmGroup), or None."""
        return None if self._arena is None else self._arena.group

    # -- running -----------------------------------------------------------------------------
    def submit(self, op: Operation) -> Work:
        """Run ``op`` on the first row that takes it; returns its Work.

        Raises:
            DistError: the group was destroyed (``destroyed``).
        """
        if self._links_seen != self._links.links_version:  # (and once the group is destroyed)
            self._select_again(op.kind)
        start, retire = self._row_for(op)
        return self._engine.submit_op(self._state, op, start, retire)

    def _row_for(self, op: Operation) -> tuple[Starter, bool]:
        """The starter of the first row that takes ``op``, and whether its tag is retired."""
        for provider, retire in self._by[op.memory].get(op.kind, ()):
            start = provider.prepare(op)
            if start is not None:
                self.ran = provider.name
                return start, retire
        raise DistError(
            f"{op.kind}: no provider of group {self._state.label!r} runs it on {op.memory} memory"
        )

    def all_reduce(self, w: Working, reduce_op: Any, meta: dict[str, Any], tensor: Any, timeout: Any) -> Work:
        """An all_reduce of ``w`` in place (the caller's ``tensor``): on the arena's straight path
        when the arena is the group's first row for it (ArenaProvider.all_reduce), else as
        ``submit``.

        Raises:
            DistError: the group was destroyed.
        """
        if self._links_seen != self._links.links_version:
            self._select_again("all_reduce")
        row = self._reduce_row
        if row is not None and w.memory == HOST:
            self.ran = row.name
            return row.all_reduce(self._engine, self._state, w, reduce_op, meta, tensor, timeout)
        op = all_reduce_operation(meta, w.array, w, reduce_op, tensor, timeout, w.memory)
        start, retire = self._row_for(op)
        return self._engine.submit_op(self._state, op, start, retire)

    def send(self, peer: int, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """A send of host memory (``w``), to global rank ``peer``: on the p2p row, whose
        straight path makes no record for a send the link takes at once (P2PProvider.send).

        Raises:
            DistError: the group was destroyed.
        """
        if self._links_seen != self._links.links_version:
            self._select_again("send")
        self.ran = "p2p"
        return self._p2p.send(peer, tag, w, meta, timeout)

    def recv(self, peer: int | None, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """A receive into host memory (``w``) from global rank ``peer`` (None: any), as ``send``."""
        if self._links_seen != self._links.links_version:
            self._select_again("recv")
        self.ran = "p2p"
        return self._p2p.recv(peer, tag, w, meta, timeout)

    def _select_again(self, kind: str) -> None:
        """The process's links changed since the rows were chosen (or the group was destroyed):
        choose again, or refuse ``kind``."""
        if self._destroyed:
            raise DistError(f"{kind}: process group {self._state.gid!r} was destroyed")
        self.select()

    async def _run_part(
        self, spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any]
    ) -> None:
        """Run ``spec`` as a step of an operation already running (a staged chunk, an object
        operation's step, a group's formation): over the links, by the group's route."""
        await run_routed(spec, transport, tag, meta, self.layout)

    def destroyed(self) -> None:
        """Refuse every later operation: the group is destroyed (its rows close with ``close``)."""
        self._destroyed = True
        self._links_seen = -2  # never a links version: the next call looks (``submit``)

    # -- groups ------------------------------------------------------------------------------
    def forming(self, members: Sequence[int]) -> Forming:
        """Begin forming a sub-group of ``members`` (global ranks): see ``Forming``."""
        return Forming(self, members)

    def close(self) -> None:
        arena = () if self._arena is None else (self._arena,)
        for provider in (*arena, *self._retired, *self._rows):
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
        return self._table(engine, state, self._arena.formed(int(self.offers[0]), state.gid))

    def bare(self, engine: Engine, state: GroupState) -> ProviderTable:
        """The new group's table before its members agreed (no arena): for a group that agrees
        over itself, its members alone (``ProcessGroup._survivors_group``)."""
        return self._table(engine, state, None)

    def _table(self, engine: Engine, state: GroupState, arena: ArenaProvider | None) -> ProviderTable:
        parent = self._parent
        return ProviderTable(
            engine, state, parent._links, parent._hosts, arena, (*parent._key[:1], state.gid)
        )

    def release(self) -> None:
        self._arena.release()


def select_providers(gid: str, rows: Sequence[Provider]) -> dict[str, dict[str, tuple[Provider, ...]]]:
    """The one selection: for every memory and kind, the rows that serve it, highest priority
    first (rows of one priority in the order given). Logs at DEBUG what was chosen and why."""
    ordered = sorted(rows, key=lambda p: -p.priority)  # (sorted is stable)
    by: dict[str, dict[str, tuple[Provider, ...]]] = {HOST: {}, DEVICE: {}}
    for memory, table in by.items():
        serving = [p for p in ordered if memory in p.memory]
        for kind in sorted({k for p in serving for k in p.kinds}):
            table[kind] = tuple(p for p in serving if kind in p.kinds)
    if log.isEnabledFor(logging.DEBUG):
        for p in ordered:
            log.debug(
                "group %r: provider %s (%s memory, priority %d) serves %s: %s",
                gid,
                p.name,
                "/".join(sorted(p.memory)),
                p.priority,
                sorted(p.kinds),
                p.why,
            )
        log.debug(
            "group %r: providers by memory and kind: %s",
            gid,
            {m: {k: [p.name for p in ps] for k, ps in t.items()} for m, t in by.items()},
        )
    return by


def world_table(
    engine: Engine, state: GroupState, links: LinkTransport, hosts: Mapping[int, str], runtime_key: Any
) -> ProviderTable:
    """The world group's table: its arena (region 0, free on every rank at start, no agreement
    needed) when every other rank is linked by shared memory."""
    arena = ArenaProvider.for_world(links, state.gid)
    return ProviderTable(engine, state, links, hosts, arena, (runtime_key, state.gid))
