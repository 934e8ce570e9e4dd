"""Sans-IO protocol: frame round trips, zero-copy sinks, limits, handshake outcomes, decoder fuzz."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiocoll import AuthenticationError, ProtocolError
from aiocoll.protocol import (
    MAGIC,
    PREFIX,
    ClientHandshake,
    FrameDecoder,
    ServerHandshake,
    encode_frame,
)
from aiocoll.protocol._coordinator import join_values, split_values


def _wire(*frames: tuple[dict, bytes]) -> bytes:
    return b"".join(bytes(piece) for header, payload in frames for piece in encode_frame(header, payload))


headers = st.dictionaries(
    st.text(max_size=8),
    st.one_of(
        st.integers(-(2**63), 2**64 - 1),
        st.text(max_size=20),
        st.binary(max_size=20),
        st.none(),
        st.lists(st.integers(0, 9), max_size=5),
    ),
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(
    frames=st.lists(st.tuples(headers, st.binary(max_size=3000)), min_size=1, max_size=6),
    chunk=st.integers(1, 5000),
)
def test_frames_round_trip_whatever_the_read_sizes(frames: list[tuple[dict, bytes]], chunk: int) -> None:
    data = _wire(*frames)
    decoder = FrameDecoder(read_size=1024)
    out = []
    for start in range(0, len(data), chunk):
        out.extend(decoder.feed(data[start : start + chunk]))
    assert [(f.header, bytes(f.payload)) for f in out] == frames
    assert not decoder.mid_frame


def test_payload_lands_in_the_sink_buffer_given_for_its_header() -> None:
    destination = bytearray(100_000)
    seen = []

    def sink(header: dict, size: int) -> memoryview | None:
        seen.append((header["tag"], size))
        return memoryview(destination) if header["tag"] == "big" else None

    decoder = FrameDecoder(sink=sink, read_size=4096)
    payload = bytes(range(256)) * 400
    data = _wire(({"tag": "small"}, b"abc"), ({"tag": "big"}, payload[: len(destination)]))
    frames = []
    pos = 0
    while pos < len(data):  # drive it the way asyncio.BufferedProtocol does
        buf = decoder.get_buffer()
        n = min(len(buf), len(data) - pos, 3000)
        buf[:n] = data[pos : pos + n]
        pos += n
        frames.extend(decoder.buffer_updated(n))
    assert seen == [("small", 3), ("big", len(destination))]
    assert bytes(frames[0].payload) == b"abc" and not frames[0].in_sink
    assert frames[1].in_sink and frames[1].payload.obj is destination
    assert bytes(destination) == payload[: len(destination)]


def test_bulk_payload_is_read_directly_into_the_sink_not_through_the_internal_buffer() -> None:
    destination = bytearray(1 << 20)
    decoder = FrameDecoder(sink=lambda h, n: memoryview(destination), read_size=4096)
    head = msgpack.packb({"t": 1})
    decoder.feed(PREFIX.pack(len(head), len(destination)) + head)
    target = decoder.get_buffer()
    # The decoder hands out the caller's memory itself, so the kernel writes into the tensor.
    assert target.obj is destination and len(target) == len(destination)


def test_sink_of_wrong_size_is_a_local_protocol_error() -> None:
    decoder = FrameDecoder(sink=lambda h, n: memoryview(bytearray(n - 1)))
    with pytest.raises(ProtocolError) as info:
        decoder.feed(_wire(({"a": 1}, b"xyz")))
    assert info.value.remote is False


@pytest.mark.parametrize(
    ("prefix", "message"),
    [
        (PREFIX.pack(0, 0), "outside"),
        (PREFIX.pack(10**9, 0), "outside"),
        (PREFIX.pack(10, 2**40), "exceeds"),
    ],
)
def test_oversized_or_empty_lengths_are_refused_before_any_allocation(prefix: bytes, message: str) -> None:
    decoder = FrameDecoder(max_header=1024, max_payload=1 << 20)
    with pytest.raises(ProtocolError, match=message):
        decoder.feed(prefix)


def test_header_that_is_not_a_map_is_refused() -> None:
    head = msgpack.packb([1, 2, 3])
    with pytest.raises(ProtocolError, match="must be a map"):
        FrameDecoder().feed(PREFIX.pack(len(head), 0) + head)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000))
def test_decoder_fuzz_only_ever_raises_protocol_error(data: bytes) -> None:
    decoder = FrameDecoder(max_header=512, max_payload=4096)
    try:
        for frame in decoder.feed(data):
            assert isinstance(frame.header, dict)
    except ProtocolError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_server_handshake_fuzz_never_authenticates_garbage(data: bytes) -> None:
    server = ServerHandshake("secret", roles={"worker"})
    try:
        server.receive_data(MAGIC + data)
        server.receive_data(data)
    except (ProtocolError, AuthenticationError):
        pass
    assert not server.done


def _run_handshake(client: ClientHandshake, server: ServerHandshake) -> None:
    to_client = server.receive_data(client.start())
    to_server = client.receive_data(to_client)
    to_client = server.receive_data(to_server)
    client.receive_data(to_client)


def test_handshake_with_same_token_authenticates_both_sides_and_carries_hello_fields() -> None:
    client = ClientHandshake("s3cret", role="worker", job="train", extra={"rank": 3})
    server = ServerHandshake("s3cret", roles={"worker"}, info={"server": "coord-1"})
    _run_handshake(client, server)
    assert client.done and server.done
    assert (server.hello["job"], server.hello["role"], server.hello["rank"]) == ("train", "worker", 3)
    assert client.server_info["server"] == "coord-1"


def test_token_never_crosses_the_wire() -> None:
    token = "a-very-distinctive-token-value"
    client = ClientHandshake(token, role="worker", job="j")
    server = ServerHandshake(token, roles={"worker"})
    wire = client.start()
    back = server.receive_data(wire)
    wire += back + client.receive_data(back)
    assert token.encode() not in wire


def test_client_refuses_a_server_with_another_token() -> None:
    client = ClientHandshake("right", role="worker", job="j")
    server = ServerHandshake("wrong", roles={"worker"})
    client.name_server("10.0.0.1:29500")
    with pytest.raises(
        AuthenticationError,
        match=r"the coordinator at 10\.0\.0\.1:29500 holds a different token from this process: set the "
        r"same AIOCOLL_TOKEN",
    ):
        client.receive_data(server.receive_data(client.start()))


def test_a_client_that_rejects_the_servers_proof_tells_it_before_hanging_up() -> None:
    client = ClientHandshake("right", role="worker", job="j")
    server = ServerHandshake("wrong", roles={"worker"})
    assert client.farewell == b""
    with pytest.raises(AuthenticationError):
        client.receive_data(server.receive_data(client.start()))
    # MISMATCH, never the client's own proof (a false server could relay that one).
    assert client.farewell and b"proof" not in client.farewell
    assert not server.mismatch
    with pytest.raises(AuthenticationError, match="found our proof wrong"):
        server.receive_data(client.farewell)
    assert server.mismatch and not server.done
    # A client that accepts the proof says nothing of the kind.
    honest, same = ClientHandshake("t", role="worker", job="j"), ServerHandshake("t", roles={"worker"})
    auth = honest.receive_data(same.receive_data(honest.start()))
    assert honest.farewell == b"" and honest.receive_data(same.receive_data(auth)) == b"" and honest.done


def test_server_refuses_a_client_that_cannot_prove_the_token() -> None:
    honest = ClientHandshake("right", role="worker", job="j")
    server = ServerHandshake("right", roles={"worker"})
    challenge = server.receive_data(honest.start())
    # An impostor replays the hello but must forge the proof without the token.
    forged = msgpack.packb({"t": "auth", "proof": b"\0" * 32})
    with pytest.raises(AuthenticationError, match="wrong token"):
        server.receive_data(PREFIX.pack(len(forged), 0) + forged)
    assert challenge and not server.done


def test_tampered_hello_fields_fail_authentication() -> None:
    client = ClientHandshake("tok", role="worker", job="j", extra={"rank": 1})
    start = client.start()
    tampered = start.replace(b"\xa4rank\x01", b"\xa4rank\x00")
    assert tampered != start
    server = ServerHandshake("tok", roles={"worker"})
    challenge = server.receive_data(tampered)
    # The server's proof covers the hello it saw, so the honest client notices the change.
    with pytest.raises(AuthenticationError):
        client.receive_data(challenge)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", "bad magic"),
        (MAGIC + struct.pack("!IQ", 100_000, 0), "outside"),
        (MAGIC + struct.pack("!IQ", 10, 5), "exceeds"),
    ],
)
def test_server_handshake_rejects_non_protocol_bytes(data: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        ServerHandshake("t", roles={"worker"}).receive_data(data)


def test_server_rejects_other_protocol_versions_and_roles() -> None:
    for extra, match in (({"v": 99}, "protocol version"), ({"role": "root"}, "role")):
        hello = {"t": "hello", "v": 1, "role": "worker", "job": "j", "nonce": b"n" * 32, **extra}
        head = msgpack.packb(hello, use_bin_type=True)
        with pytest.raises(ProtocolError, match=match):
            ServerHandshake("t", roles={"worker"}).receive_data(MAGIC + PREFIX.pack(len(head), 0) + head)


def test_values_join_and_split_round_trip_and_bad_sizes_are_refused() -> None:
    values = [b"", b"a", b"bcd" * 100]
    payload, sizes = join_values(values)
    assert split_values(payload, sizes) == values
    for bad in ([1, 2], "3", [-1, 305], [1.5]):
        with pytest.raises(ProtocolError):
            split_values(payload, bad)
