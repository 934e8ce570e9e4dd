"""FrameDecoder's fast paths (whole frames parsed straight out of a read, ``feed_messages``) decode
exactly what the buffered path decodes, whatever the read sizes, and refuse the same bad input:
containers a header claims beyond its own length, extension types, bad lengths."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiocoll import ProtocolError
from aiocoll.protocol import PREFIX, FrameDecoder, encode_frame

headers = st.dictionaries(
    st.text(max_size=8),
    st.one_of(st.integers(-(2**63), 2**64 - 1), st.text(max_size=20), st.binary(max_size=20), st.none()),
    max_size=6,
)


def _wire(frames: list[tuple[dict, bytes]]) -> bytes:
    return b"".join(bytes(piece) for header, payload in frames for piece in encode_frame(header, payload))


@settings(max_examples=150, deadline=None)
@given(
    frames=st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=8),
    cuts=st.lists(st.integers(1, 6000), max_size=6),
)
def test_feed_messages_and_feed_agree_with_the_buffered_path_for_any_read_sizes(
    frames: list[tuple[dict, bytes]], cuts: list[int]
) -> None:
    data = _wire(frames)
    reads, pos = [], 0
    for cut in cuts:
        reads.append(data[pos : pos + cut])
        pos += cut
    reads.append(data[pos:])
    by_messages, by_feed = FrameDecoder(read_size=1024), FrameDecoder(read_size=1024)
    by_buffer = FrameDecoder(read_size=1024)  # the coordinator's: the kernel writes into its buffer
    messages: list[tuple[dict, bytes]] = []
    fed: list[tuple[dict, bytes]] = []
    buffered: list[tuple[dict, bytes]] = []
    for chunk in reads:
        got = by_messages.feed_messages(chunk)
        assert all(type(payload) is bytes for _, payload in got)
        messages.extend(got)
        fed.extend((f.header, bytes(f.payload)) for f in by_feed.feed(chunk))
        rest = memoryview(chunk)
        while rest:
            target = by_buffer.get_buffer(len(rest))
            n = min(len(target), len(rest))
            target[:n] = rest[:n]
            rest = rest[n:]
            buffered.extend(
                (header, bytes(payload)) for header, payload in by_buffer.buffer_updated_messages(n)
            )
    assert messages == frames
    assert fed == frames
    assert buffered == frames
    assert not by_messages.mid_frame and not by_feed.mid_frame and not by_buffer.mid_frame


def test_a_payload_from_feed_is_writable_memory_of_its_own_as_before() -> None:
    (frame,) = FrameDecoder().feed(_wire([({"id": 1}, b"abc")]))
    frame.payload[0] = ord("x")  # the decoder's fast path must not hand out read-only views
    assert bytes(frame.payload) == b"xbc"


@pytest.mark.parametrize(
    "claim",
    [
        b"\xdd" + struct.pack(">I", 10**9),  # array32 of a billion entries
        b"\xdf" + struct.pack(">I", 10**9),  # map32
        b"\xdb" + struct.pack(">I", 10**9),  # str32
        b"\xc6" + struct.pack(">I", 10**9),  # bin32
        b"\xc7\x01\x05",  # an ext type: never built from a header
    ],
)
@pytest.mark.parametrize("how", ["feed", "feed_messages", "buffer_updated"])
def test_a_header_claiming_more_than_it_holds_or_an_ext_type_is_refused(claim: bytes, how: str) -> None:
    head = b"\x81\xa1k" + claim + b"\x00" * 8
    data = PREFIX.pack(len(head), 0) + head
    decoder = FrameDecoder()
    with pytest.raises(ProtocolError, match="undecodable frame header"):
        if how == "buffer_updated":
            decoder.get_buffer()[: len(data)] = data
            decoder.buffer_updated(len(data))
        else:
            getattr(decoder, how)(data)


@pytest.mark.parametrize(
    ("prefix", "message"),
    [(PREFIX.pack(0, 0), "outside"), (PREFIX.pack(10**9, 0), "outside"), (PREFIX.pack(10, 2**40), "exceeds")],
)
def test_bad_lengths_are_refused_by_feed_messages_too(prefix: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        FrameDecoder(max_header=1024, max_payload=1 << 20).feed_messages(prefix + b"\x80" * 16)


def test_feed_messages_hands_payloads_to_the_sink_like_feed() -> None:
    target = bytearray(5)
    decoder = FrameDecoder(sink=lambda header, size: memoryview(target) if header.get("big") else None)
    got = decoder.feed_messages(_wire([({"id": 1}, b""), ({"big": True}, b"hello"), ({"id": 2}, b"")]))
    assert got == [({"id": 1}, b""), ({"big": True}, b"hello"), ({"id": 2}, b"")]
    assert target == bytearray(b"hello")  # it went through the sink
    target[:] = bytearray(5)
    assert decoder.feed_messages(_wire([({"big": True}, b"again")])) == [({"big": True}, b"again")]
    assert target == bytearray(b"again"), "a read of one whole frame goes through the sink too"


def test_a_header_that_is_not_a_map_is_refused_on_every_path() -> None:
    head = msgpack.packb([1, 2, 3])
    for how in ("feed", "feed_messages"):
        with pytest.raises(ProtocolError, match="must be a map"):
            getattr(FrameDecoder(), how)(PREFIX.pack(len(head), 0) + head)
