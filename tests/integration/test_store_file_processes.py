"""FileStore shared by real processes: counters, waits and cleanup across process boundaries."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from aiocoll import FileStore

pytestmark = pytest.mark.integration

_WORKER = """
import asyncio, sys
from aiocoll import FileStore

async def main(path, rank, world):
    store = await FileStore.open(path, world_size=world + 1, timeout=60)
    for _ in range(50):
        await store.add("counter", 1)
    await store.append("log", f"{rank};")
    await store.set(f"rank/{rank}", str(rank))
    await store.wait([f"rank/{r}" for r in range(world)])
    values = await store.multi_get([f"rank/{r}" for r in range(world)])
    assert values == [str(r).encode() for r in range(world)], values
    await store.aclose()

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


@pytest.mark.timeout(120)
async def test_processes_sharing_a_file_store_count_every_add_and_the_last_one_removes_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shared-store"
    world = 4
    # The parent is one more user, so the file outlives the workers until it has checked.
    parent = await FileStore.open(path, world_size=world + 1, timeout=60)
    procs = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", _WORKER, str(path), str(rank), str(world))
        for rank in range(world)
    ]
    try:
        for proc in procs:
            assert await asyncio.wait_for(proc.wait(), 90) == 0
        assert await parent.get("counter") == str(50 * world).encode()
        assert sorted((await parent.get("log")).decode().rstrip(";").split(";")) == [
            str(r) for r in range(world)
        ]
        assert path.exists()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        await parent.aclose()
    assert not path.exists(), "the last of world_size users to close removes the file"
