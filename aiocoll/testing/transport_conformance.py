"""One conformance suite for every Transport (aiocoll/algorithms/_transport.py): memory, tcp, shm.

Part of the public testing surface; imports pytest and aiocoll's foundations only. Write a test
class that inherits ``TransportConformance`` and defines two fixtures:

- ``make_world``: an async callable ``make_world(n) -> list[Transport]`` returning n connected
  transports (index = rank); the fixture closes whatever it made when the test ends.
- ``kill_rank``: a callable ``kill_rank(world, rank)`` (plain or async) that makes ``rank``
  vanish the way a crashed process would, so the others see PeerLostError.

    class TestMemoryTransport(TransportConformance):
        @pytest.fixture
        async def make_world(self):
            worlds = []
            async def make(n):
                worlds.append(MemoryWorld(n))
                return worlds[-1].transports
            yield make
            for w in worlds:
                await w.aclose()

        @pytest.fixture
        def kill_rank(self):
            return lambda world, rank: world[rank]._world.kill(rank)

Every test then runs against that transport, which keeps the transports' behaviour identical by
construction. Waits are bounded (``_LIMIT``) so a broken transport fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from .._errors import DistError, MismatchError, PeerLostError
from ..algorithms._transport import Transport

__all__ = ["KillRank", "MakeWorld", "TransportConformance"]

MakeWorld = Callable[[int], Awaitable[list[Transport]]]
KillRank = Callable[[list[Transport], int], Any]

# Generous for a loaded 2-core machine; only a hang comes near it.
_LIMIT = 10.0
# How long we watch for something that must not happen.
_QUIET = 0.2
_META = {"kind": "test", "count": 3}


def _buf(n: int) -> bytearray:
    return bytearray(n)


async def _recv(
    t: Transport, src: int | None, tag: tuple[Any, ...], n: int
) -> tuple[int, dict[str, Any], bytes]:
    into = _buf(n)
    source, meta = await asyncio.wait_for(t.recv(src, tag, memoryview(into)), _LIMIT)
    return source, meta, bytes(into)


async def _kill(kill_rank: KillRank, world: list[Transport], rank: int) -> None:
    result = kill_rank(world, rank)
    if inspect.isawaitable(result):
        await result


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
