"""Shared memory through the public API: the link factory's choice, the groups whose collectives
read each other's memory (the world and sub-groups, regions reused after destroy), results
against numpy, mismatches, AIOCOLL_TRANSPORT=tcp, and a rank killed with SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def _error(work: Any) -> dict[str, Any]:
    try:
        await work
    except Exception as exc:
        return {"error": type(exc).__name__, "rank": getattr(exc, "rank", None), "message": str(exc)}
    return {"error": None}


async def per_operation_garbage(pg: Any, ops: int = 60) -> list[str]:
    """The kinds of object that small collectives left, once per operation or more, to the
    cyclic garbage collector. A finished operation must be freed by reference counting: a
    reference cycle per operation (its engine record and its Work holding each other, say) makes
    small operations pay for a collection every few dozen calls."""
    import gc

    x = np.ones(2, np.float32)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(ops):
            await pg.all_reduce(x)
            await pg.broadcast(x, src=0)
        gc.collect()
        counts: dict[str, int] = {}
        for o in gc.garbage:
            counts[type(o).__name__] = counts.get(type(o).__name__, 0) + 1
        return sorted(name for name, count in counts.items() if count >= ops)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def shm_checks(pg: Any) -> dict[str, Any]:
    import aiocoll

    r, n = pg.rank, pg.size
    out: dict[str, Any] = {
        "kinds": sorted(set(pg._rt.transport.link_kinds().values())),
        "world_shm": pg._providers.arena is not None,
        "garbage": await per_operation_garbage(pg),
    }
    x = np.arange(300_000, dtype=np.float32) * (r + 1)  # 1.2 MB: two steps of the 1 MiB chunk
    await pg.all_reduce(x)
    out["all_reduce"] = bool(np.array_equal(x, np.arange(300_000, dtype=np.float32) * sum(range(1, n + 1))))
    y = np.full(5, r, np.int64)
    await pg.all_reduce(y, op=aiocoll.ReduceOp.MAX)
    out["max"] = y.tolist()
    b = np.arange(7, dtype=np.float64) if r == 2 else np.zeros(7)
    await pg.broadcast(b, src=2)
    out["broadcast"] = b.tolist()
    gathered = np.zeros(3 * n, np.int32)
    await pg.all_gather_into_tensor(gathered, np.full(3, r, np.int32))
    out["all_gather"] = gathered.tolist()
    rs = np.zeros(2, np.float32)
    await pg.reduce_scatter_tensor(rs, np.arange(2 * n, dtype=np.float32) + r)
    out["reduce_scatter"] = rs.tolist()
    await pg.barrier()
    # point to point over the shm links
    if r == 0:
        await pg.send(np.full(3, 9.0), dst=1, tag=5)
    elif r == 1:
        got = np.zeros(3)
        await pg.recv(got, src=0, tag=5)
        out["p2p"] = got.tolist()
    # sub-groups: their own regions; a destroyed group's region is taken again
    sub = await pg.new_group([0, 2, 3])
    other = await pg.new_group([1, 3])
    if sub is not None:
        out["sub_region"] = sub._providers.arena.region
        s = np.full(4, float(r))
        await sub.all_reduce(s)
        out["sub_sum"] = s.tolist()
        await sub.destroy()
    if other is not None:
        out["other_region"] = other._providers.arena.region
    again = await pg.new_group([0, 2])
    if again is not None:
        out["again_region"] = again._providers.arena.region
        a = np.full(2, r + 1, np.int32)
        await again.all_reduce(a)
        out["again_sum"] = a.tolist()
    # two groups formed at once, sharing ranks 1 and 3: never the same region on a rank
    first, second = await asyncio.gather(pg.new_group([0, 1, 3]), pg.new_group([1, 2, 3]))
    regions = []
    for name, g in (("first", first), ("second", second)):
        if g is not None:
            regions.append(None if g._providers.arena is None else g._providers.arena.region)
            v = np.full(3, float(r + 1))
            await g.all_reduce(v)
            out[f"{name}_sum"] = v.tolist()
    out["concurrent_regions"] = regions
    # Hundreds of operations queued on the arena when a mismatch fails them: every one fails
    # with MismatchError. (Each failure used to fail the next from inside, one level deeper per
    # queued operation: RecursionError, and the rest stayed pending forever.)
    every = await pg.new_group(list(range(n)))
    if r == 0:
        queued = [every.all_reduce(np.zeros(1, np.float32), timeout=20) for _ in range(600)]
        outcomes = await asyncio.gather(*queued, return_exceptions=True)
        out["queued"] = sorted({type(o).__name__ for o in outcomes})
    else:
        await asyncio.sleep(0.3)  # rank 0 queues its 600 meanwhile
        out["queued"] = [(await _error(every.barrier(timeout=20)))["error"]]
    # a mismatch: every rank raises MismatchError naming the count
    bad = np.ones(4 + (r == n - 1), np.float32)
    out["mismatch"] = await _error(pg.all_reduce(bad))
    return out


def test_ranks_of_one_host_use_shared_memory_for_links_and_group_collectives() -> None:
    n = 4
    # a blank setting means its default (it once failed every shared-memory group)
    results = unwrap(run_world(shm_checks, n, env={"AIOCOLL_SHM_SPIN_US": ""}))
    for r, res in enumerate(results):
        assert res["kinds"] == ["shm"] and res["world_shm"]
        assert res["garbage"] == [], res["garbage"]
        assert res["all_reduce"] and res["max"] == [3] * 5
        assert res["broadcast"] == list(map(float, range(7)))
        assert res["all_gather"] == [k for k in range(n) for _ in range(3)]
        total = sum(np.arange(2 * n, dtype=np.float32) + k for k in range(n))
        assert res["reduce_scatter"] == total[2 * r : 2 * r + 2].tolist()
        assert res["mismatch"]["error"] == "MismatchError" and "count" in res["mismatch"]["message"]
        assert res["queued"] == ["MismatchError"], res["queued"]
    assert results[1]["p2p"] == [9.0] * 3
    for r in (0, 2, 3):
        assert results[r]["sub_region"] == 1 and results[r]["sub_sum"] == [5.0] * 4
    for r in (1, 3):
        assert results[r]["other_region"] == 2  # region 1 was still in use on rank 3
    for r in (0, 2):
        assert results[r]["again_region"] == 1 and results[r]["again_sum"] == [4, 4]  # reused
    for r, res in enumerate(results):
        assert res.get("first_sum", [7.0] * 3) == [7.0] * 3 and res.get("second_sum", [9.0] * 3) == [9.0] * 3
        if r in (1, 3):  # in both: the first took a region, the second another or none
            first_region, second_region = res["concurrent_regions"]
            assert first_region is not None and first_region != second_region, res


async def tcp_checks(pg: Any) -> dict[str, Any]:
    from shm_world import polled_ping_pongs

    x = np.full(3, pg.rank + 1.0)
    await pg.all_reduce(x)
    return {
        "kinds": sorted(set(pg._rt.transport.link_kinds().values())),
        "shm": pg._providers.arena is not None,
        "x": x.tolist(),
        "garbage": await per_operation_garbage(pg),
        "polled": await polled_ping_pongs(pg),  # receives over tcp links let the loop sleep
    }


def test_transport_tcp_keeps_ranks_of_one_host_on_tcp() -> None:
    results = unwrap(run_world(tcp_checks, 2, env={"AIOCOLL_TRANSPORT": "tcp"}))
    assert results == [{"kinds": ["tcp"], "shm": False, "x": [3.0] * 3, "garbage": [], "polled": 0}] * 2


async def killed(pg: Any, op: str = "all_reduce") -> dict[str, Any]:
    from shm_world import dev_shm_in_use

    inherited = set(dev_shm_in_use())  # nothing in a fresh interpreter; only what appears counts
    if op == "all_reduce":
        x = np.ones(4_000_000, np.float32)  # 16 MB: many steps

        def run() -> Any:
            return pg.all_reduce(x, timeout=60)
    else:  # 9 MB per rank: every rank reads the others' buffers directly where the kernel allows
        x = np.ones(2_250_000, np.float32)
        outs = [np.zeros_like(x) for _ in range(pg.size)]

        def run() -> Any:
            return pg.all_gather(outs, x, timeout=60)

    for _ in range(2):
        await run()
    if pg.rank == 2:
        assert not set(dev_shm_in_use()) - inherited  # the victim's memory is all anonymous (memfd)
        asyncio.get_running_loop().call_later(0.005, os.kill, os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    for _ in range(100):
        res = await _error(run())
        if res["error"]:
            res["after"] = time.monotonic() - t0
            res["dev_shm"] = sorted(set(dev_shm_in_use()) - inherited)
            res["direct_steps"] = pg._providers.arena.direct_steps
            return res
    return {"error": None}


async def killed_mid_all_gather(pg: Any) -> dict[str, Any]:
    return await killed(pg, "all_gather")


@pytest.mark.parametrize("fn", [killed, killed_mid_all_gather])
def test_a_rank_killed_mid_collective_over_shm_fails_the_others_and_leaves_no_shared_memory(fn: Any) -> None:
    """all_reduce through the slots; all_gather reading the peers' buffers directly (where the
    kernel allows it: then a survivor may find the victim gone mid-read)."""
    from aiocoll.client.data._vm_read import vm_read_available

    results = run_world(fn, 3, timeout=120)
    assert results[2].exitcode == -signal.SIGKILL
    for r in (0, 1):
        assert results[r].error is None, results[r].error
        res = results[r].value
        assert res["error"] == "PeerLostError" and res["rank"] == 2, res
        assert res["after"] < 10.0
        assert res["dev_shm"] == []  # nothing under /dev/shm, so nothing there to leak
        if fn is killed_mid_all_gather and vm_read_available():
            assert res["direct_steps"] >= 2
