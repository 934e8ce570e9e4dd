"""The link's one shared reply timer: each unanswered request still times out on its own
deadline, an answered one never does, and a later, shorter deadline re-arms the timer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiocoll.client._connection import CoordinatorLink

from aiocoll.protocol import ClientHandshake, FrameDecoder, ServerHandshake, encode_frame
from aiocoll.protocol._coordinator import ROLE_WORKER

pytestmark = pytest.mark.timeout(20)


class _Transport:
    def __init__(self) -> None:
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, pieces: list[Any]) -> None:
        for piece in pieces:
            self.written += bytes(piece)

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None

    def abort(self) -> None:
        pass

    def take(self) -> bytes:
        data = bytes(self.written)
        self.written.clear()
        return data


async def _link() -> tuple[CoordinatorLink, _Transport]:
    link = CoordinatorLink(ClientHandshake("t", role=ROLE_WORKER, job="j"), lambda e: None, lambda *_: None)
    transport = _Transport()
    link.connection_made(transport)  # type: ignore[arg-type]
    server = ServerHandshake("t", roles={ROLE_WORKER})
    link.data_received(server.receive_data(transport.take()))
    link.data_received(server.receive_data(transport.take()))
    await asyncio.wait_for(link.ready, 1)
    return link, transport


def _reply(link: CoordinatorLink, req_id: int) -> None:
    link.data_received(b"".join(bytes(p) for p in encode_frame({"id": req_id, "ok": True}, b"")))


async def test_each_unanswered_request_times_out_on_its_own_deadline_and_answered_ones_do_not() -> None:
    link, transport = await _link()
    began = time.monotonic()
    long = asyncio.ensure_future(link.request({"op": "nkeys"}, b"", 1.2))
    answered = asyncio.ensure_future(link.request({"op": "nkeys"}, b"", 0.2))
    short = asyncio.ensure_future(link.request({"op": "nkeys"}, b"", 0.3))  # earlier than `long`'s
    await asyncio.sleep(0)
    ids = [f.header["id"] for f in FrameDecoder().feed(transport.take())]
    _reply(link, ids[1])
    assert (await answered)[0]["ok"] is True
    with pytest.raises(TimeoutError, match=r"within 0\.3s"):
        await short
    short_at = time.monotonic() - began
    assert not long.done(), "a shorter deadline must not fail a longer one"
    with pytest.raises(TimeoutError, match=r"within 1\.2s"):
        await long
    long_at = time.monotonic() - began
    assert 0.25 <= short_at < long_at and 1.15 <= long_at < 30.0, (short_at, long_at)
    assert not link._expiry, "expired and answered requests leave no deadline behind"


async def test_requests_without_a_timeout_wait_and_a_late_reply_is_ignored() -> None:
    link, transport = await _link()
    patient = asyncio.ensure_future(link.request({"op": "get", "key": "k"}))
    hasty = asyncio.ensure_future(link.request({"op": "get", "key": "k"}, b"", 0.05))
    await asyncio.sleep(0)
    ids = [f.header["id"] for f in FrameDecoder().feed(transport.take())]
    with pytest.raises(TimeoutError):
        await hasty
    _reply(link, ids[1])  # the late answer to the request that gave up: dropped
    await asyncio.sleep(0.1)
    assert not patient.done()
    _reply(link, ids[0])
    assert (await patient)[0]["id"] == ids[0]
