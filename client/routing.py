"""Where a collective's members are decides how it runs: the one dispatch point, and hierarchical all_reduce.

``choose_route`` is the single place that picks, from a group's ``HostLayout`` (which of its
members share a host, by the membership table's host identity), how an operation runs:
"flat" (the algorithms of aiocoll.algorithms over the group's links) or "hierarchical" (an
all_reduce over a group that spans hosts with several ranks on at least one: reduce within each
host to its leader, all_reduce among the leaders, broadcast within each host). A group whose
members all share one host, with shared-memory links, runs the kinds the arenas serve before any
route is chosen (ProcessGroup._intra_host, client/_shm_coll.py).

``run_routed`` runs an operation the way ``choose_route`` says. The hierarchical all_reduce is
composed of the existing operations, each run on the sub-group it concerns through
``run_routed`` again, so each part takes whatever route its own sub-group gets (the intra-host
parts are single-host groups). All parts run inside the one operation of the parent group:
their messages carry the parent operation's tag plus a part marker, so they match across ranks
by the parent's sequence number, count against its deadline and fail with it.

Imports foundations only (aiocoll.algorithms, aiocoll._types, aiocoll._reduce); the public
layer builds layouts from the membership table and calls ``run_routed``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aiocoll._reduce import finish_avg
from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec, Tag, Transport, run_collective

__all__ = ["HIERARCHICAL_OPS", "HostLayout", "choose_route", "host_layout", "run_routed"]

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

# Message-tag markers of the hierarchical all_reduce's three parts (short: they travel in every header)
_HOST_REDUCE, _LEADERS, _HOST_BROADCAST = "hr", "hl", "hb"


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


async def run_routed(
    spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any], layout: HostLayout | None
) -> None:
    """Run ``spec`` (as run_collective does) by the route ``choose_route`` picks for ``layout``."""
    if choose_route(spec.kind, spec.op, layout) == "hierarchical":
        assert layout is not None
        await _hierarchical_all_reduce(spec, transport, tag, meta, layout)
    else:
        await run_collective(spec, transport, tag, meta)


async def _hierarchical_all_reduce(
    spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any], layout: HostLayout
) -> None:
    """Reduce to the host's leader, all_reduce among the leaders, broadcast from the leader.

    Inter-host traffic is one vector per host instead of one per rank.
    """
    me = spec.ranks[spec.me]
    x = spec.recv[0]
    if spec.send[0] is not x:  # out of place: the parts below all work in place on the result
        np.copyto(x, spec.send[0])
    average = spec.op is ReduceOp.AVG
    op = ReduceOp.SUM if average else spec.op
    local, leaders = layout.local, layout.leaders
    at_home = HostLayout(local, local[:1], 1, len(local) > 1)  # the intra-host sub-group: one host
    if len(local) > 1:
        reduce = CollectiveSpec(
            "reduce", local, local.index(me), (x,), (x,), root=0, op=op, dtype=spec.dtype
        )
        await run_routed(reduce, transport, (*tag, _HOST_REDUCE), meta, at_home)
    if me == local[0]:
        # the leaders' sub-group: one member per host
        abroad = HostLayout((me,), leaders, len(leaders), False)
        exchange = CollectiveSpec(
            "all_reduce", leaders, leaders.index(me), (x,), (x,), op=op, dtype=spec.dtype
        )
        await run_routed(exchange, transport, (*tag, _LEADERS), meta, abroad)
    if len(local) > 1:
        spread = CollectiveSpec("broadcast", local, local.index(me), (), (x,), root=0, dtype=spec.dtype)
        await run_routed(spread, transport, (*tag, _HOST_BROADCAST), meta, at_home)
    if average:  # every rank divides the same sum the same way: identical bits everywhere
        finish_avg(x, len(spec.ranks), spec.dtype or meta.get("dtype") or x.dtype.name)
