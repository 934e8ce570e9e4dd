"""Where a collective's members are: the routed provider (hierarchical all_reduce) and the route of a part.

``choose_route`` picks, from a group's ``HostLayout`` (which of its
members share a host, by the membership table's host identity), how an operation runs:
"flat" (the algorithms of aiocoll.algorithms over the group's links) or "hierarchical" (an
all_reduce over a group that spans hosts with several ranks on at least one: reduce within each
host to its leader, all_reduce among the leaders, broadcast within each host). A group whose
members all share one host, with shared-memory links, runs the kinds the arenas serve on them
instead (the arena provider); which provider runs what is chosen once per group by
client/data/providers.py, which takes ``RoutedProvider`` for the groups where the hierarchical route
applies.

``run_routed`` runs an operation the way ``choose_route`` says. The hierarchical all_reduce is
composed of the existing operations, each run on the sub-group it concerns through
``run_routed`` again, so each part takes whatever route its own sub-group gets. All parts run
inside the one operation of the parent group: their messages carry the parent operation's tag
plus a part marker, so they match across ranks by the parent's sequence number, count against
its deadline and fail with it.

The intra-host parts run on the host's shared memory when its members share it
(``HostParts``, client/data/_shm_coll.py): the host's members all_reduce in their arenas (every
member reads the others' inputs; no message per step), the leaders exchange over TCP, and the
leader's result reaches the others by the arenas' broadcast. Whether a host's members can do
that is decided once per group, by those members together, at the group's first hierarchical
all_reduce: each offers the arena regions it has free (nothing when a member of its host is
not linked to it by shared memory), the offers are ANDed among them over the links, and the
highest region free on all is the host's (new groups take the lowest, so the two rarely meet).
A host whose members cannot agree on a region runs the parts as messages, as before.

Imports foundations (aiocoll.algorithms, aiocoll._types, aiocoll._reduce), client.data._operation
and client.data._shm_coll (the arenas' collectives); client/data/providers.py builds layouts from the
membership table and calls ``run_routed`` and ``RoutedProvider``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aiocoll._reduce import finish_avg
from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec, Tag, Transport, run_collective

from ._op_record import OpTransport
from ._operation import HOST, Operation, Starter, copying_back, spec_of
from ._shm_arena import intra_host_group, region_offer, release_offer
from ._shm_coll import ShmGroup
from .transports._link import LinkTransport

__all__ = [
    "HIERARCHICAL_OPS",
    "HostLayout",
    "HostParts",
    "RoutedProvider",
    "choose_route",
    "host_layout",
    "run_routed",
]

# Ops whose result does not depend on how partial results are grouped (up to floating-point
# rounding). AVG runs as SUM through the parts and is divided once at the end, as the flat path
# does (an average of per-host averages would weigh hosts, not ranks).
HIERARCHICAL_OPS = frozenset(
    {
        ReduceOp.SUM,
        ReduceOp.AVG,
        ReduceOp.PRODUCT,
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    }
)

# Message-tag markers of the hierarchical all_reduce's parts (short: they travel in every header)
_HOST_REDUCE, _LEADERS, _HOST_BROADCAST, _HOST_OFFERS = "hr", "hl", "hb", "ho"


@dataclass(frozen=True)
class HostLayout:
    """A group's members by host, as one member sees it.

    Attributes:
        local: global ranks of the members on this member's host, in group-rank order.
        leaders: per host, its first member in group-rank order (global ranks, in group-rank order).
        hosts: how many hosts the group spans.
        crowded: some host holds more than one member of the group.
    """

    local: tuple[int, ...]
    leaders: tuple[int, ...]
    hosts: int
    crowded: bool


def host_layout(ranks: Sequence[int], me: int, host_of: Mapping[int, str]) -> HostLayout | None:
    """The layout of the group of global ``ranks`` for member ``me`` (a global rank), from each
    global rank's host identity; None when a member's host is unknown (then nothing is assumed).

    Every member computes the same leaders and host count from the same table, so every member
    chooses the same route.
    """
    by_host: dict[str, list[int]] = {}
    for rank in ranks:
        host = host_of.get(rank)
        if not host:
            return None
        by_host.setdefault(host, []).append(rank)
    local = tuple(by_host[host_of[me]])
    leaders = tuple(members[0] for members in by_host.values())
    return HostLayout(local, leaders, len(by_host), any(len(m) > 1 for m in by_host.values()))


def choose_route(kind: str, op: ReduceOp, layout: HostLayout | None) -> str:
    """How an operation of ``kind`` (with reduce ``op``) runs over a group laid out as ``layout``."""
    if (
        kind == "all_reduce"
        and layout is not None
        and layout.hosts > 1
        and layout.crowded
        and op in HIERARCHICAL_OPS
    ):
        return "hierarchical"
    return "flat"


class HostParts:
    """A group's intra-host parts on shared memory: the group of this host's members over their
    arenas, once they agreed on it (see the module header). One per ProcessGroup whose
    all_reduce may run hierarchically.

    Args:
        links: the process's transport (its links say which members share our memory).
        gid: names the host's arena group (errors, and the mark that tells regions apart).
        on_made: told the arena group once made (the owner closes it with the group).
    """

    def __init__(self, links: LinkTransport, gid: str, on_made: Callable[[ShmGroup], None]) -> None:
        self._links = links
        self.gid = gid
        self._on_made = on_made
        self.decided = False
        self.group: ShmGroup | None = None

    async def decide(
        self, local: tuple[int, ...], transport: Transport, tag: Tag, meta: dict[str, Any]
    ) -> None:
        """With the host's other members (``local``, global ranks), agree on an arena region
        for them, or on none; once per group (every member runs its group's all_reduces in the
        same order, so they all decide at the same one)."""
        if self.decided:
            return
        me = self._links.rank
        offered = region_offer(self._links, local)
        offers = np.array([offered], np.uint64)
        agree = CollectiveSpec("all_reduce", local, local.index(me), (offers,), (offers,), op=ReduceOp.BAND)
        try:
            await run_collective(agree, transport, (*tag, _HOST_OFFERS), meta)
            self.decided = True
            mask = int(offers[0])
            if mask:
                highest = 1 << (mask.bit_length() - 1)
                self.group = intra_host_group(self._links, local, highest, self.gid)
        finally:
            release_offer(self._links, local, offered)
        if self.group is not None:
            self._on_made(self.group)


async def _on_arenas(start: Callable[[Any], Any]) -> None:
    """Run one operation of an arena group (``start(finish)`` submits it) and wait for it; a
    cancelled wait (the parent's deadline) stops it (the arena group is then out of step)."""
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def finish(_: Any, exc: BaseException | None) -> None:
        if done.done():
            return
        if exc is None:
            done.set_result(None)
        else:
            done.set_exception(exc)

    op = start(finish)
    try:
        await done
    except asyncio.CancelledError:
        op.stop()
        raise


async def run_routed(
    spec: CollectiveSpec,
    transport: Transport,
    tag: Tag,
    meta: dict[str, Any],
    layout: HostLayout | None,
    *,
    host_parts: HostParts | None = None,
) -> None:
    """Run ``spec`` (as run_collective does) by the route ``choose_route`` picks for ``layout``;
    ``host_parts`` lets a hierarchical all_reduce run its intra-host parts on shared memory."""
    if choose_route(spec.kind, spec.op, layout) == "hierarchical":
        assert layout is not None
        await _hierarchical_all_reduce(spec, transport, tag, meta, layout, host_parts)
    else:
        await run_collective(spec, transport, tag, meta)


async def _hierarchical_all_reduce(
    spec: CollectiveSpec,
    transport: Transport,
    tag: Tag,
    meta: dict[str, Any],
    layout: HostLayout,
    host_parts: HostParts | None,
) -> None:
    """Reduce within the host, all_reduce among the leaders, broadcast from the leader.

    Inter-host traffic is one vector per host instead of one per rank. Within the host, the
    arenas when the members share them (an all_reduce there: every member reads the others'
    inputs, which costs no more than a reduce to the leader), else messages.
    """
    me = spec.ranks[spec.me]
    x = spec.recv[0]
    if spec.send[0] is not x:  # out of place: the parts below all work in place on the result
        np.copyto(x, spec.send[0])
    average = spec.op is ReduceOp.AVG
    op = ReduceOp.SUM if average else spec.op
    local, leaders = layout.local, layout.leaders
    at_home = HostLayout(local, local[:1], 1, len(local) > 1)  # the intra-host sub-group: one host
    arenas: ShmGroup | None = None
    if len(local) > 1 and host_parts is not None:
        await host_parts.decide(local, transport, tag, meta)
        arenas = host_parts.group
    flat = x.reshape(-1)  # a view: working arrays are contiguous (aiocoll.device._tensors)
    dtype_name = str(spec.dtype or meta.get("dtype") or x.dtype.name)
    seq = int(tag[2]) if len(tag) > 2 and isinstance(tag[2], int) else 0
    waiting_for = getattr(transport, "waiting_for", None)  # progress reports name whom we wait for
    if arenas is not None:
        group = arenas
        sig = ShmGroup.signature(seq, {**meta, "part": _HOST_REDUCE})
        await _on_arenas(lambda finish: group.all_reduce(flat, op, dtype_name, sig, finish, waiting_for))
    elif len(local) > 1:
        reduce = CollectiveSpec("reduce", local, local.index(me), (x,), (x,), root=0, op=op, dtype=spec.dtype)
        await run_routed(reduce, transport, (*tag, _HOST_REDUCE), meta, at_home)
    if me == local[0]:
        # the leaders' sub-group: one member per host
        abroad = HostLayout((me,), leaders, len(leaders), False)
        exchange = CollectiveSpec(
            "all_reduce", leaders, leaders.index(me), (x,), (x,), op=op, dtype=spec.dtype
        )
        await run_routed(exchange, transport, (*tag, _LEADERS), meta, abroad)
    if arenas is not None:
        group = arenas
        sig = ShmGroup.signature(seq, {**meta, "part": _HOST_BROADCAST})
        await _on_arenas(lambda finish: group.broadcast(flat, 0, sig, finish, waiting_for))
    elif len(local) > 1:
        spread = CollectiveSpec("broadcast", local, local.index(me), (), (x,), root=0, dtype=spec.dtype)
        await run_routed(spread, transport, (*tag, _HOST_BROADCAST), meta, at_home)
    if average:  # every rank divides the same sum the same way: identical bits everywhere
        finish_avg(x, len(spec.ranks), spec.dtype or meta.get("dtype") or x.dtype.name)


class RoutedProvider:
    """The hierarchical all_reduce as a provider (client/data/providers.py), for a group spanning
    hosts with several members on at least one; its intra-host parts on the arenas when the
    host's members agree on a region (``HostParts``), else as messages.

    Args:
        links: the process's transport. ranks: the group's global ranks, me: my group rank.
        layout: the group's members by host (None: unknown, the route never applies).
        host_gid: names the host's arena group.
    """

    name: ClassVar[str] = "routed"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 20

    def __init__(
        self, links: LinkTransport, ranks: tuple[int, ...], me: int, layout: HostLayout | None, host_gid: str
    ) -> None:
        self._ranks = ranks
        self._me = me
        self._layout = layout
        applies = layout is not None and layout.hosts > 1 and layout.crowded
        self.kinds: frozenset[str] = frozenset({"all_reduce"}) if applies else frozenset()
        self.why = (
            f"the group spans {layout.hosts} hosts with several members on one"
            if applies and layout is not None
            else "the group's members are not spread over several hosts with several on one"
        )
        self._arena: ShmGroup | None = None
        self._parts: HostParts | None = None
        self._in_order = asyncio.Lock()  # FIFO: bodies start, and so queue here, in call order
        if applies and layout is not None and len(layout.local) > 1:
            self._parts = HostParts(links, host_gid, self._made)

    def _made(self, group: ShmGroup) -> None:
        self._arena = group  # closed with the provider

    def prepare(self, op: Operation) -> Starter | None:
        """The operation's starter (see client/data/_operation.Provider), or None for a reduce op the
        route cannot regroup."""
        if op.op not in HIERARCHICAL_OPS or self._layout is None:
            return None
        spec = spec_of(op, self._ranks, self._me)
        layout, parts, meta = self._layout, self._parts, op.meta
        in_order = self._in_order

        async def body(tag: Tag, transport: OpTransport) -> None:
            # One at a time, in call order: the host's arena group runs its parts in the order
            # they reach it, which must be the same on every member. Two operations in flight
            # would otherwise reach it in different orders (a leader still exchanging with the
            # other hosts for the first while a member starts the second's part): a mismatch.
            async with in_order:
                await _hierarchical_all_reduce(spec, transport, tag, meta, layout, parts)

        return copying_back(op, body)

    def close(self) -> None:
        if self._arena is not None:
            self._arena.close()
