"""Property tests: random collectives against a numpy reference on the in-memory transport.

Random kind, world size, dtype, reduce op, root, size, algorithm (or the default choice) and
chunk size; every rank's result must equal what numpy computes from all ranks' inputs.
Example counts stay moderate so the file runs in seconds.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.transports.memory import MemoryWorld
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiocoll._reduce import check_reduce_op
from aiocoll._types import ReduceOp
from aiocoll.algorithms import ALGORITHMS, CollectiveSpec, run_collective
from aiocoll.algorithms import _schedule as S

DTYPES = ["bool", "int8", "uint8", "int32", "int64", "uint64", "float16", "float32", "float64", "complex64"]
KINDS = [
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
]
UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
    ReduceOp.AVG: np.add,
}


def valid(op: ReduceOp, dtype: str) -> bool:
    try:
        check_reduce_op(op, dtype)
    except TypeError:
        return False
    return True


def make(rng: np.random.Generator, dtype: str, count: int) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=count).astype(bool)
    if dt.kind in "iu":
        return rng.integers(0, 5, size=count).astype(
            dt
        )  # small: products of up to 8 ranks stay exact in floats too
    values = rng.integers(-4, 5, size=count).astype(np.float64)  # small integers: sums are exact in float16
    if dt.kind == "c":
        values = values + 1j * rng.integers(-4, 5, size=count)
    return values.astype(dt)


def combine(op: ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    result = functools.reduce(lambda a, b: UFUNC[op](a, b), [x.copy() for x in xs])
    if op is ReduceOp.AVG:
        result = (result / len(xs)).astype(xs[0].dtype)
    return result


def close(got: np.ndarray, want: np.ndarray) -> None:
    if got.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    else:
        np.testing.assert_array_equal(got, want)


@st.composite
def cases(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(KINDS))
    n = draw(st.integers(1, 6))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from([op for op in ReduceOp if valid(op, dtype)]))
    if op is ReduceOp.PRODUCT and np.dtype(dtype).kind in "fc":
        op = ReduceOp.SUM  # float products of random values are not exact; SUM of small ints is
    return {
        "kind": kind,
        "n": n,
        "dtype": dtype,
        "op": op,
        "root": draw(st.integers(0, n - 1)),
        "count": draw(st.integers(0, 40)),
        "algorithm": draw(st.sampled_from([None, *ALGORITHMS[kind]])),
        "chunk": draw(st.sampled_from([8, 64, S.CHUNK_BYTES])),
        "seed": draw(st.integers(0, 2**31)),
    }


async def run_case(c: dict[str, Any]) -> None:
    kind, n, dtype, op, root, count = c["kind"], c["n"], c["dtype"], c["op"], c["root"], c["count"]
    rng = np.random.default_rng(c["seed"])
    world = MemoryWorld(n)
    group = tuple(range(n))
    specs: list[CollectiveSpec] = []
    checks: list[Any] = []
    if kind in ("all_reduce", "reduce", "broadcast"):
        xs = [make(rng, dtype, count) for _ in range(n)]
        before = [x.copy() for x in xs]
        for r in range(n):
            send = () if kind == "broadcast" else (xs[r],)
            specs.append(
                CollectiveSpec(kind, group, r, send, (xs[r],), root=root, op=op, algorithm=c["algorithm"])
            )
        if kind == "all_reduce":
            want = combine(op, before)
            checks = [(xs[r], want) for r in range(n)]
        elif kind == "reduce":
            checks = [(xs[r], combine(op, before) if r == root else before[r]) for r in range(n)]
        else:
            checks = [(xs[r], before[root]) for r in range(n)]
    elif kind in ("all_gather", "gather"):
        xs = [make(rng, dtype, count) for _ in range(n)]
        outs = [[np.zeros(count, dtype=dtype) for _ in range(n)] for _ in range(n)]
        for r in range(n):
            recv = tuple(outs[r]) if kind == "all_gather" or r == root else ()
            specs.append(CollectiveSpec(kind, group, r, (xs[r],), recv, root=root, algorithm=c["algorithm"]))
        holders = range(n) if kind == "all_gather" else [root]
        checks = [(outs[r][j], xs[j]) for r in holders for j in range(n)]
    elif kind == "scatter":
        ins = [make(rng, dtype, count) for _ in range(n)]
        xs = [np.zeros(count, dtype=dtype) for _ in range(n)]
        for r in range(n):
            specs.append(CollectiveSpec(kind, group, r, tuple(ins) if r == root else (), (xs[r],), root=root))
        checks = [(xs[j], ins[j]) for j in range(n)]
    elif kind == "reduce_scatter":
        blocks = [[make(rng, dtype, count) for _ in range(n)] for _ in range(n)]
        xs = [np.zeros(count, dtype=dtype) for _ in range(n)]
        for r in range(n):
            specs.append(
                CollectiveSpec(kind, group, r, tuple(blocks[r]), (xs[r],), op=op, algorithm=c["algorithm"])
            )
        checks = [(xs[j], combine(op, [blocks[r][j] for r in range(n)])) for j in range(n)]
    else:  # all_to_all with split sizes derived from the seed
        sizes = rng.integers(0, count + 1, size=(n, n))
        sends = [[make(rng, dtype, int(sizes[r, j])) for j in range(n)] for r in range(n)]
        recvs = [[np.zeros(int(sizes[j, r]), dtype=dtype) for j in range(n)] for r in range(n)]
        for r in range(n):
            specs.append(CollectiveSpec(kind, group, r, tuple(sends[r]), tuple(recvs[r])))
        checks = [(recvs[r][j], sends[j][r]) for r in range(n) for j in range(n)]
    signature = {"kind": kind, "root": root, "dtype": dtype, "count": count, "op": op.value}
    await asyncio.wait_for(
        asyncio.gather(*(run_collective(specs[r], world[r], ("c", "prop", 0), signature) for r in range(n))),
        20,
    )
    for got, want in checks:
        close(got, want)


@pytest.mark.timeout(120)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_random_collectives_match_the_numpy_reference(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(S, "CHUNK_BYTES", case["chunk"])
    asyncio.run(run_case(case))
