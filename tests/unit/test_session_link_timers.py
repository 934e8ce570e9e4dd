"""The link's one shared reply timer: each unanswered request still times out on its own
deadline, an answered one never does, and a later, shorter deadline re-arms the timer."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiocoll.client.control._connection import CoordinatorLink
from coordinator_link_fakes import handshaken_link

from aiocoll.protocol import FrameDecoder, encode_frame

pytestmark = pytest.mark.timeout(20)


def _reply(link: CoordinatorLink, req_id: int) -> None:
    link.data_received(b"".join(bytes(p) for p in encode_frame({"id": req_id, "ok": True}, b"")))


async def test_each_unanswered_request_times_out_on_its_own_deadline_and_answered_ones_do_not() -> None:
    link, transport = await handshaken_link()
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
    link, transport = await handshaken_link()
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
