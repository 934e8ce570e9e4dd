"""TCP transport: links, matching, zero-copy receive, loss, authentication (in one process, loopback)."""

from __future__ import annotations

import asyncio
import logging
import socket

import numpy as np
import pytest
from aiocoll.client.data.transports.tcp import TcpTransport, route_interface

from aiocoll._deadline import Deadline
from aiocoll._errors import AuthenticationError, MismatchError, PeerLostError, RendezvousError

pytestmark = pytest.mark.timeout(30)


async def make_world(n: int, *, token: str = "s3cret", job: str = "j", **kw: object) -> list[TcpTransport]:
    ts = [TcpTransport(r, n, token=token, job=job, **kw) for r in range(n)]  # type: ignore[arg-type]
    addrs = {r: [await t.listen("127.0.0.1")] for r, t in enumerate(ts)}
    await asyncio.gather(*(t.connect(addrs, Deadline(10)) for t in ts))
    return ts


async def close_all(ts: list[TcpTransport]) -> None:
    await asyncio.gather(*(t.aclose() for t in ts))


def test_route_interface_of_loopback_is_loopback() -> None:
    assert route_interface("127.0.0.1") == "127.0.0.1"


async def test_message_posted_before_arrival_lands_in_the_destination_buffer() -> None:
    a, b = await make_world(2)
    try:
        dst = np.zeros(1000, dtype=np.float64)
        recv = asyncio.ensure_future(b.recv(0, ("c", "g", 1, 0), memoryview(dst)))
        await asyncio.sleep(0)
        src = np.arange(1000, dtype=np.float64)
        await a.send(1, ("c", "g", 1, 0), memoryview(src), {"k": "x"})
        assert await recv == (0, {"k": "x"})
        np.testing.assert_array_equal(dst, src)
    finally:
        await close_all([a, b])


async def test_message_arriving_early_waits_in_inbox_and_same_tag_is_fifo() -> None:
    a, b = await make_world(2)
    try:
        for i in range(5):
            await b.send(0, ("p", "g", 7), memoryview(np.array([i], dtype=np.int32)), {})
        await asyncio.sleep(0.05)
        got = []
        for _ in range(5):
            out = np.zeros(1, dtype=np.int32)
            src, _meta = await a.recv(None, ("p", "g", 7), memoryview(out))
            assert src == 1
            got.append(int(out[0]))
        assert got == [0, 1, 2, 3, 4]
    finally:
        await close_all([a, b])


async def test_recv_from_any_source_returns_the_sender() -> None:
    ts = await make_world(3)
    try:
        await ts[2].send(0, ("p", "g", 1), memoryview(b"xy"), {})
        buf = bytearray(2)
        src, _ = await ts[0].recv(None, ("p", "g", 1), memoryview(buf))
        assert (src, bytes(buf)) == (2, b"xy")
    finally:
        await close_all(ts)


async def test_length_difference_raises_mismatch_with_sender_meta() -> None:
    a, b = await make_world(2)
    try:
        await a.send(1, ("c", "g", 3, 0), memoryview(b"abcd"), {"kind": "all_reduce"})
        with pytest.raises(MismatchError) as info:
            await b.recv(0, ("c", "g", 3, 0), memoryview(bytearray(8)))
        assert info.value.remote_meta == {"kind": "all_reduce"}  # type: ignore[attr-defined]
    finally:
        await close_all([a, b])


async def test_large_messages_both_ways_at_once_do_not_deadlock() -> None:
    a, b = await make_world(2)
    try:
        n = 8 * 1024 * 1024
        xa, xb = np.full(n, 1, np.uint8), np.full(n, 2, np.uint8)
        ya, yb = np.zeros(n, np.uint8), np.zeros(n, np.uint8)
        await asyncio.gather(
            a.send(1, ("t",), memoryview(xa), {}),
            b.send(0, ("t",), memoryview(xb), {}),
            a.recv(1, ("t",), memoryview(ya)),
            b.recv(0, ("t",), memoryview(yb)),
        )
        assert (ya == 2).all() and (yb == 1).all()
    finally:
        await close_all([a, b])


async def test_full_inbox_stops_reading_and_resumes_when_drained() -> None:
    a, b = await make_world(2, inbox_messages=4)
    try:
        sends = asyncio.gather(
            *(a.send(1, ("p", "q", i), memoryview(b"z" * 100_000), {}) for i in range(200))
        )
        await asyncio.sleep(0.2)
        assert b.matcher.buffered(0) <= 4 + 64  # one read event may finish a few more
        for i in range(200):
            buf = bytearray(100_000)
            await b.recv(0, ("p", "q", i), memoryview(buf))
            assert buf == b"z" * 100_000
        await asyncio.wait_for(sends, 10)
    finally:
        await close_all([a, b])


async def test_closed_link_fails_pending_and_later_operations_with_peer_lost() -> None:
    a, b = await make_world(2)
    lost: list[int] = []
    b.on_peer_lost(lambda rank, exc: lost.append(rank))
    pending = asyncio.ensure_future(b.recv(0, ("c", "g", 1, 0), memoryview(bytearray(4))))
    await asyncio.sleep(0.01)
    a._links[1].close("test cut", lost=True)  # an abrupt close, as when the process dies
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(pending, 5)
    assert info.value.rank == 0
    assert lost == [0]
    with pytest.raises(PeerLostError):
        await b.send(0, ("x",), memoryview(b"1"), {})
    await close_all([a, b])


async def test_orderly_close_fails_receives_and_tells_peer_lost_handlers_that_the_peer_left() -> None:
    # A peer that left is gone for whoever waits on it without a receive (a shared-memory arena,
    # an operation waiting on another rank that waits on it): the handlers hear it, as left.
    a, b = await make_world(2)
    lost: list[tuple[int, bool]] = []
    b.on_peer_lost(lambda rank, exc: lost.append((rank, getattr(exc, "left", None))))
    pending = asyncio.ensure_future(b.recv(0, ("c",), memoryview(bytearray(4))))
    await a.aclose()
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(pending, 5)
    assert info.value.left is True and "rank 0 left" in str(info.value)
    assert lost == [(0, True)]
    await b.aclose()
    assert lost == [(0, True)]  # closing ourselves afterwards tells nobody


async def test_discard_drops_buffered_and_late_messages() -> None:
    a, b = await make_world(2)
    try:
        await a.send(1, ("c", "g", 5, 0), memoryview(b"1"), {})
        await asyncio.sleep(0.05)
        b.discard(("c", "g", 5))
        await a.send(1, ("c", "g", 5, 1), memoryview(b"2"), {})
        await a.send(1, ("c", "g", 6, 0), memoryview(b"3"), {})
        buf = bytearray(1)
        await b.recv(0, ("c", "g", 6, 0), memoryview(buf))
        assert buf == b"3"
        assert b.matcher.buffered(0) == 0
    finally:
        await close_all([a, b])


async def _raw_connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_garbage_and_wrong_token_on_peer_port_are_refused_and_links_keep_working(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    a, b = await make_world(2)
    try:
        assert a.address is not None
        _, w = await _raw_connect(a.address[1])
        w.write(b"GET / HTTP/1.1\r\n\r\n" * 10)
        await w.drain()
        intruder = TcpTransport(1, 2, token="wrong", job="j")
        with pytest.raises(AuthenticationError):
            await intruder.connect({0: [a.address]}, Deadline(2))
        await intruder.aclose()
        w.close()
        for _ in range(100):
            if a.rejected >= 2:
                break
            await asyncio.sleep(0.02)
        assert a.rejected >= 2
        assert "refused a peer connection" in caplog.text
        await b.send(0, ("ok",), memoryview(b"fine"), {})
        buf = bytearray(4)
        assert (await a.recv(1, ("ok",), memoryview(buf)))[0] == 1 and buf == b"fine"
    finally:
        await close_all([a, b])


async def test_connect_names_the_ranks_that_never_linked() -> None:
    t = TcpTransport(0, 3, token="s", job="j")
    await t.listen("127.0.0.1")
    with pytest.raises(RendezvousError, match=r"\[1, 2\]"):
        await t.connect({}, Deadline(0.3))
    await t.aclose()


async def test_send_to_self_is_delivered() -> None:
    (t,) = await make_world(1)
    await t.send(0, ("s",), memoryview(b"me"), {"a": 1})
    buf = bytearray(2)
    assert await t.recv(0, ("s",), memoryview(buf)) == (0, {"a": 1})
    assert buf == b"me"
    await t.aclose()


async def test_many_small_messages_completed_by_one_read_each_reach_their_own_recv() -> None:
    a, b = await make_world(2)
    try:
        outs = [np.zeros(3, np.int64) for _ in range(50)]
        recvs = [asyncio.ensure_future(b.recv(0, ("c", "g", i, 1), memoryview(outs[i]))) for i in range(50)]
        await asyncio.sleep(0.01)
        for i in range(50):  # back to back: the kernel coalesces them into a few reads
            await a.send(1, ("c", "g", i, 1), memoryview(np.full(3, i, np.int64)), {"i": i})
        metas = await asyncio.wait_for(asyncio.gather(*recvs), 5)
        assert [m for _, m in metas] == [{"i": i} for i in range(50)]
        for i in range(50):
            assert (outs[i] == i).all()
    finally:
        await close_all([a, b])


async def test_recv_landed_leaves_an_early_payload_where_it_arrived_and_lands_a_late_one_in_place() -> None:
    a, b = await make_world(2)
    try:
        early = np.arange(100_000, dtype=np.float32)  # above the size whose early landing skips zeroing
        await a.send(1, ("c", "g", 0, 0), early.data, {"k": "early"})
        await asyncio.sleep(0.05)
        into = np.zeros_like(early)
        src, meta, landed = await b.recv_landed(0, ("c", "g", 0, 0), into.data)
        assert (src, meta) == (0, {"k": "early"})
        np.testing.assert_array_equal(np.frombuffer(landed, np.float32), early)
        assert not into.any()  # not copied: the caller reads the payload where it is

        late = asyncio.ensure_future(b.recv_landed(0, ("c", "g", 0, 1), into.data))
        await asyncio.sleep(0.01)
        await a.send(1, ("c", "g", 0, 1), (early * 2).data, {"k": "late"})
        src, meta, landed = await asyncio.wait_for(late, 10)
        assert meta == {"k": "late"} and landed.obj is into.data.obj
        np.testing.assert_array_equal(into, early * 2)

        wrong = asyncio.ensure_future(b.recv_landed(0, ("c", "g", 0, 2), into.data))
        await a.send(1, ("c", "g", 0, 2), early[:10].data, {"k": "short"})
        with pytest.raises(MismatchError):
            await asyncio.wait_for(wrong, 10)
    finally:
        await close_all([a, b])


async def test_large_payloads_raise_the_wake_up_mark_and_small_frames_after_them_still_arrive() -> None:
    """Inside a large payload the link asks to be woken only after a good part of the rest
    arrived (SO_RCVLOWAT); at every frame boundary, and while reading is paused for a full
    inbox, the mark is back at one byte so a small frame behind a large one is never stranded."""
    a, b = await make_world(2, inbox_messages=1)
    try:
        big = np.arange(48 << 20, dtype=np.uint8)  # more than the kernel buffers of a link hold
        marks: list[int] = []
        link = b._links[0]
        sock = link.sock
        original = link._wake_after

        def spy(remaining: int) -> None:
            original(remaining)
            marks.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))

        link._wake_after = spy  # type: ignore[method-assign]
        for round_ in range(3):
            into = np.zeros_like(big)
            small = np.zeros(1, np.uint8)
            posted = asyncio.ensure_future(b.recv(0, ("p", "big", round_), into.data))
            await asyncio.sleep(0)
            # the small frames arrive unexpected: the one-message inbox pauses reading behind them
            await asyncio.gather(
                a.send(1, ("p", "big", round_), big.data, {}),
                a.send(1, ("p", "small", round_), np.full(1, 7, np.uint8).data, {}),
                a.send(1, ("p", "small2", round_), np.full(1, 8, np.uint8).data, {}),
            )
            await asyncio.wait_for(posted, 10)
            np.testing.assert_array_equal(into, big)
            await asyncio.wait_for(b.recv(0, ("p", "small", round_), small.data), 10)
            assert small[0] == 7
            await asyncio.wait_for(b.recv(0, ("p", "small2", round_), small.data), 10)
            assert small[0] == 8
        assert max(marks) > 1  # raised inside the large payloads
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
    finally:
        await close_all([a, b])
