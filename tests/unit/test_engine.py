"""Engine: call-time sequencing, deadlines naming silent ranks, loss and mismatch fan-out,
cancellation — over the in-memory transport (and TCP where stray detection needs it)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from aiocoll.client.data.engine import Engine
from aiocoll.client.data.transports.memory import MemoryWorld

from aiocoll._errors import CollectiveTimeout, DistError, MismatchError, PeerLostError
from aiocoll.algorithms import CollectiveSpec, run_collective

pytestmark = pytest.mark.timeout(30)


def engines(n: int) -> tuple[MemoryWorld, list[Engine]]:
    world = MemoryWorld(n)
    return world, [Engine(world[r], default_timeout=10) for r in range(n)]


async def close(engs: list[Engine]) -> None:
    for e in engs:
        await e.aclose()


def all_reduce_body(
    x: np.ndarray, ranks: tuple[int, ...], me: int, meta: dict[str, Any] | None = None
) -> Any:
    spec = CollectiveSpec("all_reduce", ranks, me, (x,), (x,))
    meta = meta or {"kind": "all_reduce", "dtype": x.dtype.name, "count": x.size}

    async def body(tag: Any, tp: Any) -> np.ndarray:
        await run_collective(spec, tp, tag, meta)
        return x

    return body


def barrier_body(ranks: tuple[int, ...], me: int) -> Any:
    spec = CollectiveSpec("barrier", ranks, me, (), ())

    async def body(tag: Any, tp: Any) -> None:
        await run_collective(spec, tp, tag, {"kind": "barrier"})

    return body


async def waiting_in_barrier(engs: list[Engine], name: str, ranks: tuple[int, ...], waiter: int) -> Any:
    """Group ``name`` of ``ranks`` made on each of them, and a barrier that global rank ``waiter``
    entered alone (it waits for the others), started."""
    groups = {r: engs[r].group(name, ranks) for r in ranks}
    pending = engs[waiter].submit(
        groups[waiter], "barrier", barrier_body(ranks, ranks.index(waiter)), timeout=10
    )
    await asyncio.sleep(0)
    return pending


async def test_sequence_numbers_are_taken_at_call_time_so_many_in_flight_match() -> None:
    _, engs = engines(3)
    groups = [e.group("w", (0, 1, 2)) for e in engs]
    xs = [[np.full(2, r * 10 + i, np.int64) for i in range(30)] for r in range(3)]
    works = []
    for r in (2, 0, 1):  # ranks call in a different wall-clock order; each rank in program order
        works += [
            engs[r].submit(groups[r], "all_reduce", all_reduce_body(x, (0, 1, 2), r), timeout=10)
            for x in xs[r]
        ]
    await asyncio.gather(*works)
    for r in range(3):
        for i in range(30):
            assert (xs[r][i] == sum(k * 10 + i for k in range(3))).all()
    assert all(g.next_seq == 30 for g in groups)
    await close(engs)


async def test_point_to_point_takes_no_sequence_number() -> None:
    _, engs = engines(2)
    g0, g1 = engs[0].group("w", (0, 1)), engs[1].group("w", (0, 1))

    async def send(tag: Any, tp: Any) -> None:
        await tp.send(1, tag, memoryview(b"hi"), {})

    buf = bytearray(2)

    async def recv(tag: Any, tp: Any) -> int:
        src, _ = await tp.recv(0, tag, memoryview(buf))
        return src

    w1 = engs[0].submit(g0, "send", send, timeout=5, p2p_tag=0)
    w2 = engs[1].submit(g1, "recv", recv, timeout=5, p2p_tag=0)
    assert await w2 == 0 and bytes(buf) == b"hi"
    await w1
    assert g0.next_seq == 0 and g1.next_seq == 0
    await close(engs)


async def test_timeout_names_the_ranks_whose_messages_are_outstanding_and_breaks_the_group() -> None:
    _, engs = engines(2)
    g0 = engs[0].group("w", (0, 1))
    engs[1].group("w", (0, 1))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    work = engs[0].submit(g0, "barrier", barrier_body((0, 1), 0), timeout=0.2)
    with pytest.raises(CollectiveTimeout) as info:
        await work
    assert loop.time() - t0 < 2.0
    err = info.value
    assert (err.op, err.group, err.seq, err.missing_ranks) == ("barrier", "world", 0, [1])
    assert isinstance(err, TimeoutError)
    with pytest.raises(CollectiveTimeout, match="seq 0"):
        engs[0].submit(g0, "barrier", barrier_body((0, 1), 0), timeout=1)
    await close(engs)


async def test_lost_peer_fails_pending_ops_of_groups_containing_it_at_once_and_later_calls_fast() -> None:
    world, engs = engines(3)
    g01 = engs[0].group("a", (0, 1))
    g02 = engs[0].group("b", (0, 2))
    engs[1].group("a", (0, 1))
    engs[2].group("b", (0, 2))
    pending = engs[0].submit(g01, "barrier", barrier_body((0, 1), 0), timeout=10)
    await asyncio.sleep(0.01)
    world.kill(1)
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(pending, 2)
    assert info.value.rank == 1
    with pytest.raises(PeerLostError):
        engs[0].submit(g01, "barrier", barrier_body((0, 1), 0), timeout=10)
    # a group without rank 1 is unaffected
    other = engs[2].submit(engs[2].group("b", (0, 2)), "barrier", barrier_body((0, 2), 1), timeout=5)
    await engs[0].submit(g02, "barrier", barrier_body((0, 2), 0), timeout=5)
    await other
    await close(engs)


async def test_coordinator_notice_of_a_lost_member_fails_pending_ops() -> None:
    _, engs = engines(2)
    pending = await waiting_in_barrier(engs, "w", (0, 1), 0)
    engs[0].peer_lost(1, "silent for 10s")
    with pytest.raises(PeerLostError, match="silent"):
        await asyncio.wait_for(pending, 2)
    await close(engs)


async def test_a_rank_that_leaves_after_losing_another_names_the_lost_one_in_its_farewell() -> None:
    """Rank 1 lost rank 2 and leaves at once; rank 0, waiting in the same group, hears rank 1's
    farewell before it sees rank 2 go: it is told that rank 2 was lost, not that rank 1 left."""
    _, engs = engines(3)
    pending = await waiting_in_barrier(engs, "w", (0, 1, 2), 0)
    engs[1].peer_lost(2, "its link to rank 1 closed (killed)")
    await engs[1].aclose()
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(pending, 2)
    assert info.value.rank == 2 and not info.value.left, info.value
    assert "rank 1 lost it first, then left too (its link to rank 1 closed (killed))" in str(info.value)
    await close(engs)


async def test_a_loss_told_by_another_names_what_the_lost_ranks_own_link_said() -> None:
    """Rank 1 dies and, in the same turn of rank 0's loop, the coordinator's notice of it
    arrives: rank 0's pending operation names how its own link to rank 1 ended (the nearer
    evidence), not the notice; a notice alone, with the link still up, is named as it came."""
    world, engs = engines(3)
    pending = await waiting_in_barrier(engs, "w", (0, 1, 2), 0)
    world.kill(1)
    engs[0].peer_lost(1, "the coordinator's word")
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(pending, 2)
    own = world[0].take_in_from(1)
    assert own is not None and own.rank == 1 and "the coordinator's word" not in own.reason
    assert info.value.rank == 1 and info.value.reason == own.reason, info.value
    assert world[0].take_in_from(2) is None  # its link is up and holds nothing
    pending = await waiting_in_barrier(engs, "v", (0, 2), 2)
    engs[2].peer_lost(0, "the coordinator's word")
    with pytest.raises(PeerLostError, match="the coordinator's word"):
        await asyncio.wait_for(pending, 2)
    await close(engs)


async def test_mismatch_detected_on_one_rank_fails_every_rank_of_the_group() -> None:
    _, engs = engines(3)
    groups = [e.group("w", (0, 1, 2)) for e in engs]
    xs = [np.ones(4 if r != 1 else 8, np.float32) for r in range(3)]
    works = [
        engs[r].submit(groups[r], "all_reduce", all_reduce_body(xs[r], (0, 1, 2), r), timeout=10)
        for r in range(3)
    ]
    outcomes = await asyncio.gather(*works, return_exceptions=True)
    for r, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            assert isinstance(outcome, MismatchError), (r, outcome)
            assert outcome.seq == 0
        else:  # this rank completed before the others noticed: its next call says so
            with pytest.raises(MismatchError, match="seq 0"):
                engs[r].submit(groups[r], "barrier", barrier_body((0, 1, 2), r), timeout=1)
    assert any(isinstance(o, MismatchError) for o in outcomes)
    await close(engs)


async def test_cancelling_the_awaiting_task_does_not_cancel_the_operation() -> None:
    _, engs = engines(2)
    g = [e.group("w", (0, 1)) for e in engs]
    x0, x1 = np.ones(3), np.ones(3)
    w0 = engs[0].submit(g[0], "all_reduce", all_reduce_body(x0, (0, 1), 0), timeout=5)

    async def await_it() -> Any:
        return await w0

    task = asyncio.ensure_future(await_it())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not w0.is_completed()
    w1 = engs[1].submit(g[1], "all_reduce", all_reduce_body(x1, (0, 1), 1), timeout=5)
    await asyncio.gather(w0, w1)
    assert (x0 == 2).all() and (x1 == 2).all()
    await close(engs)


async def test_close_fails_pending_operations_and_refuses_new_ones() -> None:
    _, engs = engines(2)
    g = engs[0].group("w", (0, 1))
    pending = engs[0].submit(g, "barrier", barrier_body((0, 1), 0), timeout=5)
    await asyncio.sleep(0)
    await engs[0].aclose()
    with pytest.raises(DistError):
        await pending
    with pytest.raises(DistError):
        engs[0].submit(g, "barrier", barrier_body((0, 1), 0), timeout=5)
    await engs[1].aclose()


async def test_a_root_mismatch_where_disagreeing_ranks_only_send_is_still_detected() -> None:
    from test_tcp_transport import close_all, make_world

    ts = await make_world(3)
    engs = [Engine(t, default_timeout=10) for t in ts]
    groups = [e.group("w", (0, 1, 2)) for e in engs]

    def bcast(r: int, root: int) -> Any:
        x = np.full(4, r, np.float32)
        spec = CollectiveSpec("broadcast", (0, 1, 2), r, (), (x,), root=root)

        async def body(tag: Any, tp: Any) -> None:
            await run_collective(spec, tp, tag, {"kind": "broadcast", "root": root})

        return body

    works = [
        engs[r].submit(groups[r], "broadcast", bcast(r, 1 if r == 1 else 0), timeout=5) for r in range(3)
    ]
    await asyncio.gather(*works, return_exceptions=True)
    await asyncio.sleep(0.2)
    for r in range(3):
        with pytest.raises(MismatchError):
            await engs[r].submit(groups[r], "barrier", barrier_body((0, 1, 2), r), timeout=2)
    await close(engs)
    await close_all(ts)


async def test_a_loss_notice_about_this_rank_itself_breaks_nothing_here() -> None:
    _, engs = engines(2)
    g = [e.group("w", (0, 1)) for e in engs]
    engs[0].peer_lost(0, "silent for 10s")
    x0, x1 = np.ones(2), np.ones(2)
    await asyncio.gather(
        engs[0].submit(g[0], "all_reduce", all_reduce_body(x0, (0, 1), 0), timeout=5),
        engs[1].submit(g[1], "all_reduce", all_reduce_body(x1, (0, 1), 1), timeout=5),
    )
    assert (x0 == 2).all()
    await close(engs)
