"""Every collective kind and algorithm, run by the executor over the in-memory transport.

World sizes 1..8 (powers of two and not), several roots and sizes, results compared with a numpy
reference; plus the executor's contract with the engine: tags, meta, mismatch detection, peer
loss, cancellation, group-to-global rank mapping and bounded inboxes.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.transports.memory import MemoryWorld

from aiocoll._errors import MismatchError, PeerLostError
from aiocoll._types import ReduceOp
from aiocoll.algorithms import ALGORITHMS, CollectiveSpec, Transport, choose_algorithm, run_collective
from aiocoll.algorithms import _schedule as S

TAG = ("c", "g", 0)
LIMIT = 20.0  # a hang, not a slow machine, gets near this
SIZES = range(1, 9)


def meta(kind: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "root": 0, "dtype": "int64", "count": 0, "op": "sum", **extra}


async def run_world(specs: list[CollectiveSpec], world: MemoryWorld | None = None, metas: Any = None) -> None:
    world = world or MemoryWorld(len(specs))
    coros = [
        run_collective(spec, world[spec.ranks[spec.me]], TAG, metas[i] if metas else meta(spec.kind))
        for i, spec in enumerate(specs)
    ]
    await asyncio.wait_for(asyncio.gather(*coros), LIMIT)


def inputs(n: int, count: int, seed: int = 0, dtype: Any = np.int64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size=count).astype(dtype) for _ in range(n)]


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 256 bytes, so a few thousand elements already run through several lanes."""
    monkeypatch.setattr(S, "CHUNK_BYTES", 256)


def ranks(n: int) -> tuple[int, ...]:
    return tuple(range(n))


# ------------------------------------------------------------------------------------ all kinds


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS["all_reduce"])
@pytest.mark.parametrize("n", SIZES)
async def test_all_reduce_sums_in_place_on_every_rank(algorithm: str, n: int, small_chunks: None) -> None:
    for count in (0, 1, 13, 1000):
        xs = inputs(n, count, seed=count)
        expected = np.sum(xs, axis=0)
        await run_world(
            [
                CollectiveSpec("all_reduce", ranks(n), r, (xs[r],), (xs[r],), algorithm=algorithm)
                for r in range(n)
            ]
        )
        for x in xs:
            np.testing.assert_array_equal(x, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_large_all_reduce_with_default_settings_is_exact_with_the_default_algorithm(n: int) -> None:
    count = 300_000  # 2.4 MB of int64: above the small-message threshold
    xs = inputs(n, count, seed=n)
    expected = np.sum(xs, axis=0)
    # Halving-doubling for 2 and 4 ranks, the ring otherwise (pipelining: the small_chunks tests).
    assert choose_algorithm("all_reduce", xs[0].nbytes, n) == ("rhd" if n in (2, 4) else "ring")
    await run_world([CollectiveSpec("all_reduce", ranks(n), r, (xs[r],), (xs[r],)) for r in range(n)])
    for x in xs:
        np.testing.assert_array_equal(x, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS["broadcast"])
@pytest.mark.parametrize("n", SIZES)
async def test_broadcast_copies_the_roots_tensor_to_every_rank(
    algorithm: str, n: int, small_chunks: None
) -> None:
    for root in sorted({0, n // 2, n - 1}):
        for count in (0, 1, 1000):
            xs = inputs(n, count, seed=root)
            expected = xs[root].copy()
            await run_world(
                [
                    CollectiveSpec("broadcast", ranks(n), r, (), (xs[r],), root=root, algorithm=algorithm)
                    for r in range(n)
                ]
            )
            for x in xs:
                np.testing.assert_array_equal(x, expected)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce"])
@pytest.mark.parametrize("n", SIZES)
async def test_reduce_leaves_the_result_at_the_root_and_other_ranks_unchanged(
    algorithm: str, n: int, small_chunks: None
) -> None:
    for root in sorted({0, n // 2, n - 1}):
        for count in (0, 1, 1000):
            xs = inputs(n, count, seed=root + count)
            before = [x.copy() for x in xs]
            await run_world(
                [
                    CollectiveSpec(
                        "reduce",
                        ranks(n),
                        r,
                        (xs[r],),
                        (xs[r],),
                        root=root,
                        op=ReduceOp.MAX,
                        algorithm=algorithm,
                    )
                    for r in range(n)
                ]
            )
            np.testing.assert_array_equal(xs[root], np.max(before, axis=0) if count else before[root])
            for r in range(n):
                if r != root:
                    np.testing.assert_array_equal(xs[r], before[r])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS["all_gather"])
@pytest.mark.parametrize("n", SIZES)
async def test_all_gather_fills_output_j_with_rank_js_input(
    algorithm: str, n: int, small_chunks: None
) -> None:
    for count in (0, 1, 700):
        xs = inputs(n, count, seed=count)
        outs = [[np.full(count, -7, dtype=np.int64) for _ in range(n)] for _ in range(n)]
        await run_world(
            [
                CollectiveSpec("all_gather", ranks(n), r, (xs[r],), tuple(outs[r]), algorithm=algorithm)
                for r in range(n)
            ]
        )
        for r in range(n):
            for j in range(n):
                np.testing.assert_array_equal(outs[r][j], xs[j])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
async def test_gather_collects_every_input_at_the_root_only(n: int) -> None:
    for root in sorted({0, n - 1}):
        xs = inputs(n, 9, seed=root)
        outs = [np.zeros(9, dtype=np.int64) for _ in range(n)]
        await run_world(
            [
                CollectiveSpec("gather", ranks(n), r, (xs[r],), tuple(outs) if r == root else (), root=root)
                for r in range(n)
            ]
        )
        for j in range(n):
            np.testing.assert_array_equal(outs[j], xs[j])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
async def test_scatter_sends_input_j_of_the_root_to_rank_j(n: int) -> None:
    for root in sorted({0, n - 1}):
        ins = inputs(n, 11, seed=root)
        xs = [np.zeros(11, dtype=np.int64) for _ in range(n)]
        await run_world(
            [
                CollectiveSpec("scatter", ranks(n), r, tuple(ins) if r == root else (), (xs[r],), root=root)
                for r in range(n)
            ]
        )
        for j in range(n):
            np.testing.assert_array_equal(xs[j], ins[j])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ALGORITHMS["reduce_scatter"])
@pytest.mark.parametrize("n", SIZES)
async def test_reduce_scatter_reduces_block_j_onto_rank_j(algorithm: str, n: int, small_chunks: None) -> None:
    for count in (0, 1, 500):
        ins = [inputs(n, count, seed=10 * r + count) for r in range(n)]
        before = [[a.copy() for a in row] for row in ins]
        xs = [np.zeros(count, dtype=np.int64) for _ in range(n)]
        await run_world(
            [
                CollectiveSpec("reduce_scatter", ranks(n), r, tuple(ins[r]), (xs[r],), algorithm=algorithm)
                for r in range(n)
            ]
        )
        for j in range(n):
            np.testing.assert_array_equal(xs[j], np.sum([ins[r][j] for r in range(n)], axis=0))
        for r in range(n):
            for j in range(n):
                np.testing.assert_array_equal(ins[r][j], before[r][j])  # inputs are not modified


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
async def test_all_to_all_exchanges_blocks_of_different_sizes(n: int) -> None:
    def size(src: int, dst: int) -> int:
        return (5 * src + 3 * dst) % 7

    sends = [[np.arange(size(r, j), dtype=np.int64) + 100 * r + 10 * j for j in range(n)] for r in range(n)]
    recvs = [[np.full(size(j, r), -1, dtype=np.int64) for j in range(n)] for r in range(n)]
    specs = [CollectiveSpec("all_to_all", ranks(n), r, tuple(sends[r]), tuple(recvs[r])) for r in range(n)]
    await run_world(specs)
    for r in range(n):
        for j in range(n):
            np.testing.assert_array_equal(recvs[r][j], sends[j][r])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
async def test_barrier_completes_only_after_every_rank_entered(n: int) -> None:
    world = MemoryWorld(n)
    specs = [CollectiveSpec("barrier", ranks(n), r, (), ()) for r in range(n)]
    early = [
        asyncio.ensure_future(run_collective(specs[r], world[r], TAG, meta("barrier"))) for r in range(n - 1)
    ]
    for _ in range(20):
        await asyncio.sleep(0)
    assert not any(t.done() for t in early), "a rank left the barrier before the last rank entered"
    await asyncio.wait_for(
        asyncio.gather(*early, run_collective(specs[-1], world[n - 1], TAG, meta("barrier"))), LIMIT
    )


# ------------------------------------------------------------------------------ dtypes and ops

NUMPY_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
UFUNC = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}


def valid(op: ReduceOp, dtype: str) -> bool:
    kind = np.dtype(dtype).kind if dtype != "bfloat16" else "f"
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return kind in "biu"
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        return kind != "c"
    if op is ReduceOp.AVG:
        return kind in "fc"
    return True


def sample(dtype: str, op: ReduceOp, count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=count).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        lo, hi = (0, 4) if op is ReduceOp.PRODUCT else (max(info.min, -100), min(info.max, 100))
        return rng.integers(lo, hi, size=count, endpoint=True).astype(dt)
    values = rng.uniform(0.5, 1.5, size=count) if op is ReduceOp.PRODUCT else rng.normal(size=count)
    if dt.kind == "c":
        values = values + 1j * (
            rng.uniform(0.5, 1.5, size=count) if op is ReduceOp.PRODUCT else rng.normal(size=count)
        )
    return values.astype(dt)


def reference(op: ReduceOp, xs: list[np.ndarray]) -> np.ndarray:
    result = functools.reduce(lambda a, b: UFUNC[op](a, b), [x.copy() for x in xs])
    if op is ReduceOp.AVG:
        result = (result / len(xs)).astype(xs[0].dtype)
    return result


def assert_reduced(got: np.ndarray, want: np.ndarray, op: ReduceOp) -> None:
    if got.dtype.kind in "fc" and op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG):
        rtol = {2: 2e-2, 4: 1e-5, 8: 1e-12, 16: 1e-12}[
            got.dtype.itemsize if got.dtype.kind == "f" else got.dtype.itemsize // 2
        ]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    else:
        np.testing.assert_array_equal(got, want)


# Pairs an op is defined for; the others are checked in test_invalid_op_dtype_pairs_raise_type_error.
VALID_PAIRS = [(dtype, op) for dtype in NUMPY_DTYPES for op in ReduceOp if valid(op, dtype)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("dtype", "op"), VALID_PAIRS)
async def test_all_reduce_every_op_and_dtype_matches_numpy_and_agrees_bitwise_across_ranks(
    dtype: str, op: ReduceOp, small_chunks: None
) -> None:
    n = 3
    for algorithm in ALGORITHMS["all_reduce"]:
        xs = [sample(dtype, op, 200, seed=r) for r in range(n)]
        want = reference(op, xs)
        await run_world(
            [
                CollectiveSpec("all_reduce", ranks(n), r, (xs[r],), (xs[r],), op=op, algorithm=algorithm)
                for r in range(n)
            ],
            metas=[meta("all_reduce", dtype=dtype)] * n,
        )
        assert_reduced(xs[0], want, op)
        for x in xs[1:]:
            assert x.tobytes() == xs[0].tobytes(), f"{algorithm}: ranks disagree on the result"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX])
async def test_reduce_and_reduce_scatter_apply_the_op_including_avg(op: ReduceOp) -> None:
    n, count = 5, 40
    xs = [sample("float64", op, count, seed=r) for r in range(n)]
    want = reference(op, xs)
    await run_world(
        [CollectiveSpec("reduce", ranks(n), r, (xs[r],), (xs[r],), root=2, op=op) for r in range(n)]
    )
    assert_reduced(xs[2], want, op)
    ins = [[sample("float32", op, count, seed=10 * r + j) for j in range(n)] for r in range(n)]
    outs = [np.zeros(count, dtype=np.float32) for _ in range(n)]
    for algorithm in ALGORITHMS["reduce_scatter"]:
        await run_world(
            [
                CollectiveSpec(
                    "reduce_scatter", ranks(n), r, tuple(ins[r]), (outs[r],), op=op, algorithm=algorithm
                )
                for r in range(n)
            ]
        )
        for j in range(n):
            assert_reduced(outs[j], reference(op, [ins[r][j] for r in range(n)]), op)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("dtype", "op"),
    [
        ("int32", ReduceOp.AVG),
        ("bool", ReduceOp.AVG),
        ("float32", ReduceOp.BXOR),
        ("complex64", ReduceOp.MAX),
    ],
)
async def test_invalid_op_dtype_pairs_raise_type_error(dtype: str, op: ReduceOp) -> None:
    x = np.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match=op.name):
        await run_collective(
            CollectiveSpec("all_reduce", (0, 1), 0, (x,), (x,), op=op),
            MemoryWorld(2)[0],
            TAG,
            meta("all_reduce"),
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.PRODUCT])
async def test_bfloat16_torch_tensors_all_reduce_like_torch(op: ReduceOp, small_chunks: None) -> None:
    torch = pytest.importorskip("torch")
    from aiocoll.device._tensors import as_working

    n = 4
    gen = torch.Generator().manual_seed(0)
    base = [torch.rand(300, generator=gen) + 0.5 for _ in range(n)]
    tensors = [b.to(torch.bfloat16) for b in base]
    wide = [t.float() for t in tensors]
    for algorithm in ALGORITHMS["all_reduce"]:
        work = [t.clone() for t in tensors]
        staged = [as_working(t) for t in work]
        await run_world(
            [
                CollectiveSpec(
                    "all_reduce",
                    ranks(n),
                    r,
                    (staged[r].array,),
                    (staged[r].array,),
                    op=op,
                    algorithm=algorithm,
                )
                for r in range(n)
            ],
            metas=[meta("all_reduce", dtype="bfloat16")] * n,
        )
        for s in staged:
            s.finish()
        want = {
            ReduceOp.SUM: sum(wide),
            ReduceOp.AVG: sum(wide) / n,
            ReduceOp.MIN: torch.stack(wide).min(0).values,
            ReduceOp.PRODUCT: torch.stack(wide).prod(0),
        }[op]
        assert work[0].dtype == torch.bfloat16
        torch.testing.assert_close(work[0].float(), want, rtol=3e-2, atol=3e-2)
        for t in work[1:]:
            assert torch.equal(t, work[0])


# ------------------------------------------------------------------------- contract with engine


class RecordingTransport(Transport):
    """Wraps a transport and records (kind, peer, tag, meta) of every message."""

    def __init__(self, inner: Transport, log: list[tuple[str, int | None, Any, Any]]) -> None:
        self.inner, self.log = inner, log
        self.rank, self.world_size = inner.rank, inner.world_size

    async def send(self, dst: int, tag: Any, payload: memoryview, meta: dict[str, Any]) -> None:
        self.log.append(("send", dst, tag, meta))
        await self.inner.send(dst, tag, payload, meta)

    async def recv(self, src: int | None, tag: Any, into: memoryview) -> tuple[int, dict[str, Any]]:
        self.log.append(("recv", src, tag, None))
        return await self.inner.recv(src, tag, into)

    def discard(self, tag_prefix: Any) -> None:
        self.inner.discard(tag_prefix)

    def on_peer_lost(self, handler: Any) -> None:
        self.inner.on_peer_lost(handler)

    def retire(self, tag_prefix: Any) -> None:
        self.inner.retire(tag_prefix)

    def on_stray(self, handler: Any) -> None:
        self.inner.on_stray(handler)

    def mark_lost(self, rank: int, reason: str) -> None:
        self.inner.mark_lost(rank, reason)

    @property
    def lost_peers(self) -> dict[int, str]:
        return self.inner.lost_peers

    def debug_state(self) -> dict[str, Any]:
        return self.inner.debug_state()

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "all_gather", "all_to_all", "barrier"])
async def test_every_message_is_tagged_under_the_op_tag_and_carries_the_meta(
    kind: str, small_chunks: None
) -> None:
    n, count = 3, 600
    world = MemoryWorld(n)
    log: list[tuple[str, int | None, Any, Any]] = []
    signature = meta(kind, count=count)
    specs = []
    for r in range(n):
        x = np.arange(count, dtype=np.int64)
        if kind == "all_reduce":
            specs.append(CollectiveSpec(kind, ranks(n), r, (x,), (x,)))
        elif kind == "broadcast":
            specs.append(CollectiveSpec(kind, ranks(n), r, (), (x,)))
        elif kind == "all_gather":
            specs.append(CollectiveSpec(kind, ranks(n), r, (x,), tuple(np.empty_like(x) for _ in range(n))))
        elif kind == "all_to_all":
            specs.append(
                CollectiveSpec(kind, ranks(n), r, (x,) * n, tuple(np.empty_like(x) for _ in range(n)))
            )
        else:
            specs.append(CollectiveSpec(kind, ranks(n), r, (), ()))
    await asyncio.wait_for(
        asyncio.gather(
            *(run_collective(specs[r], RecordingTransport(world[r], log), TAG, signature) for r in range(n))
        ),
        LIMIT,
    )
    assert log
    for what, _, tag, carried in log:
        assert tag[: len(TAG)] == TAG and len(tag) == len(TAG) + 1 and isinstance(tag[-1], int)
        if what == "send":
            assert carried == signature
    sends = sorted((t[-1]) for w, _, t, _ in log if w == "send")
    recvs = sorted((t[-1]) for w, _, t, _ in log if w == "recv")
    assert sends == recvs


@pytest.mark.timeout(60)
async def test_group_ranks_map_onto_global_ranks_of_the_transport() -> None:
    world = MemoryWorld(6)
    group = (4, 1, 3)
    xs = inputs(3, 50)
    expected = np.sum(xs, axis=0)
    specs = [CollectiveSpec("all_reduce", group, i, (xs[i],), (xs[i],), algorithm="ring") for i in range(3)]
    await run_world(specs, world=world)
    for x in xs:
        np.testing.assert_array_equal(x, expected)
    broadcast = [np.full(5, i) for i in range(3)]
    await run_world(
        [
            CollectiveSpec("broadcast", group, i, (), (broadcast[i],), root=2, algorithm="tree")
            for i in range(3)
        ],
        world=world,
    )
    assert all((b == 2).all() for b in broadcast)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "all_to_all", "reduce_scatter"])
async def test_collectives_complete_with_one_message_inboxes(kind: str, small_chunks: None) -> None:
    n, count = 4, 800
    world = MemoryWorld(n, max_inbox_bytes=1, max_inbox_messages=1)
    xs = inputs(n, count)
    specs = []
    for r in range(n):
        outs = tuple(np.empty(count, dtype=np.int64) for _ in range(n))
        if kind == "all_reduce":
            specs.append(CollectiveSpec(kind, ranks(n), r, (xs[r],), (xs[r],), algorithm="ring"))
        elif kind == "all_gather":
            specs.append(CollectiveSpec(kind, ranks(n), r, (xs[r],), outs, algorithm="ring"))
        elif kind == "all_to_all":
            specs.append(CollectiveSpec(kind, ranks(n), r, (xs[r],) * n, outs))
        else:
            specs.append(CollectiveSpec(kind, ranks(n), r, (xs[r],) * n, (outs[0],), algorithm="ring"))
    await run_world(specs, world=world)


@pytest.mark.timeout(60)
async def test_many_concurrent_operations_started_in_different_orders_all_complete(
    small_chunks: None,
) -> None:
    n, ops = 4, 12
    world = MemoryWorld(n)
    data = [[np.full(300, 10 * k + r, dtype=np.int64) for k in range(ops)] for r in range(n)]
    coros = []
    for r in range(n):
        order = range(ops) if r % 2 == 0 else reversed(range(ops))
        for k in order:
            algorithm = ("ring", "rhd", "tree")[k % 3]
            spec = CollectiveSpec(
                "all_reduce", ranks(n), r, (data[r][k],), (data[r][k],), algorithm=algorithm
            )
            coros.append(run_collective(spec, world[r], ("c", "g", k), meta("all_reduce")))
    await asyncio.wait_for(asyncio.gather(*coros), LIMIT)
    for r in range(n):
        for k in range(ops):
            assert (data[r][k] == sum(10 * k + q for q in range(n))).all()


# ------------------------------------------------------------------------------ failure handling


async def _outcomes(coros: list[Any], settle: float = 0.2) -> list[BaseException | str | None]:
    """Run ranks; after the first failure give the others ``settle`` seconds, then cancel them."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    await asyncio.wait(tasks, timeout=LIMIT, return_when=asyncio.FIRST_EXCEPTION)
    await asyncio.wait(tasks, timeout=settle)
    results: list[BaseException | str | None] = []
    for t in tasks:
        if not t.done():
            t.cancel()
            results.append("pending")
        else:
            results.append(t.exception())
    await asyncio.gather(*tasks, return_exceptions=True)
    return results


@pytest.mark.timeout(60)
async def test_signature_mismatch_raises_on_both_ranks_naming_ranks_and_fields() -> None:
    world = MemoryWorld(2)
    xs = inputs(2, 4)
    metas = [meta("all_reduce", count=4), meta("all_reduce", count=4, op="max")]
    got = await _outcomes(
        [
            run_collective(
                CollectiveSpec("all_reduce", (0, 1), r, (xs[r],), (xs[r],), algorithm="rhd"),
                world[r],
                TAG,
                metas[r],
            )
            for r in range(2)
        ]
    )
    for err in got:
        assert isinstance(err, MismatchError)
        assert err.ranks == [0, 1] and err.group == "g" and err.seq == 0
        assert "op" in str(err) and "rank 0" in str(err) and "rank 1" in str(err)
        assert err.fields == ["op"]  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
async def test_meta_that_differs_only_as_tuple_versus_list_is_not_a_mismatch() -> None:
    # A network transport decodes tuples as lists; that alone must not look like a mismatch.
    world = MemoryWorld(2)
    xs = inputs(2, 4)
    want = xs[0] + xs[1]
    metas = [meta("all_reduce", shape=(2, 2)), meta("all_reduce", shape=[2, 2])]
    await run_world(
        [CollectiveSpec("all_reduce", (0, 1), r, (xs[r],), (xs[r],)) for r in range(2)], world, metas
    )
    np.testing.assert_array_equal(xs[0], want)


@pytest.mark.timeout(60)
async def test_size_disagreement_with_equal_signatures_raises_mismatch_error() -> None:
    world = MemoryWorld(2)
    a, b = np.zeros(4, dtype=np.int64), np.zeros(6, dtype=np.int64)
    got = await _outcomes(
        [
            run_collective(
                CollectiveSpec("broadcast", (0, 1), 0, (), (a,), algorithm="direct"),
                world[0],
                TAG,
                meta("broadcast"),
            ),
            run_collective(
                CollectiveSpec("broadcast", (0, 1), 1, (), (b,), algorithm="direct"),
                world[1],
                TAG,
                meta("broadcast"),
            ),
        ]
    )
    assert got[0] is None
    assert isinstance(got[1], MismatchError) and "size" in str(got[1]) and got[1].ranks == [0, 1]


@pytest.mark.timeout(60)
async def test_mismatch_in_a_ring_is_raised_by_the_neighbours_of_the_odd_rank() -> None:
    n = 4
    world = MemoryWorld(n)
    xs = inputs(n, 40)
    metas = [meta("all_reduce", dtype="float32" if r == 2 else "int64") for r in range(n)]
    got = await _outcomes(
        [
            run_collective(
                CollectiveSpec("all_reduce", ranks(n), r, (xs[r],), (xs[r],), algorithm="ring"),
                world[r],
                TAG,
                metas[r],
            )
            for r in range(n)
        ]
    )
    # Rank 3 hears from rank 2 first, rank 2 from rank 1: both see the difference at once.
    for r in (2, 3):
        err = got[r]
        assert isinstance(err, MismatchError) and "dtype" in str(err)
        assert 2 in err.ranks


@pytest.mark.timeout(60)
async def test_peer_lost_before_the_ring_fails_its_neighbours_naming_it() -> None:
    n = 4
    world = MemoryWorld(n)
    world.kill(1)
    xs = inputs(n, 40)
    got = await _outcomes(
        [
            run_collective(
                CollectiveSpec("all_reduce", ranks(n), r, (xs[r],), (xs[r],), algorithm="ring"),
                world[r],
                TAG,
                meta("all_reduce"),
            )
            for r in (0, 2, 3)
        ]
    )
    for err in got[:2]:
        assert isinstance(err, PeerLostError) and err.rank == 1


@pytest.mark.timeout(60)
async def test_a_failed_send_interrupts_the_receive_of_the_same_step() -> None:
    # Rank 0's ring step sends to dead rank 1 while receiving from rank 2, which never calls:
    # the send's PeerLostError must end the operation rather than leave it waiting for rank 2.
    world = MemoryWorld(3)
    world.kill(1)
    x = np.zeros(30, dtype=np.int64)
    spec = CollectiveSpec("all_reduce", (0, 1, 2), 0, (x,), (x,), algorithm="ring")
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(run_collective(spec, world[0], TAG, meta("all_reduce")), 5)
    assert info.value.rank == 1
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


@pytest.mark.timeout(60)
async def test_peer_killed_mid_operation_fails_the_waiting_rank_promptly() -> None:
    world = MemoryWorld(2)
    x = np.zeros(10, dtype=np.int64)
    task = asyncio.ensure_future(
        run_collective(
            CollectiveSpec("all_reduce", (0, 1), 0, (x,), (x,), algorithm="ring"),
            world[0],
            TAG,
            meta("all_reduce"),
        )
    )
    await asyncio.sleep(0.02)
    assert not task.done()
    world.kill(1)
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(task, 5)
    assert info.value.rank == 1


@pytest.mark.timeout(60)
async def test_cancelling_an_operation_leaves_no_task_behind(small_chunks: None) -> None:
    world = MemoryWorld(3)
    x = np.zeros(5000, dtype=np.int64)
    task = asyncio.ensure_future(
        run_collective(
            CollectiveSpec("all_reduce", (0, 1, 2), 0, (x,), (x,), algorithm="ring"),
            world[0],
            TAG,
            meta("all_reduce"),
        )
    )
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert asyncio.all_tasks() == {asyncio.current_task()}


# ------------------------------------------------------------------------------ argument checks


def test_choose_algorithm_picks_latency_for_small_and_bandwidth_for_large_all_reduce() -> None:
    assert choose_algorithm("all_reduce", 4, 4) == "rhd"
    assert choose_algorithm("all_reduce", 16 << 20, 4) == "rhd"
    assert [choose_algorithm("all_reduce", 16 << 20, n) for n in (3, 5, 8)] == ["ring"] * 3
    for kind, allowed in ALGORITHMS.items():
        for nbytes in (0, 4, 1 << 24):
            for n in SIZES:
                assert choose_algorithm(kind, nbytes, n) in allowed
    with pytest.raises(ValueError, match="unknown collective kind"):
        choose_algorithm("all_sum", 4, 2)


@pytest.mark.timeout(30)
async def test_bad_specs_raise_value_error_before_sending_anything() -> None:
    world = MemoryWorld(2)
    x = np.zeros(3)
    with pytest.raises(ValueError, match="not available"):
        await run_collective(
            CollectiveSpec("scatter", (0, 1), 0, (x, x), (x,), algorithm="ring"), world[0], TAG, {}
        )
    with pytest.raises(ValueError, match="root"):
        await run_collective(CollectiveSpec("broadcast", (0, 1), 0, (), (x,), root=2), world[0], TAG, {})
    with pytest.raises(ValueError, match="outputs"):
        await run_collective(CollectiveSpec("all_to_all", (0, 1), 0, (x,), (x,)), world[0], TAG, {})
    with pytest.raises(ValueError, match="1-D"):
        y = np.zeros((2, 2))
        await run_collective(CollectiveSpec("all_reduce", (0, 1), 0, (y,), (y,)), world[0], TAG, {})
