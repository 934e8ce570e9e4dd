"""Point-to-point send/recv between real worker processes: matching, tags, sources, errors."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import run_world, unwrap

try:  # imported before any loop runs (a slow import inside a worker stalls its loop)
    import torch
except ImportError:  # pragma: no cover
    torch = None

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

N = 3


async def worker(pg: Any) -> dict[str, Any]:
    from aiocoll import CollectiveTimeout, MismatchError

    r, n = pg.rank, pg.size
    out: dict[str, Any] = {}

    # rank 0 -> 1 with a tag; the awaited value of recv is the source rank
    if r == 0:
        assert await pg.send(np.arange(5, dtype=np.float64), dst=1, tag=7) is None
    elif r == 1:
        buf = np.zeros(5, np.float64)
        out["src"] = await pg.recv(buf, src=0, tag=7)
        out["buf"] = buf

    # recv from any source returns who sent it
    if r == 2:
        got = []
        for _ in range(n - 1):
            b = np.zeros(1, np.int32)
            src = await pg.recv(b, tag=3)
            got.append((src, int(b[0])))
        out["any"] = sorted(got)
    else:
        await pg.send(np.array([100 + r], np.int32), dst=2, tag=3)

    # same source and tag: messages match in the order they were sent; tags keep streams apart
    if r == 0:
        for i in range(20):
            pg.isend(np.array([i], np.int64), dst=1, tag=i % 2)
        await pg.barrier()
    elif r == 1:
        odd = [np.zeros(1, np.int64) for _ in range(10)]
        even = [np.zeros(1, np.int64) for _ in range(10)]
        works = [pg.irecv(o, src=0, tag=1) for o in odd] + [pg.irecv(e, src=0, tag=0) for e in even]
        await asyncio.gather(*works)
        out["odd"] = [int(o[0]) for o in odd]
        out["even"] = [int(e[0]) for e in even]
        await pg.barrier()
    else:
        await pg.barrier()

    # every rank sends right and receives from the left at the same time (no deadlock), large
    big = np.full(2_000_000, r, np.float32)
    into = np.zeros_like(big)
    w_send = pg.isend(big, dst=(r + 1) % n, tag=11)
    w_recv = pg.irecv(into, src=(r - 1) % n, tag=11)
    await asyncio.gather(w_send, w_recv)
    out["ring_ok"] = bool((into == (r - 1) % n).all())

    # torch tensors, non-contiguous receive buffer
    if torch is not None:
        if r == 0:
            await pg.send(torch.arange(6, dtype=torch.int16), dst=2)
        elif r == 2:
            t = torch.zeros(3, 4, dtype=torch.int16)[:, ::2]
            await pg.recv(t, src=0)
            out["torch"] = t.contiguous().numpy().tolist()

    # the straight path: a small send that the link takes at once, and a receive whose message
    # is here already, complete inside their call (a Work born complete, done before any await)
    if r == 0:
        sent = pg.send(np.array([7], np.int32), dst=1, tag=30)
        out["send_born_complete"] = sent.is_completed()
        await sent
        await pg.barrier()
    elif r == 1:
        await pg.barrier()  # rank 0 handed its message to the kernel before it entered the barrier
        b = np.zeros(1, np.int32)
        received = pg.recv(b, src=0, tag=30)
        out["recv_born_complete"] = (received.is_completed(), await received, int(b[0]))
    else:
        await pg.barrier()

    # receives of one tag match in the order they were made, also when an earlier one waits
    # (its message not here yet) and a later one finds the messages already arrived
    if r == 0:
        await pg.barrier()
        await asyncio.sleep(0.05)  # after rank 1's first receive was made
        await pg.send(np.array([1], np.int32), dst=1, tag=40)
        await pg.send(np.array([2, 3], np.int32), dst=1, tag=40)
    elif r == 1:
        await pg.barrier()
        first, second = np.zeros(1, np.int32), np.zeros(2, np.int32)
        waiting = pg.recv(first, src=0, tag=40)
        time.sleep(0.3)  # noqa: ASYNC251 (on purpose: the first receive must not run meanwhile)
        try:
            await asyncio.gather(waiting, pg.recv(second, src=0, tag=40))
            out["in_order"] = (first.tolist(), second.tolist())
        except MismatchError as exc:
            out["in_order"] = str(exc)
    else:
        await pg.barrier()

    # a wrong dtype or size on the receiving side is a MismatchError for that recv: sent while the
    # receive waits (20, 21), and there before the receive is made (22, 23: its straight path,
    # which makes no record until it meets the mismatch); the stream stays in step after it
    async def wrong_receives(first: int) -> None:
        for tag, buf in ((first, np.zeros(4, np.int32)), (first + 1, np.zeros(5, np.float32))):
            try:
                await pg.recv(buf, src=0, tag=tag)
                out[f"mismatch{tag}"] = "no error"
            except MismatchError as exc:
                out[f"mismatch{tag}"] = str(exc)

    for first in (20, 22):
        if r == 0:
            await pg.send(np.ones(4, np.float32), dst=1, tag=first)
            await pg.send(np.ones(4, np.float32), dst=1, tag=first + 1)
        if first == 22:
            await pg.barrier()
        if r == 1:
            await wrong_receives(first)
    if r == 0:
        await pg.send(np.arange(3, dtype=np.float32), dst=1, tag=24)
    elif r == 1:
        after = np.zeros(3, np.float32)
        waiting = pg.recv(after, src=0, tag=24)
        out["after_mismatch"] = (await waiting, after.tolist())

    # p2p inside a sub-group uses the sub-group's ranks
    sub = await pg.new_group([1, 2])
    if sub is not None:
        if sub.rank == 0:
            await sub.send(np.array([42], np.int8), dst=1)
        else:
            b = np.zeros(1, np.int8)
            out["sub_src"] = await sub.recv(b, src=0)
            out["sub_val"] = int(b[0])

    # a recv nobody answers times out naming the silent rank (on a throwaway group)
    lonely = await pg.new_group([0, 1])
    if lonely is not None and lonely.rank == 0:
        t0 = time.monotonic()
        try:
            await lonely.recv(np.zeros(1), src=1, tag=99, timeout=0.5)
            out["timeout"] = "no error"
        except CollectiveTimeout as exc:
            out["timeout"] = (exc.missing_ranks, exc.op, time.monotonic() - t0)

    # bad ranks and tags are refused at the call; numpy integers are ranks and tags like ints
    bad: list[str] = []
    for call in (
        lambda: pg.send(np.zeros(1), dst=r),
        lambda: pg.send(np.zeros(1), dst=n),
        lambda: pg.send(np.zeros(1), dst=-1),
        lambda: pg.send(np.zeros(1), dst=True),
        lambda: pg.send(np.zeros(1), dst=1.0),
        lambda: pg.send(np.zeros(1), dst=(r + 1) % n, tag=1.0),
        lambda: pg.send(np.zeros(1), dst=(r + 1) % n, tag=False),
        lambda: pg.recv(np.zeros(1), src=r),
        lambda: pg.recv(np.zeros(1), src=n),
        lambda: pg.recv(np.zeros(1), src=False),
        lambda: pg.recv(np.zeros(1), src=(r + 1) % n, tag="a"),
        lambda: pg.recv(np.zeros(1), tag=None),
    ):
        try:
            call()
            bad.append("no error")
        except (TypeError, ValueError) as exc:
            bad.append(type(exc).__name__)
    out["bad_args"] = bad
    if r == 0:
        await pg.send(np.array([5], np.int16), dst=np.int64(1), tag=np.int32(11))
    elif r == 1:
        b = np.zeros(1, np.int16)
        out["numpy_args"] = (await pg.recv(b, src=np.int8(0), tag=np.int64(11)), int(b[0]))
    await pg.barrier()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return unwrap(run_world(worker, N, timeout=100))


def test_send_recv_with_tag_returns_the_source(results: list[dict[str, Any]]) -> None:
    assert results[1]["src"] == 0
    np.testing.assert_array_equal(results[1]["buf"], np.arange(5, dtype=np.float64))


def test_recv_from_any_source_returns_each_sender(results: list[dict[str, Any]]) -> None:
    assert results[2]["any"] == [(0, 100), (1, 101)]


def test_same_tag_is_fifo_and_tags_are_separate_streams(results: list[dict[str, Any]]) -> None:
    assert results[1]["odd"] == list(range(1, 20, 2))
    assert results[1]["even"] == list(range(0, 20, 2))


def test_simultaneous_large_exchange_around_a_ring(results: list[dict[str, Any]]) -> None:
    assert all(res["ring_ok"] for res in results)


def test_torch_tensor_into_noncontiguous_buffer(results: list[dict[str, Any]]) -> None:
    pytest.importorskip("torch")
    assert results[2]["torch"] == [[0, 1], [2, 3], [4, 5]]


def test_small_send_and_a_receive_whose_message_is_here_complete_inside_their_call(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["send_born_complete"] is True
    assert results[1]["recv_born_complete"] == (True, 0, 7)


def test_receives_of_one_tag_match_in_the_order_they_were_made(results: list[dict[str, Any]]) -> None:
    assert results[1]["in_order"] == ([1], [2, 3])


def test_wrong_dtype_or_size_on_recv_is_a_mismatch(results: list[dict[str, Any]]) -> None:
    assert "float32" in results[1]["mismatch20"] and "int32" in results[1]["mismatch20"]
    assert "bytes" in results[1]["mismatch21"] or "size" in results[1]["mismatch21"]


def test_a_message_there_before_its_receive_is_checked_the_same_way(results: list[dict[str, Any]]) -> None:
    assert "float32" in results[1]["mismatch22"] and "int32" in results[1]["mismatch22"]
    assert "bytes" in results[1]["mismatch23"] or "size" in results[1]["mismatch23"]
    assert results[1]["after_mismatch"] == (0, [0.0, 1.0, 2.0])


def test_p2p_in_a_subgroup_uses_group_ranks(results: list[dict[str, Any]]) -> None:
    assert results[2]["sub_src"] == 0 and results[2]["sub_val"] == 42


def test_unanswered_recv_times_out_naming_the_silent_rank(results: list[dict[str, Any]]) -> None:
    missing, op, elapsed = results[0]["timeout"]
    assert missing == [1] and op == "recv"
    assert elapsed < 5.0


def test_bad_ranks_and_tags_are_refused_and_numpy_integers_accepted(results: list[dict[str, Any]]) -> None:
    want = ["ValueError"] * 3 + ["TypeError"] * 4 + ["ValueError"] * 2 + ["TypeError"] * 3
    assert all(res["bad_args"] == want for res in results), [res["bad_args"] for res in results]
    assert results[1]["numpy_args"] == (0, 5)
