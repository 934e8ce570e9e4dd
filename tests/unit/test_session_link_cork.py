"""Requests queued with ``send_nowait`` (pipelined sets): their frames go out together, in order,
before any later request, at the end of the event loop's turn or when enough are waiting; each
callback is called once, with its reply, with TimeoutError, or with LinkLost when the link drops."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiocoll.client import _connection
from aiocoll.client._connection import LinkLost
from coordinator_link_fakes import handshaken_link

from aiocoll.protocol import FrameDecoder, encode_frame

pytestmark = pytest.mark.timeout(20)


def _headers(writes: list[bytes]) -> list[dict[str, Any]]:
    return [f.header for f in FrameDecoder().feed(b"".join(writes))]


async def test_queued_frames_go_out_in_one_write_at_the_end_of_the_turn_and_before_a_later_request() -> None:
    link, transport = await handshaken_link()
    answers: list[tuple[Any, ...]] = []
    for i in range(5):
        link.send_nowait({"op": "set", "key": f"k{i}"}, b"v", 10.0, lambda *a: answers.append(a))
    assert transport.take_writes() == [], "held back until the event loop's turn ends"
    await asyncio.sleep(0)
    writes = transport.take_writes()
    assert len(writes) == 1 and [h["key"] for h in _headers(writes)] == [f"k{i}" for i in range(5)]

    link.send_nowait({"op": "set", "key": "late"}, b"v", 10.0, lambda *a: answers.append(a))
    link.start({"op": "get", "key": "late"}, b"", 10.0)  # must follow the set it may read
    writes = transport.take_writes()
    assert len(writes) == 1 and [h["op"] for h in _headers(writes)] == ["set", "get"]

    reply = {"id": _headers(writes)[0]["id"], "ok": True}
    link.data_received(b"".join(bytes(p) for p in encode_frame(reply, b"")))
    assert answers == [(reply, b"", None)]
    assert not link._expiry or all(i != reply["id"] for i in link._expiry)


async def test_enough_waiting_frames_are_written_without_waiting_for_the_turn() -> None:
    link, transport = await handshaken_link()
    for i in range(_connection._CORK_FRAMES):
        link.send_nowait({"op": "set", "key": f"k{i}"}, b"v", 10.0, lambda *a: None)
    writes = transport.take_writes()
    assert len(writes) == 1 and len(_headers(writes)) == _connection._CORK_FRAMES
    big = b"x" * (_connection._COPY_PAYLOAD + 1)
    link.send_nowait({"op": "set", "key": "small"}, b"v", 10.0, lambda *a: None)
    link.send_nowait({"op": "set", "key": "big"}, big, 10.0, lambda *a: None)
    frames = FrameDecoder().feed(b"".join(transport.take_writes()))
    assert [(f.header["key"], bytes(f.payload)) for f in frames] == [("small", b"v"), ("big", big)]


async def test_each_callback_is_called_once_with_timeout_or_link_lost() -> None:
    link, transport = await handshaken_link()
    timed_out: list[tuple[Any, ...]] = []
    lost: list[tuple[Any, ...]] = []
    link.send_nowait({"op": "set", "key": "slow"}, b"v", 0.05, lambda *a: timed_out.append(a))
    link.send_nowait({"op": "set", "key": "cut"}, b"v", 10.0, lambda *a: lost.append(a))
    await asyncio.sleep(0.2)
    assert len(timed_out) == 1 and timed_out[0][0] is None and isinstance(timed_out[0][2], TimeoutError)
    assert lost == []
    link.send_nowait({"op": "set", "key": "never written"}, b"v", 10.0, lambda *a: lost.append(a))
    link.close()
    assert len(lost) == 2 and all(a[0] is None and isinstance(a[2], LinkLost) for a in lost)
    await asyncio.sleep(0)
    assert len(timed_out) == 1 and len(lost) == 2, "never called twice"
    writes = transport.take_writes()
    assert all(b"never written" not in w for w in writes), "a closed link writes nothing more"
