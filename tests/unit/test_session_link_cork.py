"""Frames queued with ``send`` (requests that expect no reply: SET, APPEND, MSET) go out together,
in order, before any later request, at the end of the event loop's turn or when enough are
waiting; a large one is not held back; a link that closes writes nothing more. Any later store
reply reaches ``on_settle`` before the request it answers is woken."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import pytest
from aiocoll.client.control import _connection
from coordinator_link_fakes import handshaken_link

from aiocoll.protocol import FrameDecoder, pack_prefix
from aiocoll.protocol._store import GET, OK, SET, encode_request

pytestmark = pytest.mark.timeout(20)

_pack = msgpack.Packer(use_bin_type=True).pack


def _headers(writes: list[bytes]) -> list[Any]:
    return [f.header for f in FrameDecoder(lists=True).feed(b"".join(writes))]


def _set(req_id: int, key: str, value: bytes = b"v") -> bytes:
    return encode_request(_pack, [SET, req_id, 0, key], value)


def _reply(header: list[Any], payload: bytes = b"") -> bytes:
    head = _pack(header)
    return pack_prefix(len(head), len(payload)) + head + payload


async def test_queued_frames_go_out_in_one_write_at_the_end_of_the_turn_and_before_a_later_request() -> None:
    settled: list[Any] = []
    link, transport = await handshaken_link(on_settle=lambda h, p: settled.append((h, p)))
    for i in range(5):
        link.send(_set(i + 1, f"k{i}"))
    assert transport.take_writes() == [], "held back until the event loop's turn ends"
    await asyncio.sleep(0)
    writes = transport.take_writes()
    assert len(writes) == 1 and [h[3] for h in _headers(writes)] == [f"k{i}" for i in range(5)]

    link.send(_set(6, "late"))
    reply = link.start(7, encode_request(_pack, [GET, 7, "late", None]), 10.0)  # must follow the set it reads
    writes = transport.take_writes()
    assert len(writes) == 1 and [h[0] for h in _headers(writes)] == [SET, GET]

    def woken(_: Any) -> None:
        assert settled, "the reply was settled before its request was woken"

    reply.add_done_callback(woken)
    link.data_received(_reply([7, OK], b"value"))
    assert settled == [([7, OK], b"value")]
    assert (await reply) == ([7, OK], b"value")
    assert not link._expiry, "an answered request leaves no deadline behind"


async def test_enough_waiting_frames_are_written_without_waiting_for_the_turn() -> None:
    link, transport = await handshaken_link()
    for i in range(_connection._CORK_FRAMES):
        link.send(_set(i + 1, f"k{i}"))
    writes = transport.take_writes()
    assert len(writes) == 1 and len(_headers(writes)) == _connection._CORK_FRAMES
    big = b"x" * (_connection._COPY_PAYLOAD + 1)
    link.send(_set(1000, "small"))
    link.send(_set(1001, "big", big))
    frames = FrameDecoder(lists=True).feed(b"".join(transport.take_writes()))
    assert [(f.header[3], bytes(f.payload)) for f in frames] == [("small", b"v"), ("big", big)]


async def test_a_closed_link_writes_nothing_more_and_fails_what_waits() -> None:
    link, transport = await handshaken_link()
    link.send(_set(1, "queued before the close"))
    pending = link.start(2, encode_request(_pack, [GET, 2, "k", None]), 10.0)
    transport.take_writes()
    link.send(_set(3, "never written"))
    link.close()
    await asyncio.sleep(0)
    assert transport.take_writes() == [], "a closed link writes nothing more"
    with pytest.raises(_connection.LinkLost):
        await pending
