"""Collectives over shared memory between real processes (client.data._shm_coll), against numpy.

One forked world per size 1..8 runs every op and dtype of all_reduce (one-shot and chunked),
broadcast from every root, all_gather, reduce_scatter and barrier, plus a mismatch; small
chunks (64 KiB) make the chunked, pipelined path run many steps without large payloads.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from shm_world import Ctx, shm_world, values

from aiocoll._types import ReduceOp

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "bfloat16", "float32", "float64"]
COMPLEX = ["complex64", "complex128"]
OPS = {
    **{d: ["sum", "product", "min", "max", "band", "bor", "bxor"] for d in [*INTS, "bool"]},
    **{d: ["sum", "product", "min", "max", "avg"] for d in FLOATS},
    **{d: ["sum", "product", "avg"] for d in COMPLEX},
}
UFUNC = {
    "sum": np.add,
    "avg": np.add,
    "product": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
SMALL, LARGE = 17, 40_001  # LARGE elements exceed a 64 KiB chunk for every dtype but int8/bool


def storage(dtype: str) -> Any:
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)


def data(rank: int, count: int, dtype: str, op: str, salt: int) -> np.ndarray:
    rng = np.random.default_rng([rank, count, salt, len(dtype), len(op)])
    if dtype == "bool":
        return rng.integers(0, 2, count).astype(bool)
    lo, hi = (-2, 3) if op == "product" else (-8, 8)
    if dtype.startswith("uint"):
        lo = 0
    ints = rng.integers(lo, hi, count)
    if dtype == "bfloat16":  # small integers are exact in bfloat16: the top half of the float32
        return (ints.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    if dtype in COMPLEX:
        return (ints + 1j * rng.integers(lo, hi, count)).astype(dtype)
    return ints.astype(dtype)


def widen(a: np.ndarray, dtype: str) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else a


def reference(arrays: list[np.ndarray], dtype: str, op: str) -> np.ndarray:
    """numpy, folded in rank order; bfloat16 computed in float32 (exact for these values)."""
    vals = [widen(a, dtype) for a in arrays]
    if op == "avg":
        wide = np.complex128 if dtype in COMPLEX else np.float64
        out = (sum(v.astype(wide) for v in vals) / len(vals)).astype(vals[0].dtype)
    else:
        out = vals[0].copy()
        for v in vals[1:]:
            out = UFUNC[op](out, v).astype(vals[0].dtype)
    if dtype == "bfloat16":
        return (out.view(np.uint32) >> 16).astype(np.uint16)
    return out


def same(got: np.ndarray, want: np.ndarray, dtype: str, op: str) -> bool:
    if op == "avg":
        return bool(
            np.allclose(
                widen(got, dtype), widen(want, dtype), rtol=1e-2 if dtype in ("float16", "bfloat16") else 1e-6
            )
        )
    return bool(np.array_equal(got, want))


ALL_REDUCES = [(dtype, op, count) for dtype, ops in OPS.items() for op in ops for count in (SMALL, LARGE)]
# world size -> each all_reduce's expected result (by its place in ALL_REDUCES), computed by the
# test before it forks the world: the same for every rank, and generating every rank's input
# for it on each of the n ranks made the suite's largest worlds spend most of their CPU on it
ALL_REDUCE_WANTS: dict[int, list[np.ndarray]] = {}


def all_reduce_wants(n: int) -> list[np.ndarray]:
    return [
        reference([data(k, count, dtype, op, salt) for k in range(n)], dtype, op)
        for salt, (dtype, op, count) in enumerate(ALL_REDUCES, 1)
    ]


async def every_collective(ctx: Ctx) -> list[str]:
    r, n = ctx.rank, ctx.n
    failures: list[str] = []
    wants = ALL_REDUCE_WANTS[n]
    for salt, (dtype, op, count) in enumerate(ALL_REDUCES, 1):
        x = data(r, count, dtype, op, salt)
        await ctx.all_reduce(x, ReduceOp(op), dtype)
        if not same(x, wants[salt - 1], dtype, op):
            failures.append(f"all_reduce {dtype} {op} {count}")
    salt = len(ALL_REDUCES)
    for root in range(n):
        for count in (5, LARGE):
            x = data(r, count, "float64", "sum", 7) if r == root else np.zeros(count, np.float64)
            await ctx.run("broadcast", x, root)
            if not np.array_equal(x, data(root, count, "float64", "sum", 7)):
                failures.append(f"broadcast root {root} {count}")
    for dtype in ("int8", "float32", "complex128", "bfloat16"):
        for count in (3, LARGE):
            x = data(r, count, dtype, "sum", 11)
            outs = [np.full(count, 99, storage(dtype)) for _ in range(n)]
            await ctx.run("all_gather", outs, x)
            if not all(np.array_equal(outs[k], data(k, count, dtype, "sum", 11)) for k in range(n)):
                failures.append(f"all_gather {dtype} {count}")
    for dtype, ops in OPS.items():
        for op in ops:
            for count in (SMALL, 9_001):
                salt += 1
                ins = [data(r * n + j, count, dtype, op, salt) for j in range(n)]
                out = np.zeros(count, storage(dtype))
                await ctx.run("reduce_scatter", out, ins, ReduceOp(op), dtype)
                want = reference([data(k * n + r, count, dtype, op, salt) for k in range(n)], dtype, op)
                if not same(out, want, dtype, op):
                    failures.append(f"reduce_scatter {dtype} {op} {count}")
    # overflow gives inf and inf - inf nan, as in torch: results, never floating-point warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for count in (SMALL, LARGE):
            x = np.full(count, np.finfo(np.float32).max, np.float32)
            x[0] = np.inf if r == 0 else -np.inf if r == 1 else 0.0
            try:
                await ctx.all_reduce(x, ReduceOp.SUM, "float32")
            except Exception as exc:
                failures.append(f"overflowing all_reduce {count} raised {exc!r}")
                continue
            if n > 1 and not (np.isnan(x[0]) and np.isposinf(x[1:]).all()):
                failures.append(f"overflowing all_reduce {count} gave {x[:3]}")
    await ctx.run("barrier")
    # a mismatch: every rank raises MismatchError; no data moves
    x = np.ones(4 + (r == n - 1), np.float32)
    try:
        await ctx.all_reduce(x, ReduceOp.SUM, "float32")
        if n > 1:
            failures.append("mismatched all_reduce did not raise")
    except Exception as exc:
        if type(exc).__name__ != "MismatchError" or "count" not in str(exc):
            failures.append(f"mismatch raised {exc!r}")
        if not np.array_equal(x, np.ones_like(x)):
            failures.append("mismatched all_reduce changed the data")
    return failures


@pytest.mark.parametrize("n", range(1, 9))
def test_shm_collectives_match_numpy_for_every_op_and_dtype(n: int) -> None:
    ALL_REDUCE_WANTS[n] = all_reduce_wants(n)  # the forked ranks inherit it
    try:
        per_rank = values(shm_world(every_collective, n))
    finally:
        del ALL_REDUCE_WANTS[n]
    assert per_rank == [[]] * n


def large_copies(mismatch_kind: str, last_count: int) -> Any:
    """Broadcasts and all_gathers above the direct-read threshold, checked against the data,
    then one ``mismatch_kind`` whose size is ``last_count`` on the last rank: a MismatchError
    on every rank with the buffers untouched (below the threshold, the last rank goes through
    the slots while the others read directly: still a mismatch everywhere, nothing hangs)."""

    async def run(ctx: Ctx) -> dict[str, Any]:
        r, n = ctx.rank, ctx.n
        failures: list[str] = []
        await ctx.run("barrier")
        await ctx.run("barrier")  # (the group's first steps: every rank's direct-read verdict is in)
        count = 300_007  # bfloat16: 600 KB, above _DIRECT_CHUNKS (8) of the 64 KiB chunks
        for root in range(n):
            x = data(r, count, "float64", "sum", 21) if r == root else np.zeros(count, np.float64)
            await ctx.run("broadcast", x, root)
            if not np.array_equal(x, data(root, count, "float64", "sum", 21)):
                failures.append(f"broadcast root {root}")
        for dtype in ("float32", "bfloat16", "complex128"):
            x = data(r, count, dtype, "sum", 22)
            outs = [np.full(count, 99, storage(dtype)) for _ in range(n)]
            await ctx.run("all_gather", outs, x)
            if not all(np.array_equal(outs[k], data(k, count, dtype, "sum", 22)) for k in range(n)):
                failures.append(f"all_gather {dtype}")
        mine = last_count if r == n - 1 else count
        x = np.full(mine, 7.0)
        outs = [np.full(mine, 5.0) for _ in range(n)]
        args = (x, 0) if mismatch_kind == "broadcast" else (outs, x)
        try:
            await ctx.run(mismatch_kind, *args, meta={"kind": mismatch_kind, "count": mine})
            failures.append(f"mismatched {mismatch_kind} did not raise")
        except Exception as exc:
            if type(exc).__name__ != "MismatchError":
                failures.append(f"mismatched {mismatch_kind} raised {exc!r}")
        if not (np.all(x == 7.0) and all(np.all(o == 5.0) for o in outs)):
            failures.append(f"mismatched {mismatch_kind} changed the data")
        return {"failures": failures, "direct_steps": ctx.group.direct_steps}

    return run


async def split_broadcast(ctx: Ctx) -> dict[str, Any]:
    """Broadcasts of two ranks large enough that the reader splits its read between two threads
    (client.data._vm_read.SPLIT_MIN; the payload ends mid-page), from either root, checked
    against the data, then an all_gather of the same size per rank."""
    import os
    import threading

    from aiocoll.client.data._vm_read import SPLIT_MIN

    r = ctx.rank
    failures: list[str] = []
    await ctx.run("barrier")
    await ctx.run("barrier")  # (the group's first steps: every rank's direct-read verdict is in)
    count = SPLIT_MIN + 4093
    split: list[bool] = []
    for root in (0, 1, 0):
        x = data(r, count, "uint8", "sum", 31) if r == root else np.zeros(count, np.uint8)
        await ctx.run("broadcast", x, root)
        if not np.array_equal(x, data(root, count, "uint8", "sum", 31)):
            failures.append(f"broadcast root {root}")
        if r != root:
            split.append("aiocoll-vm-read" in [t.name for t in threading.enumerate()])
    x = data(r, count, "uint8", "sum", 32)
    outs = [np.zeros(count, np.uint8) for _ in range(2)]
    await ctx.run("all_gather", outs, x)
    if not all(np.array_equal(outs[k], data(k, count, "uint8", "sum", 32)) for k in range(2)):
        failures.append("all_gather")
    cores = len(os.sched_getaffinity(0))
    return {"failures": failures, "direct_steps": ctx.group.direct_steps, "split": split, "cores": cores}


def test_a_large_broadcast_of_two_ranks_splits_its_read() -> None:
    """One rank reads while the root waits: the read is split between two threads where the
    reader may run on two cores, and every byte lands where it belongs."""
    from aiocoll.client.data._vm_read import vm_read_available

    per_rank = values(shm_world(split_broadcast, 2))
    assert [v["failures"] for v in per_rank] == [[]] * 2
    if vm_read_available():
        assert [v["direct_steps"] for v in per_rank] == [4, 4]
        for v in per_rank:
            assert v["split"] == [v["cores"] >= 2] * len(v["split"]), v


async def gather_sizes(ctx: Ctx) -> dict[str, Any]:
    """all_gathers of 2 ranks just below and at 2 chunks per rank (64 KiB chunks), and above,
    checked against the data, each with the count of direct steps it added."""
    r = ctx.rank
    await ctx.run("barrier")
    await ctx.run("barrier")  # (the group's first steps: every rank's direct-read verdict is in)
    failures: list[str] = []
    added: list[int] = []
    for nbytes in (128 * 1024 - 8, 128 * 1024, 192 * 1024):
        count = nbytes // 8
        x = data(r, count, "float64", "sum", 41)
        outs = [np.full(count, 99.0) for _ in range(2)]
        before = ctx.group.direct_steps
        await ctx.run("all_gather", outs, x)
        added.append(ctx.group.direct_steps - before)
        if not all(np.array_equal(outs[k], data(k, count, "float64", "sum", 41)) for k in range(2)):
            failures.append(f"all_gather of {nbytes} B")
    return {"failures": failures, "added": added}


def test_an_all_gather_of_two_ranks_with_a_core_each_reads_directly_from_two_chunks() -> None:
    """Where each of the 2 ranks has a core of its own, an all_gather reads its peer's part
    straight from its buffer from 2 chunks per rank (below that through the slots); where
    they share one, only from 8 chunks. Every byte lands where it belongs either way."""
    from aiocoll.client.data._vm_read import vm_read_available
    from aiocoll.client.data._waiting import oversubscribed

    per_rank = values(shm_world(gather_sizes, 2))
    assert [v["failures"] for v in per_rank] == [[]] * 2
    direct = vm_read_available() and not oversubscribed(2)
    assert [v["added"] for v in per_rank] == [[0, 1, 1] if direct else [0, 0, 0]] * 2


@pytest.mark.parametrize(
    ("direct", "mismatch_kind", "last_count"),
    [("1", "all_gather", 300_008), ("1", "broadcast", 1_000), ("0", "broadcast", 300_008)],
)
def test_large_broadcast_and_all_gather_read_peers_directly_or_through_the_slots(
    direct: str, mismatch_kind: str, last_count: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With AIOCOLL_SHM_DIRECT=1 (the default) large copies read the peers' buffers directly
    where this kernel allows it (process_vm_readv); with 0 they go through the slots. Same
    results and the same mismatch behaviour either way."""
    from aiocoll.client.data._vm_read import vm_read_available

    monkeypatch.setenv("AIOCOLL_SHM_DIRECT", direct)
    per_rank = values(shm_world(large_copies(mismatch_kind, last_count), 3))
    assert [v["failures"] for v in per_rank] == [[]] * 3
    steps = [v["direct_steps"] for v in per_rank]
    if direct == "1" and vm_read_available():
        # every broadcast and all_gather above the threshold, and the mismatched one where
        # the rank's own size was above it
        mismatched = [int(last_count >= 300_007 or r < 2) for r in range(3)]
        assert steps == [3 + 3 + m for m in mismatched]
    else:
        assert steps == [0] * 3
