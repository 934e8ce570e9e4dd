"""The beat thread's request loop over a real socket pair: a stack request the coordinator pushes
right behind the reply to a beat's request, in the same read, is kept and answered, not dropped."""

from __future__ import annotations

import socket

import pytest
from aiocoll.client.control._beat import BeatThread

from aiocoll.protocol import FrameDecoder
from aiocoll.protocol._coordinator import EV_STACK
from aiocoll.protocol._framing import encode_frame


def _wire(header: dict[str, object]) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(header))


@pytest.mark.timeout(30)
def test_a_stack_request_arriving_in_the_same_read_as_a_reply_is_kept() -> None:
    beat = BeatThread("127.0.0.1", 1, token=None, job="j", session="s", rank=3, report=lambda want: None)
    ours, coordinator = socket.socketpair()
    with ours, coordinator:
        ours.settimeout(10)
        # the reply to the request the beat thread is about to send (its first: id 1), then a
        # stack request and an unrelated reply, all in one write
        pushed = _wire({"id": 1, "ok": True}) + _wire({"ev": EV_STACK, "q": 7}) + _wire({"id": 99})
        coordinator.sendall(pushed)
        decoder = FrameDecoder(max_header=1 << 16, max_payload=0)
        reply = beat._request(ours, decoder, {"op": "hb"})
        assert reply == {"id": 1, "ok": True}
        assert beat._asked == [7]
