"""The IPC path between real processes: device to device through shared buffers and events.

The device is the thread-backed one with ``ipc=True``: its buffers and interprocess events are
shared memory files that peer processes open from handles exchanged over the authenticated
links, as CUDA IPC handles are; a stream in one process waits for an event recorded by another.
The pool buffer (and so each rank's mailbox) is 512 bytes, so every operation runs in many
chunks and every chunk goes through the posted / done handshake. Results are compared with numpy.

Three worlds: ranks claiming one device (peers' buffers are reduced straight from where they
are), ranks on different devices (peers' chunks are first copied into a local scratch buffer),
and a world where one rank refuses IPC (every rank falls back to pinned staging, by agreement).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ENV = {"AIOCOLL_STAGING_CHUNK_BYTES": "512", "AIOCOLL_STAGING_BUFFERS": "2"}


async def worker(pg: Any, mode: str) -> dict[str, Any]:
    import logging

    from aiocoll.device._device_threads import ThreadDevice
    from aiocoll.device._staged_ops import StagedOp
    from aiocoll.device._staging import staging_for

    r, n = pg.rank, pg.size
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    staging_log = logging.getLogger("aiocoll.staging")
    staging_log.addHandler(Keep())
    staging_log.setLevel(logging.DEBUG)
    if mode == "refuse" and r == 1:
        os.environ["AIOCOLL_CUDA_IPC"] = "0"
    identity = "test-host/gpu0" if mode == "same" else f"test-host/gpu{r}"
    dev = ThreadDevice(copy_delay=0.0002, ipc=True, identity=identity)
    caller = dev.new_stream()
    dev.set_current_stream(caller)
    out: dict[str, Any] = {"paths": []}

    def later(values: np.ndarray, dtype_name: str | None = None) -> Any:
        """A device tensor that the caller's stream fills with ``values`` after a while."""
        t = dev.tensor(np.zeros_like(values), dtype_name)

        def kernel() -> None:
            time.sleep(0.02)
            t.flat[:] = values.reshape(-1)

        dev.launch(caller, kernel)
        return t

    x = later(np.arange(1000, dtype=np.float32) * (r + 1))
    await pg.all_reduce(x)
    out["sum"] = x.snapshot()
    out["paths"].append(StagedOp.last_path)

    y = later(np.arange(700, dtype=np.int64) * ((-1) ** r) + 10 * r)
    await pg.all_reduce(y, op="max")
    out["max"] = y.snapshot()
    out["paths"].append(StagedOp.last_path)

    z = later(np.full(900, r + 1.0, np.float64)) if r == n - 1 else dev.tensor(np.zeros(900))
    await pg.broadcast(z, src=n - 1)
    out["broadcast"] = z.snapshot()
    out["paths"].append(StagedOp.last_path)

    a = later(np.full(300, float(r), np.float32))
    await pg.all_reduce(a, op="avg")
    out["avg"] = a.snapshot()
    out["paths"].append(StagedOp.last_path)

    # several in flight: they take the group's mailbox one at a time, in call order
    many = [later(np.full(400, r * 10 + i, np.float32)) for i in range(5)]
    await asyncio.gather(*(pg.all_reduce(t) for t in many))
    out["many"] = [t.snapshot() for t in many]

    # a small one (one chunk) is staged: a peer may have used a host tensor there
    s = later(np.full(10, 1.0, np.float32))
    await pg.all_reduce(s)
    out["small"] = (s.snapshot(), StagedOp.last_path)

    out["pool_in_use"] = staging_for(dev).pool.in_use
    out["log"] = said
    await pg.destroy()  # forgets the group's IPC state
    dev.close()
    mine = f"aiocoll-ipc-{os.getpid()}-"
    out["files_left"] = sorted(p for p in os.listdir("/dev/shm") if p.startswith(mine))
    return out


def _check_values(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for res in results:
        np.testing.assert_array_equal(res["sum"], np.arange(1000, dtype=np.float32) * sum(range(1, n + 1)))
        expect = np.max([np.arange(700) * ((-1) ** i) + 10 * i for i in range(n)], axis=0)
        np.testing.assert_array_equal(res["max"], expect)
        np.testing.assert_array_equal(res["broadcast"], np.full(900, float(n)))
        np.testing.assert_array_equal(res["avg"], np.full(300, sum(range(n)) / n, np.float32))
        for i, t in enumerate(res["many"]):
            np.testing.assert_array_equal(t, np.full(400, sum(k * 10 + i for k in range(n)), np.float32))
        small, path = res["small"]
        np.testing.assert_array_equal(small, np.full(10, float(n)))
        assert path == "staged"
        assert res["pool_in_use"] == 0 and res["files_left"] == []


def test_ranks_on_one_device_reduce_straight_from_each_others_buffers() -> None:
    results = unwrap(run_world(worker, 3, args=("same",), timeout=150, env=ENV))
    _check_values(results)
    for r, res in enumerate(results):
        assert res["paths"] == ["ipc"] * 4
        assert any(
            f"rank {r}: all_reduce" in line and "via ipc (device to device)" in line for line in res["log"]
        )
        assert any("CUDA IPC on" in line for line in res["log"])


def test_ranks_on_different_devices_copy_peer_chunks_device_to_device() -> None:
    results = unwrap(run_world(worker, 2, args=("different",), timeout=150, env=ENV))
    _check_values(results)
    for res in results:
        assert res["paths"] == ["ipc"] * 4


def test_one_rank_refusing_ipc_makes_every_rank_stage() -> None:
    results = unwrap(run_world(worker, 2, args=("refuse",), timeout=150, env=ENV))
    _check_values(results)
    for res in results:
        assert res["paths"] == ["staged"] * 4
        refused = "IPC off: rank 1: disabled by AIOCOLL_CUDA_IPC=0"
        assert any("via staged (pinned host buffers" in line and refused in line for line in res["log"])
