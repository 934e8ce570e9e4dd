"""The step driver's fast paths give the same results as the plain path.

Receives posted one step early (forced here for every message size, with small chunks so lanes
have many steps), sends started inline, and the per-signature plan cache of in-place all_reduce
(repeated calls that differ only in dtype, op or size must not reuse each other's plan). Runs
over the in-memory transport; results are compared with a numpy reference.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.transports.memory import MemoryWorld

from aiocoll._types import ReduceOp
from aiocoll.algorithms import ALGORITHMS, CollectiveSpec, run_collective
from aiocoll.algorithms import _driver as D
from aiocoll.algorithms import _plan as P
from aiocoll.algorithms import _schedule as S

LIMIT = 20.0  # a hang, not a slow machine, gets near this


@pytest.fixture
def early_receives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every receive of a multi-step lane is posted a step early; 256-byte chunks."""
    monkeypatch.setattr(D, "PREPOST_BYTES", 1)
    monkeypatch.setattr(S, "CHUNK_BYTES", 256)


async def _run(specs: list[CollectiveSpec], seq: int = 0, meta: dict[str, Any] | None = None) -> None:
    world = MemoryWorld(len(specs))
    coros = [
        run_collective(s, world[s.ranks[s.me]], ("c", "g", seq), meta or {"kind": s.kind}) for s in specs
    ]
    await asyncio.wait_for(asyncio.gather(*coros), LIMIT)


def _inputs(n: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size=count).astype(np.int64) for _ in range(n)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS["all_reduce"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
async def test_all_reduce_with_early_receives_matches_numpy(
    algorithm: str, n: int, early_receives: None
) -> None:
    for count in (1, 97, 3000):
        xs = _inputs(n, count, seed=count + n)
        expected = np.sum(xs, axis=0)
        await _run(
            [
                CollectiveSpec("all_reduce", tuple(range(n)), r, (xs[r],), (xs[r],), algorithm=algorithm)
                for r in range(n)
            ]
        )
        for x in xs:
            np.testing.assert_array_equal(x, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4, 6])
async def test_rooted_and_gathering_kinds_with_early_receives_match_numpy(
    n: int, early_receives: None
) -> None:
    count = 700
    ranks = tuple(range(n))
    for algorithm in ALGORITHMS["broadcast"]:
        for root in (0, n - 1):
            xs = _inputs(n, count, seed=root)
            want = xs[root].copy()
            await _run(
                [
                    CollectiveSpec("broadcast", ranks, r, (), (xs[r],), root=root, algorithm=algorithm)
                    for r in range(n)
                ]
            )
            for x in xs:
                np.testing.assert_array_equal(x, want)
    for algorithm in ALGORITHMS["reduce"]:
        xs = _inputs(n, count, seed=5)
        want = np.sum(xs, axis=0)
        root = n // 2
        await _run(
            [
                CollectiveSpec("reduce", ranks, r, (xs[r],), (xs[r],), root=root, algorithm=algorithm)
                for r in range(n)
            ]
        )
        np.testing.assert_array_equal(xs[root], want)
    for algorithm in ALGORITHMS["all_gather"]:
        xs = _inputs(n, count, seed=6)
        outs = [[np.empty(count, np.int64) for _ in range(n)] for _ in range(n)]
        await _run(
            [
                CollectiveSpec("all_gather", ranks, r, (xs[r],), tuple(outs[r]), algorithm=algorithm)
                for r in range(n)
            ]
        )
        for r in range(n):
            for i in range(n):
                np.testing.assert_array_equal(outs[r][i], xs[i])
    for algorithm in ALGORITHMS["reduce_scatter"]:
        ins = [_inputs(n, count, seed=10 + r) for r in range(n)]
        res = [np.empty(count, np.int64) for _ in range(n)]
        await _run(
            [
                CollectiveSpec("reduce_scatter", ranks, r, tuple(ins[r]), (res[r],), algorithm=algorithm)
                for r in range(n)
            ]
        )
        for r in range(n):
            np.testing.assert_array_equal(res[r], np.sum([ins[k][r] for k in range(n)], axis=0))


@pytest.mark.timeout(60)
async def test_repeated_all_reduce_does_not_reuse_a_plan_across_dtype_op_or_size() -> None:
    n = 3
    ranks = tuple(range(n))
    cases: list[tuple[Any, ReduceOp, int]] = [
        (np.int64, ReduceOp.SUM, 5),
        (np.int64, ReduceOp.MAX, 5),
        (np.float64, ReduceOp.AVG, 5),
        (np.int32, ReduceOp.SUM, 5),
        (np.int64, ReduceOp.SUM, 9),
        (np.int64, ReduceOp.PRODUCT, 5),
        (np.int64, ReduceOp.SUM, 5),
    ]
    for seq, (dtype, op, count) in enumerate(cases * 2):
        xs = [np.arange(count, dtype=dtype) + 3 * r + 1 for r in range(n)]
        stack = np.stack(xs)
        want = {
            ReduceOp.SUM: stack.sum(axis=0),
            ReduceOp.MAX: stack.max(axis=0),
            ReduceOp.PRODUCT: stack.prod(axis=0),
            ReduceOp.AVG: stack.sum(axis=0) / n,
        }[op].astype(dtype)
        await _run(
            [CollectiveSpec("all_reduce", ranks, r, (xs[r],), (xs[r],), op=op) for r in range(n)], seq=seq
        )
        for x in xs:
            assert x.dtype == dtype
            np.testing.assert_allclose(x, want)


@pytest.mark.timeout(60)
async def test_all_reduce_refuses_a_meaningless_op_even_after_a_cached_plan() -> None:
    n = 2
    ranks = tuple(range(n))
    xs = [np.ones(4, np.float32) for _ in range(n)]
    await _run([CollectiveSpec("all_reduce", ranks, r, (xs[r],), (xs[r],)) for r in range(n)])
    with pytest.raises(TypeError, match="BAND"):
        await run_collective(
            CollectiveSpec("all_reduce", ranks, 0, (xs[0],), (xs[0],), op=ReduceOp.BAND),
            MemoryWorld(n)[0],
            ("c", "g", 1),
            {"kind": "all_reduce"},
        )


def test_every_lane_runs_its_steps_in_increasing_id_order() -> None:
    """What posting a receive over a range just sent to the same peer relies on (_may_prepost):
    a message of step k is received in the receiver's step k, and a lane's steps run in id order."""
    for n in range(1, 9):
        for me in range(n):
            for kind, algorithms in ALGORITHMS.items():
                for algorithm in algorithms:
                    splits = ((3,) * n, (3,) * n) if kind == "all_to_all" else None
                    sched = P._cached_schedule(kind, algorithm, n, me, 0, 5000, 8, 4096, 1024, splits)
                    for lane in sched.lanes:
                        ids = [step.id for step in lane]
                        assert ids == sorted(set(ids)), (kind, algorithm, n, me, ids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 4])
async def test_halving_doubling_all_gather_receives_land_in_place_posted_over_a_sent_range(n: int) -> None:
    """The all-gather step's receive covers what the previous step sent to the same partner; it is
    posted a step early all the same, and the result is still exact when peers run ahead."""
    from aiocoll.client.data.transports.tcp import TcpTransport

    from aiocoll._deadline import Deadline

    ts = [TcpTransport(r, n, token="t", job="j") for r in range(n)]
    addrs = {r: [await t.listen("127.0.0.1")] for r, t in enumerate(ts)}
    await asyncio.gather(*(t.connect(addrs, Deadline(10)) for t in ts))
    try:
        count = 1 << 16  # 512 KiB of int64 per rank: halving-doubling, receives posted early
        for seq in range(6):
            xs = _inputs(n, count, seed=seq)
            want = np.sum(xs, axis=0)
            running = []
            for r in range(n):
                spec = CollectiveSpec("all_reduce", tuple(range(n)), r, (xs[r],), (xs[r],), algorithm="rhd")
                op = run_collective(spec, ts[r], ("c", "g", seq), {"kind": "all_reduce"})
                running.append(asyncio.ensure_future(op))
                await asyncio.sleep(0.02)  # lower ranks run ahead
            await asyncio.wait_for(asyncio.gather(*running), LIMIT)
            for x in xs:
                np.testing.assert_array_equal(x, want)
        steps = 2 * (n.bit_length() - 1)
        # Rank 0 starts first, so every one of its receives is posted before its message can
        # arrive: all of them land in place (with the all-gather receives posted only after the
        # step that sent their range, half of them were buffered and copied).
        assert (ts[0].received_direct, ts[0].received_buffered) == (6 * steps, 0)
    finally:
        await asyncio.gather(*(t.aclose() for t in ts))
