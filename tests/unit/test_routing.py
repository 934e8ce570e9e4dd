"""The dispatch point by host (client/data/routing.py) and hierarchical all_reduce, over the
in-memory transport.

Hosts are given per rank, deliberately not contiguous in rank order; results are compared with
numpy, and the bytes that cross hosts are counted to show the exchange really is one vector per
host (the process-level test over network namespaces is tests/integration/test_mixed_hosts.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.routing import choose_route, host_layout, run_routed
from aiocoll.client.data.transports.memory import MemoryLink, MemoryWorld

from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec

# rank -> host: A holds 0, 2, 5; B holds 1, 4; C holds 3 alone
HOSTS = {0: "A", 1: "B", 2: "A", 3: "C", 4: "B", 5: "A"}


def test_layout_groups_members_by_host_in_group_order_and_leads_with_the_first() -> None:
    layout = host_layout([5, 4, 3, 2, 1, 0], 2, HOSTS)
    assert layout is not None
    assert layout.local == (5, 2, 0) and layout.leaders == (5, 4, 3)
    assert layout.hosts == 3 and layout.crowded
    assert host_layout([0, 1, 7], 0, HOSTS) is None  # rank 7's host is unknown: assume nothing


def test_only_an_all_reduce_over_several_crowded_hosts_goes_hierarchical() -> None:
    spanning = host_layout(range(6), 0, HOSTS)
    one_host = host_layout([0, 2, 5], 0, HOSTS)
    one_each = host_layout([0, 1, 3], 0, HOSTS)
    assert choose_route("all_reduce", ReduceOp.SUM, spanning) == "hierarchical"
    assert choose_route("all_reduce", ReduceOp.MAX, spanning) == "hierarchical"
    assert choose_route("all_reduce", ReduceOp.AVG, spanning) == "hierarchical"  # SUM, divided once
    assert choose_route("broadcast", ReduceOp.SUM, spanning) == "flat"
    assert choose_route("all_reduce", ReduceOp.SUM, one_host) == "flat"
    assert choose_route("all_reduce", ReduceOp.SUM, one_each) == "flat"
    assert choose_route("all_reduce", ReduceOp.SUM, None) == "flat"


class _CrossHostCounter:
    """Counts the payload bytes the memory links carry between two different hosts."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bytes = 0
        original = MemoryLink.send_nowait
        counter = self

        def send_nowait(self: MemoryLink, tag: Any, payload: memoryview, meta: Any) -> Any:
            if HOSTS[self._owner.rank] != HOSTS[self.peer]:
                counter.bytes += payload.nbytes
            return original(self, tag, payload, meta)

        monkeypatch.setattr(MemoryLink, "send_nowait", send_nowait)


RANKS = tuple(range(len(HOSTS)))


async def _all_reduce_by_host(
    ins: list[np.ndarray], outs: list[np.ndarray], op: ReduceOp, dtype: str
) -> None:
    """Every rank of HOSTS runs one all_reduce through run_routed over one memory world."""
    world = MemoryWorld(len(RANKS))
    meta = {"kind": "all_reduce", "dtype": dtype, "count": len(ins[0]), "op": op.value}
    await asyncio.wait_for(
        asyncio.gather(
            *(
                run_routed(
                    CollectiveSpec("all_reduce", RANKS, r, (ins[r],), (outs[r],), op=op),
                    world[r],
                    ("c", "w", 0),
                    meta,
                    host_layout(RANKS, r, HOSTS),
                )
                for r in RANKS
            )
        ),
        30,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.PRODUCT, ReduceOp.BXOR])
@pytest.mark.parametrize("count", [1, 1000, 70_000])
async def test_hierarchical_all_reduce_matches_numpy_and_sends_one_vector_per_host_pair(
    op: ReduceOp, count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(count)
    xs = [rng.integers(1, 4, size=count).astype(np.int64) for _ in RANKS]
    combine = {
        ReduceOp.SUM: np.add,
        ReduceOp.MIN: np.minimum,
        ReduceOp.PRODUCT: np.multiply,
        ReduceOp.BXOR: np.bitwise_xor,
    }[op]
    expected = combine.reduce(np.stack(xs), axis=0)
    counter = _CrossHostCounter(monkeypatch)
    await _all_reduce_by_host(xs, xs, op, "int64")
    for x in xs:
        np.testing.assert_array_equal(x, expected)
    # Three leaders: an all_reduce among 3 moves between 2 and 6 vectors between hosts (flat among
    # these 6 ranks moved 8-10 vectors across hosts, measured with this counter).
    assert 2 * count * 8 <= counter.bytes <= 2 * 3 * count * 8 + 64


@pytest.mark.timeout(30)
async def test_hierarchical_all_reduce_out_of_place_writes_the_result_and_keeps_the_input() -> None:
    ins = [np.full(5, r + 1, dtype=np.float64) for r in RANKS]
    outs = [np.zeros(5) for _ in RANKS]
    await _all_reduce_by_host(ins, outs, ReduceOp.SUM, "float64")
    for r in RANKS:
        np.testing.assert_array_equal(outs[r], np.full(5, 21.0))
        np.testing.assert_array_equal(ins[r], np.full(5, r + 1.0))


@pytest.mark.timeout(30)
async def test_hierarchical_average_divides_the_whole_sum_once_by_the_number_of_ranks() -> None:
    """Hosts hold 3, 2 and 1 ranks: an average of per-host averages would be wrong."""
    xs = [np.full(7, float(r * r), dtype=np.float64) for r in RANKS]
    await _all_reduce_by_host(xs, xs, ReduceOp.AVG, "float64")
    for x in xs:
        np.testing.assert_array_equal(x, np.full(7, sum(r * r for r in RANKS) / len(RANKS)))
