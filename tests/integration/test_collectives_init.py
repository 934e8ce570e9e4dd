"""init_process_group's rendezvous paths between real processes: env://, tcp:// with an embedded or an
external coordinator, file://, a caller's store; plus job/token handling and rendezvous timeouts."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _use(pg: Any) -> dict[str, Any]:
    x = np.full(2, pg.rank + 1, np.int64)
    await pg.all_reduce(x)
    return {"rank": pg.rank, "size": pg.size, "sum": x.tolist()}


async def via_env(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import aiocoll

    host, port = init_method.removeprefix("tcp://").split(":")
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ["AIOCOLL_TOKEN"] = "env-token"
    os.environ["AIOCOLL_JOB"] = "env-job"
    async with await aiocoll.init_process_group(timeout=30) as pg:
        out = await _use(pg)
        out["job"] = pg._rt.session.job
        return out


async def via_file(rank: int, world_size: int, init_method: str, path: str) -> dict[str, Any]:
    import aiocoll

    pg = await aiocoll.init_process_group(
        f"file://{path}", rank=rank, world_size=world_size, token="t", timeout=30
    )
    try:
        out = await _use(pg)
        sub = await pg.new_group([0, 1])
        if sub is not None:
            y = np.ones(1, np.float32)
            await sub.all_reduce(y)
            out["sub"] = float(y[0])
        return out
    finally:
        await pg.destroy()


async def via_external(rank: int, world_size: int, init_method: str, port: int) -> dict[str, Any]:
    import aiocoll

    pg = await aiocoll.init_process_group(
        f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, token="ext", job="shared", timeout=30
    )
    try:
        out = await _use(pg)
        out["embedded"] = pg._rt.coordinator is not None
        return out
    finally:
        await pg.destroy()


async def via_store(rank: int, world_size: int, init_method: str, path: str) -> dict[str, Any]:
    import aiocoll

    store = aiocoll.PrefixStore("mine", aiocoll.FileStore(path, world_size))
    outs = []
    for _ in range(2):  # a second rendezvous on the same store must not reuse the first's addresses
        pg = await aiocoll.init_process_group(
            store=store, rank=rank, world_size=world_size, token="s", timeout=30
        )
        try:
            outs.append(await _use(pg))
        finally:
            await pg.destroy()
    await store.aclose()
    return {"sum": outs[0]["sum"], "second": outs[1]["sum"]}


async def lonely(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import aiocoll

    t0 = time.monotonic()
    try:
        await aiocoll.init_process_group(
            init_method, rank=rank, world_size=world_size, token="x", timeout=2.0
        )
        return {"error": None}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0}


async def assigned_rank(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import aiocoll

    pg = await aiocoll.init_process_group(
        init_method, rank=0 if rank == 0 else None, world_size=world_size, token="a", timeout=30
    )
    try:
        return await _use(pg)
    finally:
        await pg.destroy()


def test_env_init_reads_master_addr_rank_world_size_token_and_job() -> None:
    values = unwrap(run_world(via_env, 2, init=False, timeout=90))
    assert [v["rank"] for v in values] == [0, 1]
    assert all(v["sum"] == [3, 3] and v["job"] == "env-job" for v in values)


def test_file_init_rendezvous_through_a_shared_file() -> None:
    with tempfile.TemporaryDirectory() as d:
        values = unwrap(run_world(via_file, 3, init=False, args=(os.path.join(d, "rdzv"),), timeout=90))
    assert [v["sum"] for v in values] == [[6, 6]] * 3
    assert values[0]["sub"] == 2.0 and values[1]["sub"] == 2.0 and "sub" not in values[2]


def test_store_argument_rendezvous_through_any_store() -> None:
    with tempfile.TemporaryDirectory() as d:
        values = unwrap(run_world(via_store, 2, init=False, args=(os.path.join(d, "s"),), timeout=90))
    assert [v["sum"] for v in values] == [[3, 3]] * 2
    assert [v["second"] for v in values] == [[3, 3]] * 2


def test_ranks_join_an_external_coordinator_instead_of_embedding_one() -> None:
    from aiocoll.server import Coordinator

    async def main() -> list[Any]:
        coord = Coordinator("127.0.0.1", 0, token="ext")
        await coord.start()
        try:
            return await asyncio.to_thread(
                run_world, via_external, 2, init=False, args=(coord.port,), timeout=90
            )
        finally:
            await coord.stop()

    values = unwrap(asyncio.run(main()))
    assert all(v["sum"] == [3, 3] and v["embedded"] is False for v in values)


def test_coordinator_assigns_ranks_left_unset() -> None:
    values = unwrap(run_world(assigned_rank, 3, init=False, timeout=90))
    assert sorted(v["rank"] for v in values) == [0, 1, 2]
    assert all(v["sum"] == [6, 6] for v in values)


def test_missing_ranks_make_rendezvous_fail_within_its_timeout() -> None:
    # a world of 2 where only rank 0 ever starts
    values = unwrap(run_world(lonely_in_a_world_of_two, 1, init=False, timeout=60))
    assert values[0]["error"] == "RendezvousError", values[0]
    assert values[0]["elapsed"] < 15.0


async def lonely_in_a_world_of_two(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    return await lonely(rank, 2, init_method)
