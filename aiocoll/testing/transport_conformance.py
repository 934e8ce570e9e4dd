"""One conformance suite for the Transport interface over every link kind: memory, tcp, shm...

Part of the public testing surface; imports pytest, aiocoll's foundations and the link kinds of
client/data/transports. The Transport (aiocoll/algorithms/_transport.py) of a worker is a
LinkTransport whose per-peer links are of some kind (client/data/transports/_link_interface.py); this suite
runs every method the engine and the driver call (send, send_nowait, recv, recv_landed,
post_recv, post_recv_landed, discard, retire/on_stray, on_peer_lost, mark_lost, lost_peers,
debug_state, aclose, abort) over a world whose links are all of one kind, for each kind in
``LINK_KINDS``, including cancellation, backpressure, any-source after a loss, early arrival,
strays, size mismatch and close twice. A new link kind adds one entry to ``LINK_KINDS`` (an
async ``make(n, **bounds)``
returning n linked transports, index = rank) and is covered by everything below:

    @pytest.fixture(params=sorted(LINK_KINDS))
    async def make_world(request):
        made = []
        async def make(n, **bounds):
            made.append(await LINK_KINDS[request.param](n, **bounds))
            return made[-1]
        yield make
        for world in made:
            await close_world(world)

    @pytest.fixture
    def kill_rank():
        return abort_rank

    class TestLinkConformance(TransportConformance): ...

``bounds`` are ``inbox_messages`` and ``inbox_bytes`` (the per-source inbox bounds). ``kill_rank``
(plain or async) makes a rank vanish the way a crashed process would (no goodbye), so the others
see PeerLostError naming it. Waits are bounded (``_LIMIT``) so a broken transport fails instead
of hanging.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from .._deadline import Deadline
from .._errors import DistError, MismatchError, PeerLostError
from ..algorithms._transport import Transport
from ..client.data.transports._factory import PeerRow, connect_links, listen_addresses
from ..client.data.transports._link import Link, LinkTransport
from ..client.data.transports.memory import MemoryWorld
from ..client.data.transports.tcp import TcpTransport

__all__ = [
    "LINK_KINDS",
    "KillRank",
    "MakeWorld",
    "TransportConformance",
    "abort_rank",
    "close_world",
    "memory_world",
    "shm_world",
    "tcp_world",
]

MakeWorld = Callable[..., Awaitable[list[Transport]]]
KillRank = Callable[[list[Transport], int], Any]

# Generous for a loaded 2-core machine; only a hang comes near it.
_LIMIT = 10.0
# How long we watch for something that must not happen.
_QUIET = 0.2
_META = {"kind": "test", "count": 3}


async def memory_world(n: int, **bounds: int) -> list[Transport]:
    """n transports linked by memory links."""
    world = MemoryWorld(
        n,
        max_inbox_messages=bounds.get("inbox_messages", 4096),
        max_inbox_bytes=bounds.get("inbox_bytes", 64 * 1024 * 1024),
    )
    return list(world.transports)


async def tcp_world(n: int, **bounds: int) -> list[Transport]:
    """n transports linked by tcp links over loopback."""
    ts = [TcpTransport(r, n, token="conformance", job="conformance", **bounds) for r in range(n)]
    addrs = {r: [await t.listen("127.0.0.1")] for r, t in enumerate(ts)}
    await asyncio.gather(*(t.connect(addrs, Deadline(_LIMIT)) for t in ts))
    return list(ts)


async def shm_world(n: int, **bounds: int) -> list[Transport]:
    """n transports of one host linked by shm links (authenticated Unix sockets carrying the
    frames; each side's arena mapped by the other), made by the link factory with the setting
    ``shm``."""
    ts = [TcpTransport(r, n, token="conformance", job="conformance", **bounds) for r in range(n)]
    addrs = [
        await listen_addresses(t, "127.0.0.1", token="conformance", job="conformance", choice="shm")
        for t in ts
    ]
    table = [PeerRow(r, addrs[r], "one-host") for r in range(n)]
    await asyncio.gather(*(connect_links(t, table, Deadline(_LIMIT), "shm") for t in ts))
    for t in ts:
        assert set(t.link_kinds().values()) <= {"shm"}, t.link_kinds()
    return list(ts)


LINK_KINDS: dict[str, Callable[..., Awaitable[list[Transport]]]] = {
    "memory": memory_world,
    "tcp": tcp_world,
    "shm": shm_world,
}


def abort_rank(world: list[Transport], rank: int) -> None:
    """Make ``rank`` vanish without goodbye (what its peers see is a crash)."""
    victim = world[rank]
    assert isinstance(victim, LinkTransport)
    victim.abort()


async def close_world(world: list[Transport]) -> None:
    await asyncio.gather(*(t.aclose() for t in world))


def _buf(n: int) -> bytearray:
    return bytearray(n)


async def _recv(
    t: Transport, src: int | None, tag: tuple[Any, ...], n: int
) -> tuple[int, dict[str, Any], bytes]:
    into = _buf(n)
    source, meta = await asyncio.wait_for(t.recv(src, tag, memoryview(into)), _LIMIT)
    return source, meta, bytes(into)


async def _recv_now(
    t: Transport, src: int | None, tag: tuple[Any, ...], n: int
) -> tuple[int, dict[str, Any], bytes]:
    """``recv_now`` until the message has come (it returns None, posting nothing, until then)."""
    into = _buf(n)
    for _ in range(int(_LIMIT / 0.001)):
        got = t.recv_now(src, tag, memoryview(into))
        if got is not None:
            return got[0], got[1], bytes(into)
        await asyncio.sleep(0.001)
    raise AssertionError(f"recv_now of {tag!r} did not complete within {_LIMIT} s")


async def _kill(kill_rank: KillRank, world: list[Transport], rank: int) -> None:
    result = kill_rank(world, rank)
    if inspect.isawaitable(result):
        await result


async def _eventually(check: Callable[[], bool], what: str) -> None:
    for _ in range(int(_LIMIT / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {_LIMIT} s: {what}")


def _buffered(t: Transport, peer: int) -> int:
    return int(t.debug_state()["buffered"].get(peer, (0, 0))[0])


class _Posted:
    """A post_recv callback that records its one outcome."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[Any, BaseException | None]] = []
        self.event = asyncio.Event()

    def __call__(self, result: Any, exc: BaseException | None) -> None:
        self.outcomes.append((result, exc))
        self.event.set()

    async def outcome(self) -> tuple[Any, BaseException | None]:
        await asyncio.wait_for(self.event.wait(), _LIMIT)
        assert len(self.outcomes) == 1, self.outcomes
        return self.outcomes[0]


class TransportConformance:
    """Mixin of behaviour tests; subclasses provide ``make_world`` and ``kill_rank`` fixtures."""

    @pytest.mark.timeout(60)
    async def test_send_then_recv_delivers_exact_bytes_meta_and_source(self, make_world: MakeWorld) -> None:
        a, b = await make_world(2)
        for size in (0, 1, 7, 4096, 1 << 20):
            payload = bytes((i * 31 + size) % 256 for i in range(size))
            await asyncio.wait_for(
                a.send(1, ("t", size), memoryview(payload), {**_META, "size": size}), _LIMIT
            )
            src, meta, data = await _recv(b, 0, ("t", size), size)
            assert (src, data) == (0, payload)
            assert meta == {**_META, "size": size}

    @pytest.mark.timeout(60)
    async def test_recv_posted_before_send_completes_when_message_arrives(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        pending = asyncio.ensure_future(_recv(b, 0, ("early",), 5))
        await asyncio.sleep(0.01)
        assert not pending.done()
        await a.send(1, ("early",), memoryview(b"hello"), _META)
        assert await pending == (0, _META, b"hello")

    @pytest.mark.timeout(60)
    async def test_sender_may_reuse_its_buffer_once_send_returned(self, make_world: MakeWorld) -> None:
        a, b = await make_world(2)
        payload = bytearray(b"abcdef")
        await a.send(1, ("reuse",), memoryview(payload), _META)
        payload[:] = b"XXXXXX"
        assert (await _recv(b, 0, ("reuse",), 6))[2] == b"abcdef"

    @pytest.mark.timeout(60)
    async def test_messages_with_different_tags_match_in_any_order(self, make_world: MakeWorld) -> None:
        a, b = await make_world(2)
        for i in range(5):
            await a.send(1, ("c", "g", 7, i), memoryview(bytes([i]) * 3), _META)
        for i in (4, 1, 3, 0, 2):
            assert (await _recv(b, 0, ("c", "g", 7, i), 3))[2] == bytes([i]) * 3

    @pytest.mark.timeout(60)
    async def test_messages_with_the_same_tag_arrive_in_send_order(self, make_world: MakeWorld) -> None:
        a, b = await make_world(2)
        for i in range(20):
            await a.send(1, ("p", "g", 0), memoryview(i.to_bytes(4, "little")), _META)
        got = [int.from_bytes((await _recv(b, 0, ("p", "g", 0), 4))[2], "little") for _ in range(20)]
        assert got == list(range(20))

    @pytest.mark.timeout(60)
    async def test_recv_from_any_source_returns_the_sender(self, make_world: MakeWorld) -> None:
        world = await make_world(4)
        await world[2].send(0, ("any",), memoryview(b"two"), _META)
        src, _, data = await _recv(world[0], None, ("any",), 3)
        assert (src, data) == (2, b"two")
        # The same tag from several senders: each message is received exactly once.
        for r in (1, 3):
            await world[r].send(0, ("any",), memoryview(bytes([r]) * 3), _META)
        sources = sorted([(await _recv(world[0], None, ("any",), 3))[0] for _ in range(2)])
        assert sources == [1, 3]

    @pytest.mark.timeout(60)
    async def test_recv_from_a_specific_source_ignores_other_senders(self, make_world: MakeWorld) -> None:
        world = await make_world(3)
        await world[1].send(0, ("x",), memoryview(b"one"), _META)
        await world[2].send(0, ("x",), memoryview(b"two"), _META)
        assert (await _recv(world[0], 2, ("x",), 3))[:1] == (2,)
        assert (await _recv(world[0], 1, ("x",), 3))[2] == b"one"

    @pytest.mark.timeout(60)
    async def test_size_mismatch_raises_mismatch_error_and_consumes_the_message(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        await a.send(1, ("size",), memoryview(b"12345678"), {**_META, "count": 8})
        await a.send(1, ("size",), memoryview(b"abcd"), _META)
        with pytest.raises(MismatchError) as info:
            await _recv(b, 0, ("size",), 4)
        assert getattr(info.value, "remote_meta", None) == {**_META, "count": 8}
        assert (await _recv(b, 0, ("size",), 4))[2] == b"abcd"

    @pytest.mark.timeout(60)
    async def test_recv_now_takes_messages_by_tag_in_order_behind_posted_receives(
        self, make_world: MakeWorld
    ) -> None:
        """recv_now completes a receive within its call once the message is here: by tag, in
        send order, after a receive posted before it, small or large, a payload of another size
        failing it with MismatchError (consumed); until then it returns None and posts nothing."""
        a, b = await make_world(2)
        assert b.recv_now(0, ("none",), memoryview(bytearray(4))) is None
        await a.send(1, ("none",), memoryview(b"zzzz"), _META)
        assert (await _recv(b, 0, ("none",), 4))[2] == b"zzzz"  # nothing was left posted
        # alone on the link, then behind a message of another tag
        await a.send(1, ("now", "size"), memoryview(b"12345678"), {**_META, "count": 8})
        with pytest.raises(MismatchError) as info:
            await _recv_now(b, 0, ("now", "size"), 4)
        assert getattr(info.value, "remote_meta", None) == {**_META, "count": 8}
        await a.send(1, ("now", "alone"), memoryview(b"xy"), _META)
        assert await _recv_now(b, 0, ("now", "alone"), 2) == (0, _META, b"xy")
        await a.send(1, ("now", "other"), memoryview(b"xy"), _META)
        assert b.recv_now(0, ("now",), memoryview(bytearray(4))) is None  # (another tag's)
        for data in (b"aaaa", b"bbbb"):
            await a.send(1, ("now",), memoryview(data), _META)
        assert await _recv_now(b, 0, ("now",), 4) == (0, _META, b"aaaa")
        assert await _recv_now(b, 0, ("now",), 4) == (0, _META, b"bbbb")
        assert (await _recv(b, 0, ("now", "other"), 2))[2] == b"xy"
        # a large payload, then a small one of the same tag
        big = bytes(range(256)) * 800
        await a.send(1, ("now", "big"), memoryview(big), _META)
        await a.send(1, ("now", "big"), memoryview(b"tail"), _META)
        assert (await _recv_now(b, 0, ("now", "big"), len(big)))[2] == big
        assert (await _recv_now(b, 0, ("now", "big"), 4))[2] == b"tail"
        # a receive posted first takes the first message
        posted = asyncio.ensure_future(_recv(b, 0, ("now", "posted"), 4))
        await asyncio.sleep(0.01)
        for data in (b"1111", b"2222"):
            await a.send(1, ("now", "posted"), memoryview(data), _META)
        assert (await _recv_now(b, 0, ("now", "posted"), 4))[2] == b"2222"
        assert (await posted)[2] == b"1111"

    @pytest.mark.timeout(60)
    async def test_both_ranks_sending_large_messages_to_each_other_do_not_deadlock(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        big = 8 << 20
        pa, pb = bytes([1]) * big, bytes([2]) * big

        async def exchange(t: Transport, peer: int, payload: bytes) -> bytes:
            send = asyncio.ensure_future(t.send(peer, ("big",), memoryview(payload), _META))
            _, _, data = await _recv(t, peer, ("big",), big)
            await asyncio.wait_for(send, _LIMIT)
            return data

        got_a, got_b = await asyncio.gather(exchange(a, 1, pa), exchange(b, 0, pb))
        assert got_a == pb and got_b == pa

    @pytest.mark.timeout(60)
    async def test_many_unexpected_messages_are_all_delivered(self, make_world: MakeWorld) -> None:
        # 64 messages of 1000 bytes wait in the inbox before the first recv: any sane bound holds them.
        a, b = await make_world(2)

        async def sender() -> None:
            for i in range(64):
                await a.send(1, ("many", i), memoryview(bytes([i % 256]) * 1000), _META)

        task = asyncio.ensure_future(sender())
        for i in reversed(range(64)):
            assert (await _recv(b, 0, ("many", i), 1000))[2] == bytes([i % 256]) * 1000
        await asyncio.wait_for(task, _LIMIT)

    @pytest.mark.timeout(60)
    async def test_pending_recv_from_a_killed_rank_raises_peer_lost_naming_it(
        self, make_world: MakeWorld, kill_rank: KillRank
    ) -> None:
        world = await make_world(3)
        seen: list[int] = []
        world[0].on_peer_lost(lambda rank, exc: seen.append(rank))
        pending = asyncio.ensure_future(_recv(world[0], 2, ("dead",), 4))
        await asyncio.sleep(0.01)
        await _kill(kill_rank, world, 2)
        with pytest.raises(PeerLostError) as info:
            await pending
        assert info.value.rank == 2
        for _ in range(int(_LIMIT / 0.01)):
            if seen:
                break
            await asyncio.sleep(0.01)
        assert seen == [2]

    @pytest.mark.timeout(60)
    async def test_recv_and_send_after_a_peer_was_lost_fail_at_once(
        self, make_world: MakeWorld, kill_rank: KillRank
    ) -> None:
        world = await make_world(3)
        lost = asyncio.Event()
        world[0].on_peer_lost(lambda rank, exc: lost.set())
        await _kill(kill_rank, world, 1)
        await asyncio.wait_for(lost.wait(), _LIMIT)
        with pytest.raises(PeerLostError) as info:
            await _recv(world[0], 1, ("later",), 1)
        assert info.value.rank == 1
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(world[0].send(1, ("later",), memoryview(b"x"), _META), _LIMIT)
        # The surviving link still works.
        await world[2].send(0, ("alive",), memoryview(b"ok"), _META)
        assert (await _recv(world[0], 2, ("alive",), 2))[2] == b"ok"

    @pytest.mark.timeout(60)
    async def test_discard_drops_buffered_messages_and_cancels_waiting_recvs(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        await a.send(1, ("c", "g", 1, 0), memoryview(b"old"), _META)
        await a.send(1, ("c", "g", 2, 0), memoryview(b"new"), _META)
        await asyncio.sleep(0.05)  # let a network transport deliver both before the discard
        waiting = asyncio.ensure_future(b.recv(0, ("c", "g", 1, 5), memoryview(bytearray(3))))
        await asyncio.sleep(0.01)
        b.discard(("c", "g", 1))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, _LIMIT)
        stale = asyncio.ensure_future(b.recv(0, ("c", "g", 1, 0), memoryview(bytearray(3))))
        done, _ = await asyncio.wait({stale}, timeout=_QUIET)
        assert not done, "a discarded message was still delivered"
        stale.cancel()
        assert (await _recv(b, 0, ("c", "g", 2, 0), 3))[2] == b"new"

    @pytest.mark.timeout(60)
    async def test_aclose_twice_is_fine_and_fails_pending_recvs(self, make_world: MakeWorld) -> None:
        _, b = await make_world(2)
        pending = asyncio.ensure_future(b.recv(0, ("closing",), memoryview(bytearray(1))))
        await asyncio.sleep(0.01)
        await asyncio.wait_for(b.aclose(), _LIMIT)
        await asyncio.wait_for(b.aclose(), _LIMIT)
        with pytest.raises(DistError):
            await asyncio.wait_for(pending, _LIMIT)

    @pytest.mark.timeout(60)
    async def test_peers_of_a_closed_transport_see_peer_lost(self, make_world: MakeWorld) -> None:
        a, b = await make_world(2)
        pending = asyncio.ensure_future(a.recv(1, ("bye",), memoryview(bytearray(1))))
        await asyncio.sleep(0.01)
        await b.aclose()
        with pytest.raises(PeerLostError) as info:
            await asyncio.wait_for(pending, _LIMIT)
        assert info.value.rank == 1

    @pytest.mark.timeout(60)
    async def test_a_peer_that_closes_in_order_is_told_to_the_lost_peer_handlers_as_left(
        self, make_world: MakeWorld
    ) -> None:
        # Whoever waits on a peer without a receive of its own (a shared-memory arena, an
        # operation waiting on a rank that waits on the one gone) hears of it from the handlers.
        world = await make_world(3)
        seen: list[tuple[int, Any]] = []
        world[0].on_peer_lost(lambda rank, exc: seen.append((rank, getattr(exc, "left", None))))
        pending = asyncio.ensure_future(_recv(world[0], 2, ("leaving",), 1))
        await asyncio.sleep(0.01)
        await asyncio.wait_for(world[2].aclose(), _LIMIT)
        with pytest.raises(PeerLostError) as info:
            await asyncio.wait_for(pending, _LIMIT)
        assert info.value.rank == 2 and info.value.left is True
        await _eventually(lambda: seen == [(2, True)], "rank 0's handlers hear that rank 2 left")
        with pytest.raises(PeerLostError) as later:
            await _recv(world[0], 2, ("later",), 1)
        assert later.value.left is True
        # the rank that is still there is untouched
        await world[1].send(0, ("alive",), memoryview(b"ok"), _META)
        assert (await _recv(world[0], 1, ("alive",), 2))[2] == b"ok"
        assert seen == [(2, True)]

    @pytest.mark.timeout(60)
    async def test_a_message_sent_before_its_sender_closed_is_held_and_still_received(
        self, make_world: MakeWorld
    ) -> None:
        # The engine lets a receive from a rank that left through when the transport holds a
        # message of it (``holds``): what it sent before it left is received, nothing else.
        world = await make_world(2)
        await world[1].send(0, ("before",), memoryview(b"sent"), _META)
        await _eventually(lambda: world[0].holds(1, ("before",)), "rank 0 holds rank 1's message")
        assert not world[0].holds(1, ("other",)) and not world[0].holds(0, ("before",))
        await asyncio.wait_for(world[1].aclose(), _LIMIT)
        await _eventually(lambda: 1 in world[0].lost_peers, "rank 0 sees that rank 1 closed")
        assert world[0].holds(1, ("before",))
        assert (await _recv(world[0], 1, ("before",), 4))[2] == b"sent"
        assert not world[0].holds(1, ("before",))
        with pytest.raises(PeerLostError) as later:
            await _recv(world[0], 1, ("before",), 4)
        assert later.value.left is True

    # -- every link kind is a Link, and declares what the transport calls ------------------------
    @pytest.mark.timeout(60)
    async def test_every_peer_has_one_link_that_implements_the_link_interface(
        self, make_world: MakeWorld
    ) -> None:
        world = await make_world(3)
        for t in world:
            assert isinstance(t, LinkTransport)
            state = t.debug_state()
            assert sorted(state["links"]) == [r for r in range(3) if r != t.rank]
            for peer in state["links"]:
                link = t.link(peer)
                assert isinstance(link, Link) and link.peer == peer and not link.closed

    # -- sending ---------------------------------------------------------------------------------
    @pytest.mark.timeout(60)
    async def test_send_nowait_hands_small_and_large_messages_off_and_fails_at_once_after_a_loss(
        self, make_world: MakeWorld, kill_rank: KillRank
    ) -> None:
        world = await make_world(3)
        for size in (0, 3, 4 << 20):
            payload = bytearray(bytes([size % 251]) * size)
            rest = world[0].send_nowait(1, ("nowait", size), memoryview(payload), _META)
            receiving = asyncio.ensure_future(_recv(world[1], 0, ("nowait", size), size))
            if rest is not None:
                await asyncio.wait_for(rest, _LIMIT)
            payload[:] = bytes(size)  # handed off: reusing the buffer cannot change what arrives
            assert (await receiving)[2] == bytes([size % 251]) * size
        lost = asyncio.Event()
        world[0].on_peer_lost(lambda rank, exc: lost.set())
        await _kill(kill_rank, world, 2)
        await asyncio.wait_for(lost.wait(), _LIMIT)
        with pytest.raises(PeerLostError) as info:
            rest = world[0].send_nowait(2, ("nowait",), memoryview(b"x"), _META)
            if rest is not None:
                await asyncio.wait_for(rest, _LIMIT)
        assert info.value.rank == 2

    @pytest.mark.timeout(60)
    async def test_a_message_to_this_rank_itself_is_delivered(self, make_world: MakeWorld) -> None:
        a, _ = await make_world(2)
        await a.send(0, ("self",), memoryview(b"me"), _META)
        assert await _recv(a, 0, ("self",), 2) == (0, _META, b"me")

    @pytest.mark.timeout(60)
    async def test_a_cancelled_send_not_yet_handed_off_is_withdrawn_and_the_stream_stays_whole(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2, inbox_messages=1)
        await a.send(1, ("c", 0), memoryview(b"first"), _META)  # fills b's inbox: b stops reading
        await _eventually(lambda: _buffered(b, 0) == 1, "the first message buffered")
        big = bytes([7]) * (48 << 20)  # more than a link's buffers hold while b does not read
        blocked = asyncio.ensure_future(a.send(1, ("c", 1), memoryview(big), _META))
        await asyncio.sleep(0.05)
        assert not blocked.done(), "a send to a rank that stopped reading should wait"
        queued = asyncio.ensure_future(a.send(1, ("c", 2), memoryview(b"never"), _META))
        await asyncio.sleep(0.01)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert (await _recv(b, 0, ("c", 0), 5))[2] == b"first"
        assert (await _recv(b, 0, ("c", 1), len(big)))[2] == big
        await asyncio.wait_for(blocked, _LIMIT)
        await a.send(1, ("c", 3), memoryview(b"after"), _META)
        assert (await _recv(b, 0, ("c", 3), 5))[2] == b"after"
        stale = asyncio.ensure_future(b.recv(0, ("c", 2), memoryview(bytearray(5))))
        done, _ = await asyncio.wait({stale}, timeout=_QUIET)
        assert not done, "a withdrawn message was delivered"
        stale.cancel()

    # -- receiving -------------------------------------------------------------------------------
    @pytest.mark.timeout(60)
    async def test_post_recv_hands_early_late_mismatched_and_discarded_outcomes_to_its_callback(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        await a.send(1, ("post", 0), memoryview(b"early"), _META)
        await asyncio.sleep(0.05)
        into = bytearray(5)
        early = _Posted()
        b.post_recv(0, ("post", 0), memoryview(into), early)
        assert await early.outcome() == ((0, _META), None) and into == b"early"
        late = _Posted()
        b.post_recv(None, ("post", 1), memoryview(into), late)
        await a.send(1, ("post", 1), memoryview(b"later"), {"k": 1})
        assert await late.outcome() == ((0, {"k": 1}), None) and into == b"later"
        wrong = _Posted()
        b.post_recv(0, ("post", 2), memoryview(into), wrong)
        await a.send(1, ("post", 2), memoryview(b"too long"), {"k": 2})
        result, exc = await wrong.outcome()
        assert result is None and isinstance(exc, MismatchError)
        assert getattr(exc, "remote_meta", None) == {"k": 2}
        dropped = _Posted()
        b.post_recv(0, ("post", 3, 0), memoryview(into), dropped)
        b.discard(("post", 3))
        result, exc = await dropped.outcome()
        assert result is None and isinstance(exc, asyncio.CancelledError)

    @pytest.mark.timeout(60)
    async def test_recv_landed_returns_an_early_payload_where_it_is_and_lands_a_late_one_in_place(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        for size in (16, 256 * 1024):  # small, and above the size landed without zeroing
            payload = bytes(range(256)) * (size // 256) if size > 16 else b"0123456789abcdef"
            await a.send(1, ("landed", size, 0), memoryview(payload), _META)
            await asyncio.sleep(0.05)
            into = bytearray(size)
            src, meta, landed = await asyncio.wait_for(
                b.recv_landed(0, ("landed", size, 0), memoryview(into)), _LIMIT
            )
            assert (src, meta, bytes(landed)) == (0, _META, payload)
            late = asyncio.ensure_future(b.recv_landed(0, ("landed", size, 1), memoryview(into)))
            await asyncio.sleep(0.01)
            await a.send(1, ("landed", size, 1), memoryview(payload[::-1]), _META)
            src, meta, landed = await asyncio.wait_for(late, _LIMIT)
            assert bytes(landed) == payload[::-1] == bytes(into)
        wrong = asyncio.ensure_future(b.recv_landed(0, ("landed", "wrong"), memoryview(bytearray(4))))
        await a.send(1, ("landed", "wrong"), memoryview(b"12345"), _META)
        with pytest.raises(MismatchError):
            await asyncio.wait_for(wrong, _LIMIT)

    @pytest.mark.timeout(60)
    async def test_post_recv_landed_hands_early_payloads_where_they_are_and_late_ones_in_place(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        for size in (16, 256 * 1024):  # small, and above the size landed without zeroing
            payload = bytes(range(256)) * (size // 256) if size > 16 else b"0123456789abcdef"
            await a.send(1, ("plain", size, 0), memoryview(payload), _META)
            await asyncio.sleep(0.05)
            into = bytearray(size)
            early = _Posted()
            b.post_recv_landed(0, ("plain", size, 0), memoryview(into), early)
            result, exc = await early.outcome()
            assert exc is None and result is not None
            assert (result[0], result[1], bytes(result[2])) == (0, _META, payload)
            late = _Posted()
            b.post_recv_landed(None, ("plain", size, 1), memoryview(into), late)
            await a.send(1, ("plain", size, 1), memoryview(payload[::-1]), {"k": size})
            result, exc = await late.outcome()
            assert exc is None and result is not None and result[:2] == (0, {"k": size})
            assert bytes(result[2]) == payload[::-1] == bytes(into)
        wrong = _Posted()
        b.post_recv_landed(0, ("plain", "wrong"), memoryview(bytearray(4)), wrong)
        await a.send(1, ("plain", "wrong"), memoryview(b"12345"), {"k": "w"})
        result, exc = await wrong.outcome()
        assert result is None and isinstance(exc, MismatchError)
        assert getattr(exc, "remote_meta", None) == {"k": "w"}
        dropped = _Posted()
        b.post_recv_landed(0, ("plain", "gone", 0), memoryview(bytearray(4)), dropped)
        b.discard(("plain", "gone"))
        result, exc = await dropped.outcome()
        assert result is None and isinstance(exc, asyncio.CancelledError)
        await a.send(1, ("plain", "after"), memoryview(b"next"), _META)  # the stream goes on
        assert (await _recv(b, 0, ("plain", "after"), 4))[2] == b"next"

    @pytest.mark.timeout(60)
    async def test_a_size_mismatch_on_a_posted_receive_fails_it_and_the_next_message_still_arrives(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        for size in (8, 200_000):  # small and large payloads take different landing paths
            posted = asyncio.ensure_future(_recv(b, 0, ("posted", size), 4))
            await asyncio.sleep(0.01)
            await a.send(1, ("posted", size), memoryview(bytes(size)), {"count": size})
            await a.send(1, ("posted", size), memoryview(b"good"), _META)
            with pytest.raises(MismatchError) as info:
                await posted
            assert getattr(info.value, "remote_meta", None) == {"count": size}
            assert (await _recv(b, 0, ("posted", size), 4))[2] == b"good"

    @pytest.mark.timeout(60)
    async def test_a_cancelled_receive_is_withdrawn_and_its_message_goes_to_the_next_receive(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        for recv in ("recv", "recv_landed"):
            waiting = asyncio.ensure_future(getattr(b, recv)(0, ("cancel", recv), memoryview(bytearray(3))))
            await asyncio.sleep(0.01)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await a.send(1, ("cancel", recv), memoryview(b"abc"), _META)
            assert (await _recv(b, 0, ("cancel", recv), 3))[2] == b"abc"

    @pytest.mark.timeout(60)
    async def test_a_large_early_message_waits_intact_for_its_receive(self, make_world: MakeWorld) -> None:
        a, b = await make_world(2)
        payload = bytes(range(256)) * 4096  # 1 MiB
        await a.send(1, ("early", "big"), memoryview(payload), _META)
        await a.send(1, ("early", "small"), memoryview(b"s"), _META)
        await _eventually(lambda: _buffered(b, 0) == 2, "both messages buffered before their receives")
        assert (await _recv(b, 0, ("early", "small"), 1))[2] == b"s"
        assert (await _recv(b, 0, ("early", "big"), len(payload)))[2] == payload

    # -- backpressure ----------------------------------------------------------------------------
    @pytest.mark.timeout(60)
    async def test_a_full_inbox_stops_the_link_until_receives_drain_it_and_nothing_is_lost(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2, inbox_messages=2)
        count, size = 96, 512 * 1024  # 48 MiB: more than a link's buffers hold
        sends = asyncio.ensure_future(
            asyncio.gather(
                *(a.send(1, ("bp", i), memoryview(bytes([i]) * size), {"i": i}) for i in range(count))
            )
        )
        await _eventually(lambda: _buffered(b, 0) >= 2, "the inbox filled")
        await asyncio.sleep(0.1)
        # One read may complete a few frames after the bound was reached, never many.
        assert _buffered(b, 0) <= 2 + 8
        assert not sends.done(), "the sender should wait while the receiver stops reading"
        for i in range(count):
            _, meta, data = await _recv(b, 0, ("bp", i), size)
            assert (meta, data[:1], len(data)) == ({"i": i}, bytes([i]), size)
        await asyncio.wait_for(sends, _LIMIT)
        assert _buffered(b, 0) == 0

    # -- finished operations: strays ------------------------------------------------------------
    @pytest.mark.timeout(60)
    async def test_retire_reports_left_over_and_late_messages_as_strays_and_discard_drops_them(
        self, make_world: MakeWorld
    ) -> None:
        world = await make_world(3)
        strays: list[tuple[int, Any, Any]] = []
        world[0].on_stray(lambda src, tag, meta: strays.append((src, tag, meta)))
        await world[1].send(0, ("c", "g", 7, 0), memoryview(b"x"), {"k": "left over"})
        await _eventually(lambda: _buffered(world[0], 1) == 1, "the message buffered")
        world[0].retire(("c", "g", 7))
        await world[2].send(0, ("c", "g", 7, 1), memoryview(b"y"), {"k": "late"})
        world[0].discard(("c", "g", 8))
        await world[2].send(0, ("c", "g", 8, 0), memoryview(b"z"), {"k": "dropped"})
        await world[2].send(0, ("after",), memoryview(b"w"), _META)
        await _recv(world[0], 2, ("after",), 1)  # links are FIFO: everything before it arrived
        assert strays == [(1, ("c", "g", 7, 0), {"k": "left over"}), (2, ("c", "g", 7, 1), {"k": "late"})]
        assert _buffered(world[0], 1) == 0 and _buffered(world[0], 2) == 0

    # -- loss ------------------------------------------------------------------------------------
    @pytest.mark.timeout(60)
    async def test_a_receive_from_any_source_survives_a_loss_while_a_live_source_is_left(
        self, make_world: MakeWorld, kill_rank: KillRank
    ) -> None:
        world = await make_world(3)
        pending = asyncio.ensure_future(_recv(world[0], None, ("any", 0), 1))
        await asyncio.sleep(0.01)
        await _kill(kill_rank, world, 2)
        await _eventually(lambda: 2 in world[0].lost_peers, "rank 2 seen lost")
        await asyncio.sleep(0.05)
        assert not pending.done(), "rank 1 may still send: the receive should keep waiting"
        await world[1].send(0, ("any", 0), memoryview(b"1"), _META)
        assert await pending == (1, _META, b"1")
        pending = asyncio.ensure_future(_recv(world[0], None, ("any", 1), 1))
        await asyncio.sleep(0.01)
        await _kill(kill_rank, world, 1)
        with pytest.raises(PeerLostError):
            await pending
        with pytest.raises(PeerLostError):
            await _recv(world[0], None, ("any", 2), 1)

    @pytest.mark.timeout(60)
    async def test_mark_lost_fails_receives_and_sends_for_that_rank_and_lists_it_lost(
        self, make_world: MakeWorld
    ) -> None:
        world = await make_world(3)
        seen: list[int] = []
        world[0].on_peer_lost(lambda rank, exc: seen.append(rank))
        pending = asyncio.ensure_future(_recv(world[0], 1, ("marked",), 1))
        await asyncio.sleep(0.01)
        world[0].mark_lost(1, "the coordinator said so")
        with pytest.raises(PeerLostError) as info:
            await pending
        assert info.value.rank == 1 and seen == [1]
        assert 1 in world[0].lost_peers and 2 not in world[0].lost_peers
        with pytest.raises(PeerLostError):
            await asyncio.wait_for(world[0].send(1, ("marked",), memoryview(b"x"), _META), _LIMIT)
        # rank 1 sees its link to rank 0 gone, naming rank 0
        await _eventually(lambda: 0 in world[1].lost_peers, "rank 1 sees rank 0 gone")

    @pytest.mark.timeout(60)
    async def test_abort_twice_and_aclose_after_abort_are_fine_and_peers_see_a_crash(
        self, make_world: MakeWorld
    ) -> None:
        a, b = await make_world(2)
        seen: list[int] = []
        a.on_peer_lost(lambda rank, exc: seen.append(rank))
        pending = asyncio.ensure_future(b.recv(0, ("abort",), memoryview(bytearray(1))))
        await asyncio.sleep(0.01)
        assert isinstance(b, LinkTransport)
        b.abort()
        b.abort()
        await asyncio.wait_for(b.aclose(), _LIMIT)
        with pytest.raises(DistError):
            await asyncio.wait_for(pending, _LIMIT)
        with pytest.raises(DistError):
            await asyncio.wait_for(b.recv(0, ("abort",), memoryview(bytearray(1))), _LIMIT)
        await _eventually(lambda: seen == [1], "rank 0 sees rank 1 lost")
