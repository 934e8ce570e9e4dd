"""The step driver run eagerly (operations driven by message callbacks, no task) and what it
stands on: ``Transport.post_recv`` (the task-based default on the memory transport, the direct callback
of the TCP transport) and ``Engine.submit_eager`` (sequencing, deadlines, loss and mismatch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.engine import Engine
from aiocoll.client.data.transports.memory import MemoryWorld
from aiocoll.client.data.transports.tcp import TcpTransport

from aiocoll._deadline import Deadline
from aiocoll._errors import CollectiveTimeout, MismatchError, PeerLostError
from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec, Transport
from aiocoll.algorithms._driver import start_collective
from aiocoll.algorithms._plan import prepare

pytestmark = pytest.mark.timeout(60)

TAG = ("c", "g", 0)
LIMIT = 20.0


def meta_of(spec: CollectiveSpec) -> dict[str, Any]:
    return {"kind": spec.kind, "root": spec.root, "op": spec.op.value}


async def run_eager(specs: list[CollectiveSpec], transports: list[Transport], tag: Any = TAG) -> list[Any]:
    """Start every rank's spec eagerly; the outcomes (None or the error) in rank order."""
    loop = asyncio.get_running_loop()
    outcomes: list[asyncio.Future[BaseException | None]] = []
    for spec in specs:
        meta = meta_of(spec)
        plan = prepare(spec, meta)
        assert plan is not None, f"{spec.kind} with {len(spec.ranks)} ranks should run eagerly"
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        start_collective(plan, spec, transports[spec.ranks[spec.me]], tag, meta, fut.set_result)
        outcomes.append(fut)
    return list(await asyncio.wait_for(asyncio.gather(*outcomes), LIMIT))


def values(n: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, size=count).astype(np.int64) for _ in range(n)]


def every_kind(n: int, count: int, seed: int) -> tuple[list[list[CollectiveSpec]], Any]:
    """Specs of every kind for ``n`` ranks and a check of their results against numpy."""
    ranks = tuple(range(n))
    root = (seed + 1) % n
    ar = values(n, count, seed)
    want_ar = np.sum(ar, axis=0)
    bc = values(n, count, seed + 1)
    want_bc = bc[root].copy()
    rd = values(n, count, seed + 2)
    want_rd = np.sum(rd, axis=0)
    ag_in = values(n, count, seed + 3)
    ag_out = [[np.zeros(count, np.int64) for _ in ranks] for _ in ranks]
    rs_in = [values(n, count, seed + 4 + r) for r in ranks]
    rs_out = [np.zeros(count, np.int64) for _ in ranks]
    a2a_in = [values(n, count, seed + 20 + r) for r in ranks]
    a2a_out = [[np.zeros(count, np.int64) for _ in ranks] for _ in ranks]
    sc_in = values(n, count, seed + 40)
    sc_out = [np.zeros(count, np.int64) for _ in ranks]
    ga_out = [np.zeros(count, np.int64) for _ in ranks]
    specs = [
        [CollectiveSpec("all_reduce", ranks, r, (ar[r],), (ar[r],)) for r in ranks],
        [CollectiveSpec("all_reduce", ranks, r, (ar[r],), (ar[r],), op=ReduceOp.MAX) for r in ranks],
        [CollectiveSpec("broadcast", ranks, r, (), (bc[r],), root=root) for r in ranks],
        [CollectiveSpec("reduce", ranks, r, (rd[r],), (rd[r],), root=root) for r in ranks],
        [CollectiveSpec("all_gather", ranks, r, (ag_in[r],), tuple(ag_out[r])) for r in ranks],
        [CollectiveSpec("reduce_scatter", ranks, r, tuple(rs_in[r]), (rs_out[r],)) for r in ranks],
        [CollectiveSpec("all_to_all", ranks, r, tuple(a2a_in[r]), tuple(a2a_out[r])) for r in ranks],
        [
            CollectiveSpec("scatter", ranks, r, tuple(sc_in) if r == root else (), (sc_out[r],), root=root)
            for r in ranks
        ],
        [
            CollectiveSpec("gather", ranks, r, (ag_in[r],), tuple(ga_out) if r == root else (), root=root)
            for r in ranks
        ],
        [CollectiveSpec("barrier", ranks, r, (), ()) for r in ranks],
    ]

    def check() -> None:
        for r in ranks:
            # all_reduce SUM then MAX of the identical sums: still the sum.
            np.testing.assert_array_equal(ar[r], want_ar)
            np.testing.assert_array_equal(bc[r], want_bc)
            for j in ranks:
                np.testing.assert_array_equal(ag_out[r][j], ag_in[j])
                np.testing.assert_array_equal(a2a_out[r][j], a2a_in[j][r])
            np.testing.assert_array_equal(rs_out[r], np.sum([rs_in[j][r] for j in ranks], axis=0))
            np.testing.assert_array_equal(sc_out[r], sc_in[r])
        np.testing.assert_array_equal(rd[root], want_rd)
        for j in ranks:
            np.testing.assert_array_equal(ga_out[j], ag_in[j])

    return specs, check


# ------------------------------------------------------------------------------ the runner


@pytest.mark.parametrize("n", range(1, 9))
async def test_every_small_kind_runs_eagerly_over_the_memory_transport_and_matches_numpy(n: int) -> None:
    world = MemoryWorld(n)
    for count in (0, 1, 7, 300):
        specs, check = every_kind(n, count, seed=count + n)
        for i, per_rank in enumerate(specs):
            assert await run_eager(per_rank, list(world), tag=("c", "g", count, i)) == [None] * n
        check()


async def make_tcp_world(n: int) -> list[TcpTransport]:
    ts = [TcpTransport(r, n, token="t", job="j") for r in range(n)]
    addrs = {r: [await t.listen("127.0.0.1")] for r, t in enumerate(ts)}
    await asyncio.gather(*(t.connect(addrs, Deadline(10)) for t in ts))
    return ts


@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_every_small_kind_runs_eagerly_over_tcp_from_the_read_callbacks(n: int) -> None:
    ts = await make_tcp_world(n)
    try:
        for count in (1, 1000):
            specs, check = every_kind(n, count, seed=count * n)
            for i, per_rank in enumerate(specs):
                assert await run_eager(per_rank, list(ts), tag=("c", "g", count, i)) == [None] * n
            check()
        # Ranks started at different times: the late rank's messages wait in the inbox and the
        # early ranks' receives are answered from the read callback.
        xs = values(n, 5, 99)
        want = np.sum(xs, axis=0)
        staggered = [CollectiveSpec("all_reduce", tuple(range(n)), r, (xs[r],), (xs[r],)) for r in range(n)]
        loop = asyncio.get_running_loop()
        futs = []
        for spec in staggered:
            fut: asyncio.Future[BaseException | None] = loop.create_future()
            plan = prepare(spec, meta_of(spec))
            assert plan is not None
            start_collective(plan, spec, ts[spec.me], ("c", "late", 0), meta_of(spec), fut.set_result)
            futs.append(fut)
            await asyncio.sleep(0.02)
        assert await asyncio.wait_for(asyncio.gather(*futs), LIMIT) == [None] * n
        for x in xs:
            np.testing.assert_array_equal(x, want)
    finally:
        await asyncio.gather(*(t.aclose() for t in ts))


async def test_large_multi_lane_and_forced_specs_run_eagerly_and_invalid_ones_fail_at_planning() -> None:
    """One driver for every size and algorithm (formerly only small single-lane specs without an
    override ran eagerly); an invalid spec raises its error when it is planned."""
    small = np.zeros(4, np.float32)
    big = np.zeros(64 * 1024 // 4 + 1, np.float32)
    world = MemoryWorld(2)
    for seq, (make, algorithm) in enumerate(
        [(lambda: small, None), (lambda: big, None), (lambda: small, "ring"), (lambda: big, "ring")]
    ):
        xs = [make().copy() + r + 1 for r in range(2)]
        specs = [
            CollectiveSpec("all_reduce", (0, 1), r, (xs[r],), (xs[r],), algorithm=algorithm) for r in range(2)
        ]
        assert await run_eager(specs, list(world), tag=("c", "g", seq)) == [None, None]
        for x in xs:
            np.testing.assert_array_equal(x, np.full_like(x, 3))
    blocks = [(np.zeros(0, np.float32), big.copy() + r) for r in range(2)]
    # Rank r's block j goes to rank j: rank 0 gets two empty blocks, rank 1 two large ones.
    outs = [(np.zeros(0, np.float32), np.zeros(0, np.float32)), (np.zeros_like(big), np.zeros_like(big))]
    specs = [CollectiveSpec("all_to_all", (0, 1), r, blocks[r], outs[r]) for r in range(2)]
    assert await run_eager(specs, list(world), tag=("c", "g", 9)) == [None, None]
    np.testing.assert_array_equal(outs[1][0], big)
    np.testing.assert_array_equal(outs[1][1], big + 1)
    bad_op = CollectiveSpec("all_reduce", (0, 1), 0, (small,), (small,), op=ReduceOp.BAND)
    with pytest.raises(TypeError, match="BAND"):
        prepare(bad_op, {})
    bad_root = CollectiveSpec("broadcast", (0, 1), 0, (), (small,), root=5)
    with pytest.raises(ValueError, match="root 5"):
        prepare(bad_root, {})


async def test_a_signature_mismatch_fails_both_ranks_naming_both() -> None:
    world = MemoryWorld(2)
    x = [np.ones(3, np.int64), np.ones(3, np.int64)]
    specs = [CollectiveSpec("all_reduce", (0, 1), r, (x[r],), (x[r],)) for r in range(2)]
    loop = asyncio.get_running_loop()
    futs = []
    for r, spec in enumerate(specs):
        meta = {"kind": "all_reduce", "op": "sum" if r == 0 else "max"}
        plan = prepare(spec, meta)
        assert plan is not None
        fut: asyncio.Future[BaseException | None] = loop.create_future()
        start_collective(plan, spec, world[r], TAG, meta, fut.set_result)
        futs.append(fut)
    errors = await asyncio.wait_for(asyncio.gather(*futs), LIMIT)
    for err in errors:
        assert isinstance(err, MismatchError)
        assert err.ranks == [0, 1] and "op" in str(err)


async def test_a_size_mismatch_over_tcp_fails_the_receiver_with_mismatch_error() -> None:
    a, b = await make_tcp_world(2)
    try:
        xa, xb = np.ones(3, np.int64), np.ones(4, np.int64)
        loop = asyncio.get_running_loop()
        futs = []
        for t, x, r in ((a, xa, 0), (b, xb, 1)):
            spec = CollectiveSpec("all_reduce", (0, 1), r, (x,), (x,))
            fut: asyncio.Future[BaseException | None] = loop.create_future()
            plan = prepare(spec, {"kind": "all_reduce"})
            assert plan is not None
            start_collective(plan, spec, t, TAG, {"kind": "all_reduce"}, fut.set_result)
            futs.append(fut)
        errors = await asyncio.wait_for(asyncio.gather(*futs), LIMIT)
        assert all(isinstance(e, MismatchError) for e in errors)
        assert "wrong size" in str(errors[0])
    finally:
        await asyncio.gather(a.aclose(), b.aclose())


async def test_a_killed_peer_fails_the_waiting_rank_and_a_stopped_lane_never_reports() -> None:
    world = MemoryWorld(3)
    x = np.ones(2, np.int64)
    spec = CollectiveSpec("all_reduce", (0, 1, 2), 0, (x,), (x,))
    plan = prepare(spec, meta_of(spec))
    assert plan is not None
    fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
    start_collective(plan, spec, world[0], TAG, meta_of(spec), fut.set_result)
    world.kill(1)
    err = await asyncio.wait_for(fut, LIMIT)
    assert isinstance(err, PeerLostError) and err.rank == 1

    reported: list[Any] = []
    y = np.ones(2, np.int64)
    spec2 = CollectiveSpec("all_reduce", (0, 2), 0, (y,), (y,))
    plan2 = prepare(spec2, meta_of(spec2))
    assert plan2 is not None
    lane = start_collective(plan2, spec2, world[0], ("c", "g", 1), meta_of(spec2), reported.append)
    lane.stop()
    world[0].discard(("c", "g", 1))
    await asyncio.sleep(0.05)
    assert reported == []


async def test_finished_and_failed_operations_leave_no_cycle_for_the_garbage_collector() -> None:
    """A finished operation's objects must be freed by reference counting: a reference cycle
    per operation (the driver and its lanes, which hold the plan, the buffer map and the
    caller's completion) made small all_reduces pay for a garbage collection every ~25 calls."""
    import gc

    from aiocoll.algorithms import _driver

    ours = {_driver.Driver, _driver._Lane, _driver.Context, _driver._StepRun}
    ts = await make_tcp_world(4)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for count in (1, 1000):  # one step per peer message, and a multi-step halving-doubling
            specs, check = every_kind(4, count, seed=count)
            for i, per_rank in enumerate(specs):
                assert await run_eager(per_rank, list(ts), tag=("c", "gc", count, i)) == [None] * 4
            check()
        world = MemoryWorld(2)  # and a failed one (a signature mismatch ends both ranks early)
        futs = []
        for r in range(2):
            x = np.ones(3, np.int64)
            spec = CollectiveSpec("all_reduce", (0, 1), r, (x,), (x,))
            meta = {"kind": "all_reduce", "op": "sum" if r == 0 else "max"}
            fut: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
            start_collective(prepare(spec, meta), spec, world[r], TAG, meta, fut.set_result)
            futs.append(fut)
        assert all(isinstance(e, MismatchError) for e in await asyncio.wait_for(asyncio.gather(*futs), LIMIT))
        await asyncio.sleep(0.01)  # the mismatch's abandoned transfers settle
        gc.collect()
        left = sorted({type(o).__name__ for o in gc.garbage if type(o) in ours})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await asyncio.gather(*(t.aclose() for t in ts))
    assert left == [], f"operations left reference cycles through {left}"


# ------------------------------------------------------------------ TCP post_recv itself


async def test_tcp_post_recv_answers_at_once_for_a_buffered_message_and_later_from_the_reader() -> None:
    a, b = await make_tcp_world(2)
    try:
        await a.send(1, ("c", "g", 0, 0), np.arange(3, dtype=np.int32).data, {"k": 1})
        await asyncio.sleep(0.05)
        got: list[Any] = []
        out = np.zeros(3, np.int32)
        b.post_recv(0, ("c", "g", 0, 0), out.data, lambda res, exc: got.append((res, exc)))
        assert got == [((0, {"k": 1}), None)]  # before post_recv returned
        np.testing.assert_array_equal(out, [0, 1, 2])

        arrived = asyncio.get_running_loop().create_future()
        out2 = np.zeros(3, np.int32)
        b.post_recv(0, ("c", "g", 0, 1), out2.data, lambda res, exc: arrived.set_result((res, exc)))
        assert not arrived.done()
        await a.send(1, ("c", "g", 0, 1), np.full(3, 7, np.int32).data, {"k": 2})
        assert await asyncio.wait_for(arrived, LIMIT) == ((0, {"k": 2}), None)
        np.testing.assert_array_equal(out2, [7, 7, 7])
    finally:
        await asyncio.gather(a.aclose(), b.aclose())


async def test_tcp_post_recv_reports_wrong_lengths_discards_and_lost_peers_to_the_callback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = await make_tcp_world(2)
    try:
        loop = asyncio.get_running_loop()
        wrong = loop.create_future()
        b.post_recv(0, ("c", "g", 1, 0), np.zeros(2, np.int32).data, lambda r, e: wrong.set_result(e))
        await a.send(1, ("c", "g", 1, 0), np.zeros(5, np.int32).data, {"who": "a"})
        err = await asyncio.wait_for(wrong, LIMIT)
        assert isinstance(err, MismatchError) and err.remote_meta == {"who": "a"}  # type: ignore[attr-defined]

        dropped = loop.create_future()
        b.post_recv(0, ("c", "g", 2, 0), np.zeros(1, np.int32).data, lambda r, e: dropped.set_result(e))
        b.discard(("c", "g", 2))
        assert isinstance(await asyncio.wait_for(dropped, LIMIT), asyncio.CancelledError)

        # A callback that raises is logged; the link keeps working.
        def boom(res: Any, exc: Any) -> None:
            raise RuntimeError("callback bug")

        b.post_recv(0, ("c", "g", 3, 0), np.zeros(1, np.int32).data, boom)
        with caplog.at_level(logging.ERROR):
            await a.send(1, ("c", "g", 3, 0), np.zeros(1, np.int32).data, {})
            await a.send(1, ("c", "g", 4, 0), np.ones(1, np.int32).data, {})
            out = np.zeros(1, np.int32)
            assert (await asyncio.wait_for(b.recv(0, ("c", "g", 4, 0), out.data), LIMIT))[0] == 0
        assert out[0] == 1 and "callback failed" in caplog.text

        lost = loop.create_future()
        b.post_recv(0, ("c", "g", 5, 0), np.zeros(1, np.int32).data, lambda r, e: lost.set_result(e))
        a.abort()
        err = await asyncio.wait_for(lost, LIMIT)
        assert isinstance(err, PeerLostError) and err.rank == 0
        after: list[Any] = []
        b.post_recv(0, ("c", "g", 6, 0), np.zeros(1, np.int32).data, lambda r, e: after.append(e))
        assert len(after) == 1 and isinstance(after[0], PeerLostError)  # at once, not a hang
    finally:
        await asyncio.gather(a.aclose(), b.aclose())


# ------------------------------------------------------------------ Engine.submit_eager


def eager_all_reduce(
    x: np.ndarray, ranks: tuple[int, ...], me: int, meta: dict[str, Any] | None = None
) -> Any:
    spec = CollectiveSpec("all_reduce", ranks, me, (x,), (x,))
    meta = meta or {"kind": "all_reduce", "dtype": x.dtype.name, "count": x.size}
    plan = prepare(spec, meta)
    assert plan is not None

    def start(tag: Any, transport: Any, finish: Any) -> Any:
        return start_collective(plan, spec, transport, tag, meta, lambda exc: finish(x, exc))

    return start


@contextlib.asynccontextmanager
async def engines(n: int) -> AsyncIterator[tuple[MemoryWorld, list[Engine]]]:
    world = MemoryWorld(n)
    engs = [Engine(world[r], default_timeout=10) for r in range(n)]
    try:
        yield world, engs
    finally:
        for e in engs:
            await e.aclose()


async def test_submit_eager_sequences_many_in_flight_calls_made_in_different_orders() -> None:
    async with engines(3) as (_, engs):
        groups = [e.group("w", (0, 1, 2)) for e in engs]
        xs = [[np.full(2, r * 10 + i, np.int64) for i in range(30)] for r in range(3)]
        works = []
        for r in (2, 0, 1):
            works += [
                engs[r].submit_eager(groups[r], "all_reduce", eager_all_reduce(x, (0, 1, 2), r), timeout=10)
                for x in xs[r]
            ]
        await asyncio.wait_for(asyncio.gather(*works), LIMIT)
        for i in range(30):
            want = sum(r * 10 + i for r in range(3))
            for r in range(3):
                np.testing.assert_array_equal(xs[r][i], [want, want])


async def test_submit_eager_deadline_names_the_silent_rank_and_breaks_the_group() -> None:
    async with engines(2) as (_, engs):
        group = engs[0].group("w", (0, 1))
        x = np.ones(1, np.int64)
        work = engs[0].submit_eager(group, "all_reduce", eager_all_reduce(x, (0, 1), 0), timeout=0.2)
        with pytest.raises(CollectiveTimeout) as info:
            await asyncio.wait_for(work, LIMIT)
        assert info.value.missing_ranks == [1] and info.value.seq == 0
        with pytest.raises(CollectiveTimeout, match="out of step"):
            engs[0].submit_eager(group, "all_reduce", eager_all_reduce(x, (0, 1), 0), timeout=1)
        assert not group.pending


async def test_submit_eager_fails_every_rank_on_a_mismatch_and_on_a_lost_peer() -> None:
    async with engines(3) as (world, engs):
        groups = [e.group("w", (0, 1, 2)) for e in engs]
        works = [
            engs[r].submit_eager(
                groups[r],
                "all_reduce",
                eager_all_reduce(np.ones(2, np.int64), (0, 1, 2), r, {"kind": "all_reduce", "x": r == 2}),
                timeout=10,
            )
            for r in range(3)
        ]
        outcomes = await asyncio.wait_for(asyncio.gather(*works, return_exceptions=True), LIMIT)
        assert all(isinstance(o, MismatchError) for o in outcomes), outcomes

        pair = [e.group("p", (0, 1)) for e in engs[:2]]
        start = eager_all_reduce(np.ones(1), (0, 1), 0)
        work = engs[0].submit_eager(pair[0], "all_reduce", start, timeout=10)
        await asyncio.sleep(0.01)
        world.kill(1)
        with pytest.raises(PeerLostError) as info:
            await asyncio.wait_for(work, LIMIT)
        assert info.value.rank == 1
        with pytest.raises(PeerLostError):
            engs[0].submit_eager(pair[0], "all_reduce", eager_all_reduce(np.ones(1), (0, 1), 0), timeout=10)


async def test_submit_eager_of_a_single_rank_group_completes_inside_the_call() -> None:
    world = MemoryWorld(1)
    eng = Engine(world[0], default_timeout=10)
    try:
        group = eng.group("solo", (0,))
        x = np.arange(3)
        work = eng.submit_eager(group, "all_reduce", eager_all_reduce(x, (0,), 0), timeout=1)
        assert work.is_completed() and work.result() is x and not group.pending
    finally:
        await eng.aclose()


async def test_an_operation_complete_inside_its_call_is_born_complete_with_no_future_or_deadline() -> None:
    world = MemoryWorld(1)
    eng = Engine(world[0], default_timeout=10)
    try:
        group = eng.group("solo", (0,))
        x = np.arange(3)
        work = eng.submit_eager(group, "all_reduce", eager_all_reduce(x, (0,), 0), timeout=5)
        # the straight path: nothing to wait for, so no future, no pending entry, no deadline timer
        assert work._future is None and not group.pending and eng.deadlines._timer is None
        assert work.is_completed() and work.is_success() and work.exception() is None
        assert await work is x and work.result() is x and work.wait() is True
        assert work.get_future().result(timeout=1) is x
        seen: list[Any] = []
        work.add_done_callback(seen.append)
        await asyncio.sleep(0)
        assert seen == [work] and "all_reduce" in repr(work) and "seq 0" in work.description
        # the sequence still advances, and the operation is in the progress record
        second = eng.submit_eager(group, "all_reduce", eager_all_reduce(x, (0,), 0), timeout=5)
        assert "seq 1" in second.description
        assert [entry[2] for entry in eng.progress.history][-2:] == [0, 1]
    finally:
        await eng.aclose()


# ------------------------------------------------------ failures that re-enter the transport


def eager_all_gather(me: int, n: int) -> Any:
    """A direct all_gather: one step with n-1 receives, so failing one re-enters the others."""
    x = np.full(2, me, np.int64)
    outs = tuple(np.zeros(2, np.int64) for _ in range(n))
    spec = CollectiveSpec("all_gather", tuple(range(n)), me, (x,), outs)
    meta = {"kind": "all_gather"}
    plan = prepare(spec, meta)
    assert plan is not None and max(len(s.recvs) for s in plan.sched.lanes[0]) == n - 1

    def start(tag: Any, transport: Any, finish: Any) -> Any:
        return start_collective(plan, spec, transport, tag, meta, lambda exc: finish(outs, exc))

    return start


def loop_errors() -> list[Any]:
    errors: list[Any] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    return errors


async def test_a_lost_peer_fails_every_eager_op_of_every_group_over_tcp_and_leaves_nothing_posted() -> None:
    a, b = await make_tcp_world(2)
    errors = loop_errors()
    engine = Engine(a, default_timeout=30)
    try:
        w, v = engine.group("w", (0, 1)), engine.group("v", (0, 1))
        works = [
            engine.submit_eager(g, "all_reduce", eager_all_reduce(np.ones(2, np.int64), (0, 1), 0), timeout=9)
            for g in (w, w, v)
        ]
        await asyncio.sleep(0.05)
        b.abort()
        outcomes = await asyncio.wait_for(asyncio.gather(*works, return_exceptions=True), LIMIT)
        assert all(isinstance(o, PeerLostError) and o.rank == 1 for o in outcomes), outcomes
        assert errors == [] and not w.pending and not v.pending
        assert a.debug_state()["posted"] == {} and isinstance(v.broken, PeerLostError)
    finally:
        await engine.aclose()
        await asyncio.gather(a.aclose(), b.aclose())


async def test_a_deadline_and_a_close_fail_eager_ops_with_several_receives_per_step() -> None:
    ts = await make_tcp_world(3)
    errors = loop_errors()
    engine = Engine(ts[0], default_timeout=30)
    try:
        group = engine.group("w", (0, 1, 2))
        short = engine.submit_eager(group, "all_gather", eager_all_gather(0, 3), timeout=0.2)
        long = engine.submit_eager(group, "all_gather", eager_all_gather(0, 3), timeout=100)
        with pytest.raises(CollectiveTimeout) as info:
            await asyncio.wait_for(short, LIMIT)
        assert info.value.missing_ranks == [1, 2]
        with pytest.raises(CollectiveTimeout):  # the group is out of step, so the next one fails too
            await asyncio.wait_for(long, LIMIT)

        other = Engine(ts[1], default_timeout=30)
        z = other.group("z", (0, 1, 2))
        pending = other.submit_eager(z, "all_gather", eager_all_gather(1, 3), timeout=100)
        await other.aclose()
        assert pending.is_completed() and pending.exception() is not None
        assert errors == [] and not group.pending
    finally:
        await engine.aclose()
        await asyncio.gather(*(t.aclose() for t in ts))


async def test_destroying_a_group_with_a_small_all_gather_pending_closes_everything(tmp_path: Any) -> None:
    from aiocoll.api import init_process_group

    store = f"file://{tmp_path / 'store'}"
    pgs = await asyncio.wait_for(
        asyncio.gather(*(init_process_group(store, rank=r, world_size=3, token="t") for r in range(3))),
        LIMIT,
    )
    outs = [np.zeros(2, np.int64) for _ in range(3)]
    work = pgs[0].all_gather(outs, np.ones(2, np.int64))
    await asyncio.sleep(0.05)
    await asyncio.wait_for(pgs[0].destroy(), LIMIT)
    assert work.is_completed() and work.exception() is not None
    assert pgs[0]._rt.transport._closed
    for pg in pgs[1:]:
        await asyncio.wait_for(pg.destroy(), LIMIT)


async def test_a_task_operation_stopped_before_its_first_step_is_still_finished() -> None:
    """A starter's task cancelled in the loop turn it was made in never runs its body; whatever
    waits on its ``finish`` (a staged chain's next operation) must be let go all the same."""
    from aiocoll.client.data._operation import as_starter

    class OnThisLoop:
        loop = asyncio.get_running_loop()

    body_ran: list[bool] = []
    finished: list[Any] = []

    async def body(tag: Any, transport: Any) -> None:
        body_ran.append(True)

    runner = as_starter(body)(("t",), OnThisLoop(), lambda result, exc: finished.append((result, exc)))  # type: ignore[arg-type]
    runner.stop()  # before the task's first step
    for _ in range(3):
        await asyncio.sleep(0)
    assert body_ran == []
    assert len(finished) == 1 and isinstance(finished[0][1], asyncio.CancelledError)

    # one that ran is finished once, from inside its task
    finished.clear()
    runner = as_starter(body)(("t",), OnThisLoop(), lambda result, exc: finished.append((result, exc)))  # type: ignore[arg-type]
    for _ in range(3):
        await asyncio.sleep(0)
    assert body_ran == [True] and finished == [(None, None)]


async def test_a_straight_operation_retires_its_tag_unless_told_no_message_can_come_under_it() -> None:
    world = MemoryWorld(1)
    eng = Engine(world[0], default_timeout=10)
    retired: list[Any] = []
    real = world[0].retire

    def retire(tag: Any) -> None:
        retired.append(tag)
        real(tag)

    world[0].retire = retire  # type: ignore[method-assign]
    try:
        group = eng.group("solo", (0,))

        def at_once(tag: Any, transport: Any, finish: Any) -> Any:
            assert transport.outstanding_recv == {}  # counted only once it waits for a message
            finish("done", None)
            return None

        assert await eng.submit_eager(group, "all_reduce", at_once, timeout=5) == "done"
        # (an arena's all_reduce: it sends no message, and completed only as every member's)
        assert await eng.submit_eager(group, "all_reduce", at_once, timeout=5, retire=False) == "done"
        assert retired == [("c", "solo", 0)]
        assert [entry[2] for entry in eng.progress.history][-2:] == [0, 1]
    finally:
        await eng.aclose()


async def test_a_calls_timeout_default_check_and_a_destroyed_groups_refusal(tmp_path: Any) -> None:
    """The public layer hands the record on with the group's default timeout unresolved: an
    operation that waits takes the default in force at its call, an explicit timeout is checked
    at the call, and a destroyed group's table refuses a later call at once."""
    from aiocoll._errors import DistError
    from aiocoll.api import init_process_group

    store = f"file://{tmp_path / 'store'}"
    pgs = await asyncio.wait_for(
        asyncio.gather(*(init_process_group(store, rank=r, world_size=2, token="t") for r in range(2))),
        LIMIT,
    )
    pg = pgs[0]
    x = np.ones(3, np.float32)
    with pytest.raises(ValueError, match="timeout"):
        pg.all_reduce(x, timeout=-1)
    pg._set_default_timeout(0.3)
    assert pg.default_timeout == 0.3
    with pytest.raises(CollectiveTimeout) as timed_out:  # rank 1 never calls it
        await asyncio.wait_for(pg.barrier(), LIMIT)
    assert timed_out.value.timeout == 0.3
    await asyncio.wait_for(pg.destroy(), LIMIT)
    with pytest.raises(DistError, match="all_reduce: process group 'w' was destroyed"):
        pg.all_reduce(x)
    await asyncio.wait_for(pgs[1].destroy(), LIMIT)


async def test_a_work_born_complete_keeps_neither_the_record_nor_its_arrays() -> None:
    """The record carries the call's arrays (a staged copy among them): a Work the caller keeps
    after its operation completed inside its call must not keep them, and still says what it was."""
    import weakref

    from aiocoll.client.data._operation import HANDED_OFF, Operation

    world = MemoryWorld(1)
    eng = Engine(world[0], default_timeout=10)
    try:
        group = eng.group("solo", (0,))
        staged = np.zeros(1 << 16)

        def at_once(tag: Any, transport: Any, finish: Any) -> Any:
            finish(None, None)
            return HANDED_OFF

        op = Operation("all_reduce", {"kind": "all_reduce"}, (staged,), (staged,), (), None, 5)
        record, array = weakref.ref(op), weakref.ref(staged)
        work = eng.submit_op(group, op, at_once)
        del op, staged
        assert work.is_completed() and record() is None and array() is None
        assert work.description == "all_reduce (group 'solo', seq 0)"
    finally:
        await eng.aclose()
