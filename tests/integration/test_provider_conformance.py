"""One conformance suite that every collective provider runs (client/data/providers.py).

Each provider gets one spawned world in which it is the one chosen: the message driver (tcp
links), the shared-memory arena (shm links, one host), the hierarchical route (two hosts by
host identity, two ranks on each), device staging and CUDA IPC (the CPU stand-in device,
aiocoll.device._device_threads, with a 512-byte staging buffer so that operations run in many
chunks). In that world every operation and every dtype is compared with numpy; two operations
in flight at once, with one rank late, both come out right; a mismatched call raises
MismatchError on every rank; a call whose wait is cancelled leaves its group usable
or closed with an error, never hung, and the rest of the job usable; a call one rank never
makes fails on the others with CollectiveTimeout naming it; closing groups is scoped to them
(torch's new_subgroups shape: halves, groups of one inside, destroyed while the other half
still works), and a member that destroys a group while another waits in it is named as left.
Then three ranks go, each seen in a group (formed while all were there) served by the same
provider: a rank killed with SIGKILL, a rank that leaves in order (its last operation
completes everywhere, the next fails as left within a second), and a rank that stops
(SIGSTOP) and is reported by the coordinator's liveness check: each is named by a
PeerLostError on every observer within a bound.
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
# provider -> (world size, environment, whether ranks claim two hosts); the routed world's
# hosts are the even and the odd ranks, so that each group the losses are seen in (the world
# less the ranks gone before) still spans both hosts with several ranks on one
WORLDS: dict[str, tuple[int, dict[str, str], bool]] = {
    "driver": (4, {"AIOCOLL_TRANSPORT": "tcp"}, False),
    "arena": (4, {"AIOCOLL_TRANSPORT": "shm"}, False),
    "routed": (5, {"AIOCOLL_TRANSPORT": "auto"}, True),
    "staged": (4, {"AIOCOLL_TRANSPORT": "tcp", **STAGING}, False),
    "ipc": (4, {"AIOCOLL_TRANSPORT": "tcp", **STAGING}, False),
}
LIVENESS = "3"  # AIOCOLL_HEARTBEAT_TIMEOUT (seconds) of every world: the silent rank's loss
SILENT = 1  # the rank that goes silent (rank 0 holds the coordinator); n - 1 is killed, n - 2 leaves
DTYPES = ("float32", "float64", "float16", "int8", "uint8", "int32", "int64")
COUNT = 300  # elements: several staging chunks of every dtype but int8/uint8
KILL_BOUND = 20.0  # seconds from a SIGKILL to the survivors' PeerLostError
LEAVE_BOUND = 10.0  # seconds from a clean leave to the others' PeerLostError (promised: 1)
SILENT_BOUND = 30.0  # seconds from a SIGSTOP to the others' PeerLostError (liveness: 3)
TIMEOUT_S = 1.0  # the operation timeout of the call the last rank never makes
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
    out: dict[str, Any] = {
        "served_by": chosen["host"]["all_reduce"][0],
        "device_rows": chosen["device"]["all_reduce"],
    }
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

    # an operation timeout: the last rank never calls; every other rank's call names it
    slow = await pg.new_group()
    if r != n - 1:
        timed = t.make(np.ones(COUNT, np.float32))
        out["timeout"] = await outcome(lambda: slow.all_reduce(timed, timeout=TIMEOUT_S))

    # a leave is scoped to the group that was closed (torch's new_subgroups shape): sub-groups of
    # the even and of the odd ranks, groups of one inside each, all destroyed while the other
    # half still runs operations on its sub-group and then forms a new group with everyone
    halves = [await pg.new_group([k for k in range(n) if k % 2 == side]) for side in (0, 1)]
    mine = halves[r % 2]
    ones = [await mine.new_group([k]) for k in range(mine.size)]
    for g in ones:
        if g is not None:
            await g.destroy()
    if r % 2:
        for g in halves:
            if g is not None:
                await g.destroy()
    else:
        half = t.make(np.ones(COUNT, np.float32))
        await mine.all_reduce(half, timeout=30)
        await asyncio.sleep(0.2)  # the odd ranks have closed theirs meanwhile
        await mine.all_reduce(half, timeout=30)
        out["scoped_half"] = bool(t.read(half)[0] == len(mine.ranks) ** 2)
    # a member that destroys a group while another waits in it: told within a second, as a
    # PeerLostError that says it left, in that group only
    pair = await pg.new_group([0, 1])
    if r == 1:
        await asyncio.sleep(0.3)
        await pair.destroy()
    elif r == 0:
        p = t.make(np.ones(COUNT, np.float32))
        started = time.monotonic()
        out["pair_left"] = await outcome(lambda: pair.all_reduce(p, timeout=60))
        out["pair_left"]["elapsed"] = time.monotonic() - started
    after = await pg.new_group()
    u = t.make(np.full(COUNT, r + 1, np.float32))
    await after.all_reduce(u, timeout=30)
    out["scoped_new_group"] = bool(t.read(u)[0] == n * (n + 1) / 2)

    # Groups for the two losses after the kill, formed while every rank is there: the rank that
    # leaves (n - 2) and the one that goes silent (VICTIMS[provider]) are each in their own
    # group with observers that survive the losses before it.
    left_victim, silent_victim = n - 2, SILENT
    gone_first = {n - 1}
    g_left = await pg.new_group([k for k in range(n) if k not in gone_first])
    g_silent = await pg.new_group([k for k in range(n) if k not in gone_first | {left_victim}])
    out["loss_groups_served_by"] = [
        g._providers.chosen["host"]["all_reduce"][0] for g in (g_left, g_silent) if g is not None
    ]

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

    # a clean leave: the rank does its last operation, destroys its process group and exits 0,
    # while the others hold their loop (so its goodbye reaches them with its last operation's
    # data): that operation completes on every rank, and the next one, which they called
    # already, fails within a second as a PeerLostError that says it left
    if r == left_victim:
        last = t.make(np.full(COUNT, r + 1, np.float32))
        await asyncio.sleep(0.3)
        await g_left.all_reduce(last, timeout=60)
        await pg.destroy()
        if t.device is not None:
            t.device.close()
        return out
    last = t.make(np.full(COUNT, r + 1, np.float32))
    left = t.make(np.ones(COUNT, np.float32))
    final = g_left.all_reduce(last, timeout=60)
    nxt = g_left.all_reduce(left, timeout=60)
    time.sleep(1.5)  # noqa: ASYNC251 (the loop is held: the leaving rank finishes and leaves meanwhile)
    out["left_last"] = await outcome(lambda: final)
    total = sum(k + 1 for k in g_left.ranks)
    out["left_last"]["right"] = bool(np.array_equal(t.read(last), np.full(COUNT, total, np.float32)))
    started = time.monotonic()
    out["left"] = await outcome(lambda: nxt)
    out["left"]["elapsed"] = time.monotonic() - started

    # silent past the heartbeat timeout: the rank stops (SIGSTOP: its sockets stay open); the
    # coordinator's liveness check reports it, and every observer names it
    if r == silent_victim:
        os.kill(os.getpid(), signal.SIGSTOP)
        return out
    quiet = t.make(np.ones(COUNT, np.float32))
    started = time.monotonic()
    out["silent"] = await outcome(lambda: g_silent.all_reduce(quiet, timeout=60))
    out["silent"]["elapsed"] = time.monotonic() - started
    if r == 0:
        os.kill(out["pids"][silent_victim], signal.SIGKILL)
    if t.device is not None:  # the device's shared memory goes with it
        t.device.close()
        mine_files = f"aiocoll-ipc-{os.getpid()}-"
        out["files_left"] = [name for name in os.listdir("/dev/shm") if name.startswith(mine_files)]
    return out


@pytest.mark.parametrize("provider", sorted(WORLDS))
def test_every_provider_conforms(provider: str) -> None:
    n, env, two_hosts = WORLDS[provider]
    prefix = (lambda rank: ["env", f"AIOCOLL_HOST_ID=conformance-host-{rank % 2}"]) if two_hosts else None
    env = {**env, "AIOCOLL_HEARTBEAT_TIMEOUT": LIVENESS}
    results = run_world(conformance, n, args=(provider,), timeout=200, env=env, prefix=prefix)
    killed, left, silent = n - 1, n - 2, SILENT
    assert results[killed].exitcode == -signal.SIGKILL, results[killed]
    assert results[silent].exitcode == -signal.SIGKILL, results[silent]
    assert results[left].exitcode == 0 and results[left].ok, results[left]
    expected = {"driver": "driver", "arena": "arena", "routed": "routed", "staged": "driver", "ipc": "driver"}
    for rank in range(killed):
        res = results[rank]
        if rank == silent:
            continue
        assert res.ok, res.error and res.error.traceback
        got = res.value
        assert got["served_by"] == expected[provider], got["served_by"]
        assert got["device_rows"] == ["ipc", "staged"], got["device_rows"]  # the device rows, in order
        assert got["loss_groups_served_by"] == [expected[provider]] * (1 if rank == left else 2), got
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
        timed = got["timeout"]
        assert timed["error"] == "CollectiveTimeout" and timed["missing"] == [killed], timed
        if rank % 2 == 0:
            assert got["scoped_half"] is True
        if rank == 0:
            pair = got["pair_left"]
            assert pair["error"] == "PeerLostError" and pair["rank"] == 1 and pair["left"] is True, pair
            assert "destroyed group" in pair["message"] and pair["elapsed"] < LEAVE_BOUND, pair
        assert got["scoped_new_group"] is True
        lost = got["lost"]
        assert lost["error"] == "PeerLostError" and lost["rank"] == killed and lost["left"] is False, lost
        assert lost["elapsed"] < KILL_BOUND, lost
        if rank == left:
            continue  # it left
        assert got["left_last"]["error"] is None and got["left_last"]["right"], got["left_last"]
        gone = got["left"]
        assert gone["error"] == "PeerLostError" and gone["rank"] == left and gone["left"] is True, gone
        assert f"rank {left} left" in gone["message"], gone
        assert gone["elapsed"] < LEAVE_BOUND, gone
        quiet = got["silent"]
        assert quiet["error"] == "PeerLostError" and quiet["rank"] == silent and quiet["left"] is False, quiet
        assert quiet["elapsed"] < SILENT_BOUND, quiet
        assert got.get("files_left", []) == [], got["files_left"]
    if provider == "ipc":
        # the killed rank could not close its device: its files go when an IPC device is next made
        from aiocoll.device._device_threads import remove_dead_ipc_files

        dead = f"aiocoll-ipc-{results[0].value['pids'][killed]}-"
        assert any(name.startswith(dead) for name in remove_dead_ipc_files())
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(dead)]
