"""A world spread over three "hosts" (network + UTS namespaces joined by veth links), the
coordinator on one of them, several ranks per host, placed out of rank order.

Checks, in one world: peers on one host are linked by shared memory and peers on other hosts
by TCP (the link factory's auto choice from the host identities); every rank's host identity in
the membership table tells the hosts apart (although all three hosts carry the same hostname, as
cloned machines do) and agrees within a host; all_reduce runs hierarchically (reduce per host,
exchange among leaders, broadcast per host) and matches numpy for several ops, dtypes and sizes,
on the world and on a sub-group that spans hosts; AVG (hierarchical too: the whole sum divided
once) and the other collectives match numpy as well. Skips with the reason where namespaces
cannot be made (not root, no iproute2).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from aiocoll.testing.netns import NamespaceHosts, NamespacesUnavailable
from aiocoll.testing.world import World, unwrap

pytestmark = pytest.mark.integration

# rank -> host: host 0 (with the coordinator) holds 0, 3, 5; host 1 holds 1, 4; host 2 holds 2
PLACEMENT = [0, 1, 2, 0, 1, 0]
SUBGROUP = [1, 2, 3, 4]  # spans the three hosts, host 1 twice


def _inputs(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + count)
    return rng.integers(1, 5, size=count).astype(dtype)


async def _checks(pg: Any, placement: list[int]) -> dict[str, Any]:
    from aiocoll.client.data.routing import choose_route

    from aiocoll import ReduceOp
    from aiocoll._host import host_identity

    out: dict[str, Any] = {"identity": host_identity()}
    out["identities"] = await pg.all_gather_object(out["identity"])
    out["route"] = choose_route("all_reduce", ReduceOp.SUM, pg._providers.layout)
    out["avg_route"] = choose_route("all_reduce", ReduceOp.AVG, pg._providers.layout)
    out["link_kinds"] = pg._rt.transport.link_kinds()
    n = pg.size
    for dtype in ("float64", "int32", "float32"):
        for count in (1, 1000, 300_000):
            for op, combine in (("sum", np.add), ("max", np.maximum), ("product", np.multiply)):
                if op == "product" and count > 1000:
                    continue
                x = _inputs(pg.rank, count, dtype)
                await pg.all_reduce(x, op=op)
                expected = combine.reduce(np.stack([_inputs(r, count, dtype) for r in range(n)]), axis=0)
                np.testing.assert_array_equal(x, expected, err_msg=f"all_reduce {op} {dtype} {count}")
    x = _inputs(pg.rank, 1000, "float64")
    await pg.all_reduce(x, op="avg")
    avg = np.mean(np.stack([_inputs(r, 1000, "float64") for r in range(n)]), axis=0)
    np.testing.assert_allclose(x, avg, rtol=1e-12)
    b = _inputs(pg.rank, 5000, "float32")
    await pg.broadcast(b, src=4)
    np.testing.assert_array_equal(b, _inputs(4, 5000, "float32"))
    gathered = np.zeros(n * 100, dtype="int64")
    await pg.all_gather_into_tensor(gathered, _inputs(pg.rank, 100, "int64"))
    np.testing.assert_array_equal(gathered, np.concatenate([_inputs(r, 100, "int64") for r in range(n)]))
    sub = await pg.new_group(SUBGROUP)
    if sub is not None:
        out["sub_route"] = choose_route("all_reduce", ReduceOp.SUM, sub._providers.layout)
        y = _inputs(pg.rank, 70_000, "float64")
        await sub.all_reduce(y)
        np.testing.assert_array_equal(y, np.sum([_inputs(r, 70_000, "float64") for r in SUBGROUP], axis=0))
    await pg.barrier()
    # the intra-host parts of the hierarchical all_reduces ran on the host's arenas
    out["arena_ops"] = _arena_ops(pg)
    out["sub_arena_ops"] = _arena_ops(sub) if sub is not None else None
    return out


def _host_parts(pg: Any) -> Any:
    """The routed provider's intra-host parts of the group (client/data/routing.HostParts), or None."""
    return pg._providers._routed._parts


def _arena_ops(pg: Any) -> int | None:
    """Operations the group's intra-host arena group completed here (None: it has none)."""
    parts = _host_parts(pg)
    return None if parts is None or parts.group is None else int(parts.group.completed)


@pytest.mark.timeout(120)
def test_a_world_over_three_namespace_hosts_reduces_hierarchically_and_matches_numpy() -> None:
    try:
        hosts = NamespaceHosts(3, hostnames=["node", "node", "node"])
    except NamespacesUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    with hosts:
        world = World(
            _checks,
            len(PLACEMENT),
            args=(PLACEMENT,),
            init_method=f"tcp://{hosts.addresses[0]}:29500",
            prefix=lambda rank: hosts.prefix(PLACEMENT[rank]),
            init_timeout=60,
            env={"AIOCOLL_TRANSPORT": "auto"},  # whatever the caller's environment says
        )
        results = unwrap(world.join(100))
    identities = [r["identity"] for r in results]
    assert all(r["identities"] == identities for r in results)  # the table every rank saw
    for a, host_a in enumerate(PLACEMENT):
        for b, host_b in enumerate(PLACEMENT):
            assert (identities[a] == identities[b]) == (host_a == host_b), (a, b, identities)
    assert all(identity.startswith("node/") for identity in identities)  # same hostname everywhere
    for rank, result in enumerate(results):  # AIOCOLL_TRANSPORT=auto: shm on a host, tcp across
        expected = {p: "shm" if PLACEMENT[p] == PLACEMENT[rank] else "tcp" for p in result["link_kinds"]}
        assert result["link_kinds"] == expected, (rank, result["link_kinds"])
    assert [r["route"] for r in results] == ["hierarchical"] * len(PLACEMENT)
    assert [r["avg_route"] for r in results] == ["hierarchical"] * len(PLACEMENT)
    assert [results[r]["sub_route"] for r in SUBGROUP] == ["hierarchical"] * len(SUBGROUP)
    # within a host of several members (hosts 0 and 1), the intra-host parts (an all_reduce and
    # a broadcast for each of the 25 all_reduces above) ran on the shared-memory arenas; rank 2
    # is alone on its host
    for rank, result in enumerate(results):
        crowded = PLACEMENT.count(PLACEMENT[rank]) > 1
        assert result["arena_ops"] == (2 * 25 if crowded else None), (rank, result["arena_ops"])
    for rank in SUBGROUP:  # in the sub-group only ranks 1 and 4 share a host
        sub_ops = results[rank]["sub_arena_ops"]
        assert (sub_ops == 2) if rank in (1, 4) else (sub_ops is None), (rank, sub_ops)


async def _tcp_checks(pg: Any) -> dict[str, Any]:
    """Over tcp links only, a hierarchical all_reduce whose hosts' members cannot share memory."""
    from aiocoll.client.data.routing import choose_route

    from aiocoll import ReduceOp

    n = pg.size
    for count in (3, 300_000):
        x = _inputs(pg.rank, count, "float64")
        await pg.all_reduce(x)
        np.testing.assert_array_equal(x, np.sum([_inputs(r, count, "float64") for r in range(n)], axis=0))
    return {
        "route": choose_route("all_reduce", ReduceOp.SUM, pg._providers.layout),
        "kinds": sorted(set(pg._rt.transport.link_kinds().values())),
        "arena_ops": _arena_ops(pg),
        "decided": _host_parts(pg) is not None and _host_parts(pg).decided,
    }


@pytest.mark.timeout(120)
def test_hosts_whose_members_cannot_share_memory_run_the_intra_host_parts_as_messages() -> None:
    try:
        hosts = NamespaceHosts(2)
    except NamespacesUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")
    placement = [0, 1, 0, 1]
    with hosts:
        world = World(
            _tcp_checks,
            len(placement),
            init_method=f"tcp://{hosts.addresses[0]}:29500",
            prefix=lambda rank: hosts.prefix(placement[rank]),
            init_timeout=60,
            env={"AIOCOLL_TRANSPORT": "tcp"},
        )
        results = unwrap(world.join(100))
    # the host's members agreed (over the links) that they have no arenas, and matched numpy
    assert results == [{"route": "hierarchical", "kinds": ["tcp"], "arena_ops": None, "decided": True}] * 4
