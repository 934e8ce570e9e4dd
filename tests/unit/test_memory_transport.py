"""The memory link kind's own checks (the conformance suite runs it in test_link_conformance.py)."""

from __future__ import annotations

import asyncio

import pytest
from aiocoll.client.data.transports.memory import MemoryWorld

from aiocoll._errors import PeerLostError

META = {"kind": "test"}


@pytest.mark.timeout(30)
async def test_full_inbox_blocks_the_sender_until_the_receiver_consumes() -> None:
    world = MemoryWorld(2, max_inbox_bytes=10, max_inbox_messages=100)
    a, b = world.transports
    await a.send(1, ("m", 0), memoryview(b"0123456789"), META)  # fills the inbox exactly
    blocked = asyncio.ensure_future(a.send(1, ("m", 1), memoryview(b"x"), META))
    await asyncio.sleep(0.05)
    assert not blocked.done(), "a send over the inbox bound should wait for room"
    into = bytearray(10)
    await b.recv(0, ("m", 0), memoryview(into))
    await asyncio.wait_for(blocked, 5)
    await b.recv(0, ("m", 1), memoryview(bytearray(1)))


@pytest.mark.timeout(30)
async def test_a_message_larger_than_the_bound_fits_into_an_empty_inbox() -> None:
    world = MemoryWorld(2, max_inbox_bytes=4)
    a, b = world.transports
    await asyncio.wait_for(a.send(1, ("big",), memoryview(b"x" * 100), META), 5)
    await b.recv(0, ("big",), memoryview(bytearray(100)))


@pytest.mark.timeout(30)
async def test_a_send_waiting_for_room_fails_with_peer_lost_when_the_receiver_dies() -> None:
    world = MemoryWorld(2, max_inbox_messages=1)
    a, _ = world.transports
    await a.send(1, ("m", 0), memoryview(b"a"), META)
    blocked = asyncio.ensure_future(a.send(1, ("m", 1), memoryview(b"b"), META))
    await asyncio.sleep(0.01)
    world.kill(1)
    with pytest.raises(PeerLostError) as info:
        await asyncio.wait_for(blocked, 5)
    assert info.value.rank == 1


@pytest.mark.timeout(30)
async def test_a_receive_from_any_source_keeps_waiting_for_live_peers_and_fails_once_none_is_left() -> None:
    # One rule for every link kind (aiocoll/_matching.py): a lost peer does not fail a receive
    # from any source while another rank may still send; it fails once no other rank is left.
    world = MemoryWorld(3)
    pending = asyncio.ensure_future(world[0].recv(None, ("any",), memoryview(bytearray(1))))
    await asyncio.sleep(0.01)
    world.kill(2)
    await asyncio.sleep(0.01)
    assert not pending.done()
    await world[1].send(0, ("any",), memoryview(b"1"), META)
    assert await asyncio.wait_for(pending, 5) == (1, META)
    pending = asyncio.ensure_future(world[0].recv(None, ("any",), memoryview(bytearray(1))))
    await asyncio.sleep(0.01)
    world.kill(1)
    with pytest.raises(PeerLostError):
        await asyncio.wait_for(pending, 5)


@pytest.mark.timeout(30)
async def test_messages_delivered_before_a_peer_died_can_still_be_received() -> None:
    world = MemoryWorld(2)
    await world[1].send(0, ("last",), memoryview(b"words"), META)
    world.kill(1)
    into = bytearray(5)
    assert await world[0].recv(1, ("last",), memoryview(into)) == (1, META)
    assert bytes(into) == b"words"


def test_world_of_zero_ranks_is_refused() -> None:
    with pytest.raises(ValueError):
        MemoryWorld(0)
