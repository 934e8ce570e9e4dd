"""One conformance suite that every collective provider runs (client/providers.py).

Each provider gets one spawned world in which it is the one chosen: the message driver (tcp
links), the shared-memory arena (shm links, one host), the hierarchical route (two hosts by
host identity, two ranks on each), device staging and CUDA IPC (the CPU stand-in device,
aiocoll.device._device_threads, with a 512-byte staging buffer so that operations run in many
chunks). In that world every operation and every dtype is compared with numpy; two operations
in flight at once, with one rank late, both come out right; a mismatched call raises
MismatchError on every rank; a call whose wait is cancelled leaves its group usable
or closed with an error, never hung, and the rest of the job usable; and a rank killed with
SIGKILL is named by a PeerLostError on every survivor within a bound.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import outcome, run_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STAGING = {"AIOCOLL_STAGING_CHUNK_BYTES": "512", "AIOCOLL_STAGING_BUFFERS": "2"}
# provider -> (world size, environment, whether ranks claim two hosts)
WORLDS: dict[str, tuple[int, dict[str, str], bool]] = {
    "driver": (3, {"AIOCOLL_TRANSPORT": "tcp"}, False),
    "arena": (3, {"AIOCOLL_TRANSPORT": "shm"}, False),
    "routed": (4, {"AIOCOLL_TRANSPORT": "auto"}, True),
    "staged": (3, {"AIOCOLL_TRANSPORT": "tcp", **STAGING}, False),
    "ipc": (3, {"AIOCOLL_TRANSPORT": "tcp", **STAGING}, False),
}
DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")
COUNT = 300  # elements: several staging chunks of every dtype but int8/uint8
KILL_BOUND = 20.0  # seconds from a SIGKILL to the survivors' PeerLostError
SETTLE_BOUND = 15.0  # seconds within which an operation after a cancelled one must end


class Tensors:
    """Host numpy arrays, or tensors of the CPU stand-in device (staged, or with IPC)."""

    def __init__(self, provider: str) -> None:
        self.device: Any = None
        if provider in ("staged", "ipc"):
            from aiocoll.device._device_threads import ThreadDevice

            self.device = ThreadDevice(copy_delay=0.0, ipc=provider == "ipc", identity="conformance/gpu0")

    def make(self, values: np.ndarray) -> Any:
        return values.copy() if self.device is None else self.device.tensor(values.copy())

    def read(self, t: Any) -> np.ndarray:
        return np.asarray(t) if self.device is None else t.snapshot()


def _inputs(rank: int, dtype: str, count: int = COUNT) -> np.ndarray:
    """Small values, different on every rank, so sums and products stay exact in every dtype."""
    base = (np.arange(count) * (rank + 3) + rank) % 3 + 1
    if dtype == "float16":
        base = base % 2 + 1  # products of a few small values stay exact in float16
    return base.astype(dtype)


def _ops_for(dtype: str) -> list[str]:
    ops = ["sum", "product", "min", "max"]
    if dtype.startswith("float"):
        ops.append("avg")
    else:
        ops += ["band", "bor", "bxor"]
    return ops


def _fold(op: str, arrays: list[np.ndarray]) -> np.ndarray:
    out = arrays[0].copy()
    for a in arrays[1:]:
        if op == "sum" or op == "avg":
            out = out + a
        elif op == "product":
            out = out * a
        elif op == "min":
            out = np.minimum(out, a)
        elif op == "max":
            out = np.maximum(out, a)
        elif op == "band":
            out = out & a
        elif op == "bor":
            out = out | a
        else:
            out = out ^ a
    if op == "avg":
        out = out / len(arrays)
    return out.astype(arrays[0].dtype)


async def _every_op_and_dtype(pg: Any, t: Tensors, paths: set[str]) -> list[str]:
    """Every operation in every dtype against numpy; the differences, as text (``paths``: the
    device paths the all_reduces took)."""
    import aiocoll
    from aiocoll.device._staged_ops import StagedOp

    r, n = pg.rank, pg.size
    wrong: list[str] = []

    def check(what: str, got: Any, want: np.ndarray, dtype: str, op: str = "") -> None:
        got = t.read(got)
        if op == "avg" or dtype == "float16":
            same = np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-3)
        else:
            same = np.array_equal(got, want)
        if not same:
            wrong.append(f"{what} {dtype}: got {got.reshape(-1)[:6]} want {want.reshape(-1)[:6]}")

    ins = {dtype: [_inputs(k, dtype) for k in range(n)] for dtype in DTYPES}
    for dtype in DTYPES:
        mine, every = ins[dtype][r], ins[dtype]
        for op in _ops_for(dtype):
            x = t.make(mine)
            await pg.all_reduce(x, op=getattr(aiocoll.ReduceOp, op.upper()))
            paths.add(StagedOp.last_path)
            check(f"all_reduce {op}", x, _fold(op, every), dtype, op)
        x = t.make(mine)
        await pg.broadcast(x, src=n - 1)
        check("broadcast", x, every[n - 1], dtype)
        x = t.make(mine)
        await pg.reduce(x, dst=1)
        if r == 1:
            check("reduce", x, _fold("sum", every), dtype)
        out = t.make(np.zeros(COUNT * n, dtype))
        await pg.all_gather_into_tensor(out, t.make(mine))
        check("all_gather_into_tensor", out, np.concatenate(every), dtype)
        outs = [t.make(np.zeros(COUNT, dtype)) for _ in range(n)]
        await pg.all_gather(outs, t.make(mine))
        for k in range(n):
            check(f"all_gather[{k}]", outs[k], every[k], dtype)
        gathered = [t.make(np.zeros(COUNT, dtype)) for _ in range(n)] if r == 0 else None
        await pg.gather(t.make(mine), gathered, dst=0)
        if gathered is not None:
            for k in range(n):
                check(f"gather[{k}]", gathered[k], every[k], dtype)
        parts = [t.make(_inputs(k + 10, dtype)) for k in range(n)] if r == 0 else None
        got = t.make(np.zeros(COUNT, dtype))
        await pg.scatter(got, parts, src=0)
        check("scatter", got, _inputs(r + 10, dtype), dtype)
        block = COUNT // n
        big = [_inputs(k, dtype, block * n) for k in range(n)]
        shard = t.make(np.zeros(block, dtype))
        await pg.reduce_scatter_tensor(shard, t.make(big[r]))
        check("reduce_scatter_tensor", shard, _fold("sum", big)[r * block : (r + 1) * block], dtype)
        moved = t.make(np.zeros(block * n, dtype))
        await pg.all_to_all_single(moved, t.make(big[r]))
        want = np.concatenate([big[k][r * block : (r + 1) * block] for k in range(n)])
        check("all_to_all_single", moved, want, dtype)
    await pg.barrier()
    return wrong


async def conformance(pg: Any, provider: str) -> dict[str, Any]:
    r, n = pg.rank, pg.size
    t = Tensors(provider)
    chosen = pg._providers.chosen
    out: dict[str, Any] = {"served_by": chosen.get("all_reduce", chosen["*"])[0]}
    paths: set[str] = set()
    out["wrong"] = await _every_op_and_dtype(pg, t, paths)
    out["device_paths"] = sorted(paths)

    # two operations in flight at once while rank 0 comes late: both right on every rank (a
    # provider that starts the second before the first on some ranks would mix them up)
    a = t.make(np.full(COUNT, r + 1, np.float32))
    b = t.make(np.full(COUNT, 2 * (r + 1), np.float32))
    if r == 0:
        await asyncio.sleep(0.5)
    await asyncio.gather(pg.all_reduce(a, timeout=30), pg.all_reduce(b, timeout=30))
    total = n * (n + 1) / 2
    out["in_flight"] = [t.read(a).tolist() == [total] * COUNT, t.read(b).tolist() == [2 * total] * COUNT]

    # a mismatched call, in a group of its own: MismatchError on every rank
    sub = await pg.new_group()
    x = t.make(np.ones(COUNT + (r == n - 1), np.float32))
    out["mismatch"] = await outcome(lambda: sub.all_reduce(x, timeout=30))

    # a wait cancelled on all ranks but rank 0 (which calls late): the group then either runs
    # the next operation correctly or fails it with an error, in bounded time; the world group
    # stays usable
    late = await pg.new_group()
    y = t.make(np.full(COUNT, r + 1, np.float32))
    if r != 0:
        try:
            await asyncio.wait_for(asyncio.ensure_future(late.all_reduce(y, timeout=30)), 0.3)
            out["cancelled"] = False
        except asyncio.TimeoutError:
            out["cancelled"] = True
    else:
        await asyncio.sleep(1.0)
        out["cancelled"] = (await outcome(lambda: late.all_reduce(y, timeout=5)))["error"]
    z = t.make(np.full(COUNT, r + 1, np.float32))
    started = time.monotonic()
    after = await outcome(lambda: late.all_reduce(z, timeout=SETTLE_BOUND))
    after["elapsed"] = time.monotonic() - started
    if after["error"] is None:
        after["right"] = bool(np.array_equal(t.read(z), np.full(COUNT, n * (n + 1) / 2, np.float32)))
    out["after_cancel"] = after
    w = t.make(np.full(4, r + 1, np.float32))
    await pg.all_reduce(w, timeout=30)
    out["world_after_cancel"] = t.read(w).tolist()

    # kill -9 of the last rank: every survivor's next operation names it
    out["pids"] = await pg.all_gather_object(os.getpid(), timeout=30)
    await pg.barrier(timeout=30)  # every rank is done with the gather before the last one dies
    if r == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    v = t.make(np.ones(COUNT, np.float32))
    lost = await outcome(lambda: pg.all_reduce(v, timeout=60))
    lost["elapsed"] = time.monotonic() - started
    out["lost"] = lost
    if t.device is not None:  # the device's shared memory goes with it
        t.device.close()
        mine = f"aiocoll-ipc-{os.getpid()}-"
        out["files_left"] = [name for name in os.listdir("/dev/shm") if name.startswith(mine)]
    return out


@pytest.mark.parametrize("provider", sorted(WORLDS))
def test_every_provider_conforms(provider: str) -> None:
    n, env, two_hosts = WORLDS[provider]
    prefix = (lambda rank: ["env", f"AIOCOLL_HOST_ID=conformance-host-{rank % 2}"]) if two_hosts else None
    results = run_world(conformance, n, args=(provider,), timeout=200, env=env, prefix=prefix)
    killed = n - 1
    assert results[killed].exitcode == -signal.SIGKILL, results[killed]
    expected = {"driver": "driver", "arena": "arena", "routed": "routed", "staged": "driver", "ipc": "driver"}
    for rank in range(killed):
        res = results[rank]
        assert res.ok, res.error and res.error.traceback
        got = res.value
        assert got["served_by"] == expected[provider], got["served_by"]
        if provider in ("staged", "ipc"):
            assert provider in got["device_paths"], got["device_paths"]
        assert got["wrong"] == [], got["wrong"]
        assert got["in_flight"] == [True, True]
        assert got["mismatch"]["error"] == "MismatchError", got["mismatch"]
        assert "count" in got["mismatch"]["message"], got["mismatch"]["message"]
        if rank != 0:
            assert got["cancelled"] is True
        after = got["after_cancel"]
        assert after["elapsed"] < SETTLE_BOUND + 5, after
        assert after["error"] is not None or after["right"], after
        assert got["world_after_cancel"] == [n * (n + 1) / 2] * 4
        lost = got["lost"]
        assert lost["error"] == "PeerLostError" and lost["rank"] == killed, lost
        assert lost["elapsed"] < KILL_BOUND, lost
        assert got.get("files_left", []) == [], got["files_left"]
    if provider == "ipc":
        # the killed rank could not close its device: its files go when an IPC device is next made
        from aiocoll.device._device_threads import remove_dead_ipc_files

        dead = f"aiocoll-ipc-{results[0].value['pids'][killed]}-"
        assert any(name.startswith(dead) for name in remove_dead_ipc_files())
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(dead)]
