"""Buffers and reductions as the step driver reaches them (aiocoll/_buffers.py): every allocation,
copy and reduction goes through the Buffers of the operation, temporaries stay bounded for every
dtype, and large reductions run in blocks, one per turn of the event loop. Over the in-memory
transport; results are compared with numpy."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections import Counter
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.transports.memory import MemoryWorld

from aiocoll._buffers import SCRATCH_KEEP_BYTES, NumpyBuffers
from aiocoll._reduce import BF16_BLOCK, bf16_to_f32, f32_to_bf16, finish_avg, reduce_into
from aiocoll._types import ReduceOp
from aiocoll.algorithms import ALGORITHMS, CollectiveSpec, run_collective
from aiocoll.algorithms import _driver as D
from aiocoll.algorithms._plan import prepare

pytestmark = pytest.mark.timeout(120)

LIMIT = 60.0
MIB = 1 << 20


def bf16(values: np.ndarray) -> np.ndarray:
    out = np.empty(values.size, np.uint16)
    f32_to_bf16(values.astype(np.float32), out)
    return out


async def all_reduce(
    xs: list[np.ndarray],
    *,
    op: ReduceOp = ReduceOp.SUM,
    dtype: str | None = None,
    algorithm: str | None = None,
    buffers: Any = None,
    seq: int = 0,
) -> None:
    n = len(xs)
    world = MemoryWorld(n)
    extra = {} if buffers is None else {"buffers": buffers}
    specs = [
        CollectiveSpec(
            "all_reduce",
            tuple(range(n)),
            r,
            (xs[r],),
            (xs[r],),
            op=op,
            algorithm=algorithm,
            dtype=dtype,
            **extra,
        )
        for r in range(n)
    ]
    meta = {"kind": "all_reduce", "dtype": dtype}
    await asyncio.wait_for(
        asyncio.gather(*(run_collective(s, world[s.me], ("c", "g", seq), meta) for s in specs)), LIMIT
    )


# ---------------------------------------------------------------------------- bounded memory


def test_bfloat16_reduction_and_average_widen_a_bounded_block_at_a_time() -> None:
    count = 4 * MIB  # 8 MiB of bfloat16; widening it whole took several 16 MiB temporaries
    rng = np.random.default_rng(0)
    a = bf16(rng.standard_normal(count))
    b = bf16(rng.standard_normal(count))
    want = a.copy()
    wide = bf16_to_f32(want) + bf16_to_f32(b)
    f32_to_bf16(wide, want)
    tracemalloc.start()
    try:
        reduce_into(ReduceOp.SUM, a, b, "bfloat16")
        _, reduce_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        finish_avg(a, 4, "bfloat16")
        _, avg_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    bound = 8 * BF16_BLOCK * 4  # a few float32/uint32 temporaries of one block
    assert reduce_peak < bound and avg_peak < bound, (reduce_peak, avg_peak, bound)
    wide = bf16_to_f32(want) / np.float32(4)
    f32_to_bf16(wide, want)
    np.testing.assert_array_equal(a, want)


@pytest.mark.parametrize("algorithm", ["rhd", "ring"])
async def test_every_dtypes_extra_memory_in_an_all_reduce_stays_about_float32s(algorithm: str) -> None:
    """The extra memory of an all_reduce (scratch, messages in flight) depends on the bytes, not
    the dtype: bfloat16 used to take about 9x float32's."""
    nbytes = 8 * MIB
    cases: list[tuple[str, Any, str | None, ReduceOp]] = [
        ("float32", np.float32, None, ReduceOp.SUM),
        ("bfloat16", np.uint16, "bfloat16", ReduceOp.SUM),
        ("bfloat16 avg", np.uint16, "bfloat16", ReduceOp.AVG),
        ("float16", np.float16, None, ReduceOp.SUM),
        ("float64 avg", np.float64, None, ReduceOp.AVG),
        ("complex64", np.complex64, None, ReduceOp.PRODUCT),
        ("bool", np.bool_, None, ReduceOp.SUM),
        ("int8", np.int8, None, ReduceOp.MAX),
    ]
    peaks: dict[str, int] = {}
    for seq, (name, dtype, hint, op) in enumerate(cases):
        count = nbytes // np.dtype(dtype).itemsize
        xs = [np.ones(count, dtype) for _ in range(2)]
        if hint == "bfloat16":
            xs = [bf16(np.full(count, r + 1.0)) for r in range(2)]
        tracemalloc.start()
        try:
            await all_reduce(xs, op=op, dtype=hint, algorithm=algorithm, seq=seq)
            _, peaks[name] = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        if hint == "bfloat16":
            want = 3.0 if op is ReduceOp.SUM else 1.5
            np.testing.assert_array_equal(bf16_to_f32(xs[0][:3]), [want] * 3)
    base = peaks["float32"]
    for name, peak in peaks.items():
        assert peak <= base * 1.1 + 2 * MIB, f"{name}: {peak / MIB:.1f} MiB vs float32's {base / MIB:.1f} MiB"


# ------------------------------------------------------------------ the interface is the route


class RecordingBuffers(NumpyBuffers):
    """Host buffers that count what the planner and driver ask of them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def scratch(self, like: np.ndarray, count: int) -> np.ndarray:
        self.calls["scratch"] += 1
        return super().scratch(like, count)

    def payload(self, view: np.ndarray) -> memoryview:
        self.calls["payload"] += 1
        return super().payload(view)

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.calls["copy"] += 1
        super().copy(dst, src)

    def reduce_into(
        self, op: ReduceOp, dst: np.ndarray, src: np.ndarray, dtype_name: str, *, src_first: bool
    ) -> None:
        self.calls["reduce_into"] += 1
        super().reduce_into(op, dst, src, dtype_name, src_first=src_first)

    def finish_avg(self, result: np.ndarray, group_size: int, dtype_name: str) -> None:
        self.calls["finish_avg"] += 1
        super().finish_avg(result, group_size, dtype_name)


@pytest.mark.parametrize("algorithm", ALGORITHMS["all_reduce"])
async def test_the_buffers_given_in_the_spec_carry_every_scratch_payload_and_reduction(
    algorithm: str,
) -> None:
    n = 3
    rec = RecordingBuffers()
    xs = [np.arange(5000, dtype=np.float64) * (r + 1) for r in range(n)]
    want = np.sum(xs, axis=0) / n
    await all_reduce(xs, op=ReduceOp.AVG, algorithm=algorithm, buffers=rec)
    for x in xs:
        np.testing.assert_allclose(x, want)
    assert rec.calls["scratch"] >= 1 and rec.calls["reduce_into"] >= 1 and rec.calls["payload"] >= 2
    assert rec.calls["finish_avg"] == n  # once per rank (they share this recorder)

    # Out of place, with the input copied to the output, and a ring reduce_scatter's working copy.
    rec2 = RecordingBuffers()
    world = MemoryWorld(n)
    ins = [[np.full(7, r + 10 * i, np.int64) for i in range(n)] for r in range(n)]
    outs = [np.zeros(7, np.int64) for _ in range(n)]
    specs = [
        CollectiveSpec(
            "reduce_scatter", tuple(range(n)), r, tuple(ins[r]), (outs[r],), algorithm="ring", buffers=rec2
        )
        for r in range(n)
    ]
    await asyncio.wait_for(
        asyncio.gather(
            *(run_collective(s, world[s.me], ("c", "g", 1), {"kind": "reduce_scatter"}) for s in specs)
        ),
        LIMIT,
    )
    for r in range(n):
        np.testing.assert_array_equal(outs[r], np.sum([ins[k][r] for k in range(n)], axis=0))
    assert rec2.calls["copy"] >= n * n and rec2.calls["scratch"] >= n


# ------------------------------------------------------------------ reductions in blocks


class Ticker:
    """Counts turns of the event loop."""

    def __init__(self) -> None:
        self.turns = 0
        self._handle = asyncio.get_running_loop().call_soon(self.tick)

    def tick(self) -> None:
        self.turns += 1
        self._handle = asyncio.get_running_loop().call_soon(self.tick)

    def stop(self) -> None:
        self._handle.cancel()


class TurnTakingBuffers(NumpyBuffers):
    """Records the event-loop turn and size of every reduction of one rank."""

    def __init__(self, ticker: Ticker) -> None:
        super().__init__()
        self.ticker = ticker
        self.reductions: list[tuple[int, int]] = []  # (turn, bytes)

    def reduce_into(
        self, op: ReduceOp, dst: np.ndarray, src: np.ndarray, dtype_name: str, *, src_first: bool
    ) -> None:
        self.reductions.append((self.ticker.turns, int(dst.nbytes)))
        super().reduce_into(op, dst, src, dtype_name, src_first=src_first)


@pytest.mark.parametrize(
    "dtype, op",
    [
        (np.float64, ReduceOp.SUM),
        (np.complex128, ReduceOp.PRODUCT),
        ("bfloat16", ReduceOp.AVG),
        (np.int32, ReduceOp.MAX),
    ],
)
async def test_large_reductions_run_in_blocks_one_per_loop_turn_with_the_same_result(
    dtype: Any, op: ReduceOp, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, count, block = 4, 6000, 1024
    rng = np.random.default_rng(1)
    hint = "bfloat16" if dtype == "bfloat16" else None
    inputs = [
        rng.standard_normal(count) + (1j * rng.standard_normal(count) if op is ReduceOp.PRODUCT else 0)
        for _ in range(n)
    ]
    inputs = [bf16(x) if hint else (x * 100).astype(dtype) for x in inputs]
    for seq, algorithm in enumerate(ALGORITHMS["all_reduce"]):
        whole = [x.copy() for x in inputs]
        await all_reduce(whole, op=op, dtype=hint, algorithm=algorithm, seq=seq)

        monkeypatch.setattr(D, "REDUCE_BLOCK_BYTES", block)
        ticker = Ticker()
        recs = [TurnTakingBuffers(ticker) for _ in range(n)]
        blocked = [x.copy() for x in inputs]
        world = MemoryWorld(n)
        specs = [
            CollectiveSpec(
                "all_reduce",
                tuple(range(n)),
                r,
                (blocked[r],),
                (blocked[r],),
                op=op,
                algorithm=algorithm,
                dtype=hint,
                buffers=recs[r],
            )
            for r in range(n)
        ]
        meta = {"kind": "all_reduce", "dtype": hint}
        try:
            await asyncio.wait_for(
                asyncio.gather(*(run_collective(s, world[s.me], ("c", "b", seq), meta) for s in specs)), LIMIT
            )
        finally:
            ticker.stop()
            monkeypatch.undo()
        for a, b in zip(whole, blocked, strict=True):
            np.testing.assert_array_equal(a, b)  # the same values combined in the same order
        lanes = len(prepare(specs[0], meta).sched.lanes)
        for rec in recs:  # (a leaf of the tree reduces nothing)
            assert max((size for _, size in rec.reductions), default=0) <= block
            per_turn = Counter[int]()
            for turn, size in rec.reductions:
                per_turn[turn] += size
            # However much a step reduces, a lane reduces at most one block per turn of the loop,
            # plus, when a handed-off step finishes, the first block of the next step if its
            # payload is already here (the next step starts at once rather than a turn later).
            assert max(per_turn.values(), default=0) <= 2 * lanes * block, (algorithm, lanes, per_turn)
        assert any(sum(size for _, size in rec.reductions) > 4 * lanes * block for rec in recs)


# ------------------------------------------------------------------ scratch kept between operations


class KeepingBuffers(NumpyBuffers):
    """Host buffers that remember which scratch arrays they handed out."""

    def __init__(self) -> None:
        super().__init__()
        self.handed: list[np.ndarray] = []

    def scratch(self, like: np.ndarray, count: int) -> np.ndarray:
        array = super().scratch(like, count)
        self.handed.append(array)
        return array


async def test_a_large_operations_scratch_serves_the_next_one_and_the_kept_total_is_bounded() -> None:
    n, count = 2, 256 * 1024  # 1 MiB of float32: the reduced half lands in 512 KiB of scratch
    keeping = [KeepingBuffers() for _ in range(n)]
    world = MemoryWorld(n)
    for seq in range(3):
        xs = [np.full(count, r + seq, np.float32) for r in range(n)]
        specs = [
            CollectiveSpec("all_reduce", (0, 1), r, (xs[r],), (xs[r],), buffers=keeping[r]) for r in range(n)
        ]
        await asyncio.wait_for(
            asyncio.gather(
                *(run_collective(s, world[s.me], ("c", "k", seq), {"kind": "all_reduce"}) for s in specs)
            ),
            LIMIT,
        )
        for x in xs:
            np.testing.assert_array_equal(x, np.full(count, 1 + 2 * seq, np.float32))
    for rank in keeping:
        assert len(rank.handed) == 3 and all(a is rank.handed[0] for a in rank.handed)

    bounded = NumpyBuffers()
    like = np.empty(0, np.uint8)
    kept = [bounded.scratch(like, 16 * MIB) for _ in range(5)]
    for array in kept:
        bounded.release(array)
    assert bounded._kept_bytes == SCRATCH_KEEP_BYTES  # the oldest was dropped
    assert bounded.scratch(like, 16 * MIB) is kept[-1]
    bounded.release(np.empty(SCRATCH_KEEP_BYTES + 1, np.uint8))  # too large to keep at all
    assert bounded._kept_bytes == SCRATCH_KEEP_BYTES - 16 * MIB


async def test_a_failed_operation_keeps_no_scratch_a_late_message_could_still_land_in() -> None:
    keeping = KeepingBuffers()
    world = MemoryWorld(2)
    x = np.ones(256 * 1024, np.float32)
    spec = CollectiveSpec("all_reduce", (0, 1), 0, (x,), (x,), buffers=keeping)
    with pytest.raises(asyncio.TimeoutError):  # rank 1 never joins
        await asyncio.wait_for(run_collective(spec, world[0], ("c", "f", 0), {"kind": "all_reduce"}), 0.2)
    assert keeping.handed and keeping._kept_bytes == 0
