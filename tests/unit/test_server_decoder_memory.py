"""The frame decoder as the coordinator uses it: a connection costs its small read buffer, not
its header limit, and a header larger than that buffer still decodes (the buffer grows, then
shrinks back once the frame is consumed)."""

from __future__ import annotations

import tracemalloc

import pytest

from aiocoll.protocol import FrameDecoder, encode_frame

pytestmark = pytest.mark.timeout(20)


def test_idle_decoders_cost_their_read_size_not_their_header_limit() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        decoders = [FrameDecoder(max_header=16 << 20, read_size=16 * 1024) for _ in range(100)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(decoders) == 100
    assert grown < 8 << 20, f"100 idle decoders hold {grown} bytes"


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_header_larger_than_the_read_buffer_decodes_between_small_frames(chunk: int) -> None:
    decoder = FrameDecoder(max_header=1 << 20, read_size=1024)
    big = {"op": "join", "members": [{"rank": r, "host": "h" * 20} for r in range(3000)]}
    stream = b"".join(
        b"".join(bytes(p) for p in encode_frame(h, payload))
        for h, payload in [
            ({"id": 1}, b"abc"),
            (big, b"xyz"),
            ({"id": 2}, b""),
            (big, b""),
            ({"id": 3}, b"!"),
        ]
    )
    frames = []
    for pos in range(0, len(stream), chunk):
        frames.extend(decoder.feed(stream[pos : pos + chunk]))
    assert [f.header.get("id") for f in frames] == [1, None, 2, None, 3]
    assert frames[1].header == big and bytes(frames[1].payload) == b"xyz"
    assert bytes(frames[4].payload) == b"!"
    assert not decoder.mid_frame
