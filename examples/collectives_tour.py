"""A tour of every collective, with each reduce op, on the async API; every result is checked.

Run:  aiocoll run --nproc-per-node 4 examples/collectives_tour.py
"""

from __future__ import annotations

import functools
import operator

import numpy as np

import aiocoll
from aiocoll import ReduceOp


async def tour(pg: aiocoll.ProcessGroup) -> None:
    n, me = pg.size, pg.rank
    values = [np.array([r + 1, 2 * r + 1, 3], dtype=np.int64) for r in range(n)]

    expected = {
        ReduceOp.SUM: sum(values),
        ReduceOp.PRODUCT: functools.reduce(operator.mul, values),
        ReduceOp.MIN: functools.reduce(np.minimum, values),
        ReduceOp.MAX: functools.reduce(np.maximum, values),
        ReduceOp.BAND: functools.reduce(np.bitwise_and, values),
        ReduceOp.BOR: functools.reduce(np.bitwise_or, values),
        ReduceOp.BXOR: functools.reduce(np.bitwise_xor, values),
    }
    for op, want in expected.items():
        mine = values[me].copy()
        await pg.all_reduce(mine, op=op)
        assert np.array_equal(mine, want), (op, mine, want)
    floats = np.full(3, float(me))
    await pg.all_reduce(floats, op=ReduceOp.AVG)  # AVG: floating point only
    assert np.allclose(floats, (n - 1) / 2)

    # reduce to a root: only the root's buffer holds the result.
    mine = values[me].copy()
    await pg.reduce(mine, dst=n - 1, op=ReduceOp.SUM)
    assert me != n - 1 or np.array_equal(mine, expected[ReduceOp.SUM])

    # broadcast, scatter, gather, all_gather, all_gather_into_tensor.
    b = np.full(2, me, dtype=np.float32)
    await pg.broadcast(b, src=1 % n)
    assert np.all(b == 1 % n)
    chunk = np.empty(2, dtype=np.int32)
    pieces = [np.full(2, 100 + r, dtype=np.int32) for r in range(n)] if me == 0 else None
    await pg.scatter(chunk, pieces, src=0)
    assert np.all(chunk == 100 + me)
    gathered = [np.empty(2, dtype=np.int32) for _ in range(n)] if me == 0 else None
    await pg.gather(chunk, gathered, dst=0)
    assert me != 0 or [g[0] for g in gathered] == [100 + r for r in range(n)]
    flat = np.empty(2 * n, dtype=np.int32)
    await pg.all_gather_into_tensor(flat, chunk)
    assert flat.tolist() == [100 + r for r in range(n) for _ in range(2)]

    # reduce_scatter: rank r ends with the sum over ranks of their r-th input.
    inputs = [np.full(3, me * 10 + r, dtype=np.float64) for r in range(n)]
    out = np.empty(3)
    await pg.reduce_scatter(out, inputs)
    assert np.all(out == sum(rank * 10 + me for rank in range(n)))
    big = np.concatenate(inputs)
    await pg.reduce_scatter_tensor(out, big)
    assert np.all(out == sum(rank * 10 + me for rank in range(n)))

    # all_to_all: rank r's i-th input goes to rank i's r-th output.
    sends = [np.array([me * 100 + i]) for i in range(n)]
    receives = [np.empty(1, dtype=np.int64) for _ in range(n)]
    await pg.all_to_all(receives, sends)
    assert [int(x[0]) for x in receives] == [r * 100 + me for r in range(n)]
    # all_to_all_single with uneven splits: rank r sends i+1 elements to rank i.
    in_splits = [i + 1 for i in range(n)]
    out_splits = [me + 1] * n
    source = np.full(sum(in_splits), me, dtype=np.int16)
    target = np.empty(sum(out_splits), dtype=np.int16)
    await pg.all_to_all_single(target, source, out_splits, in_splits)
    assert target.tolist() == [r for r in range(n) for _ in range(me + 1)]

    await pg.barrier()
    if me == 0:
        print(f"collectives tour: {n} ranks, every collective and every reduce op checked")


async def main() -> None:
    async with await aiocoll.init_process_group(timeout=60) as pg:
        await tour(pg)


if __name__ == "__main__":
    aiocoll.run(main())  # asyncio.run on uvloop when installed
