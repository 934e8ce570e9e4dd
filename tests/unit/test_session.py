"""The coordinator client without sockets: the link's handshake hand-over, request
multiplexing, backpressure and loss; argument checks made before anything is sent; URLs."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiocoll.client.control._connection import CoordinatorLink, LinkLost
from aiocoll.client.control.session import CoordinatorSession
from coordinator_link_fakes import FakeTransport

from aiocoll import AuthenticationError, RendezvousError
from aiocoll._connect import parse_tcp_url
from aiocoll.protocol import ClientHandshake, FrameDecoder, ServerHandshake, encode_frame
from aiocoll.protocol._coordinator import ROLE_STORE, ROLE_WORKER


def _frames(*pieces: tuple[dict[str, Any], bytes]) -> bytes:
    out = b""
    for header, payload in pieces:
        out += b"".join(bytes(p) for p in encode_frame(header, payload))
    return out


async def _authenticated_link(
    token: str = "t",
) -> tuple[CoordinatorLink, FakeTransport, list[dict[str, Any]]]:
    """A link that went through a real handshake against ServerHandshake; the server's last bytes
    (WELCOME) arrive in the same chunk as an event, as they may on the wire."""
    events: list[dict[str, Any]] = []
    link = CoordinatorLink(ClientHandshake(token, role=ROLE_WORKER, job="j"), events.append, lambda *_: None)
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    server = ServerHandshake(token, roles={ROLE_WORKER})
    link.data_received(server.receive_data(transport.take()))
    welcome = server.receive_data(transport.take())
    assert server.done
    link.data_received(welcome + _frames(({"ev": "restarted"}, b"")))
    assert (await asyncio.wait_for(link.ready, 1)) is not None
    return link, transport, events


@pytest.mark.timeout(10)
async def test_bytes_after_welcome_in_the_same_read_reach_the_frame_decoder() -> None:
    _, transport, events = await _authenticated_link()
    assert events == [{"ev": "restarted"}]
    assert transport.limits["high"] > transport.limits["low"] > 0


@pytest.mark.timeout(10)
async def test_replies_are_matched_to_requests_by_id_in_any_order() -> None:
    link, transport, _ = await _authenticated_link()
    first = asyncio.ensure_future(link.request({"op": "get", "key": "a"}))
    second = asyncio.ensure_future(link.request({"op": "set", "key": "b"}, b"value"))
    await asyncio.sleep(0)
    sent = FrameDecoder().feed(transport.take())
    assert [f.header["op"] for f in sent] == ["get", "set"]
    assert bytes(sent[1].payload) == b"value"
    ids = [f.header["id"] for f in sent]
    link.data_received(_frames(({"id": ids[1], "ok": True}, b""), ({"id": ids[0], "ok": True}, b"A")))
    assert await second == ({"id": ids[1], "ok": True}, b"")
    assert await first == ({"id": ids[0], "ok": True}, b"A")


@pytest.mark.timeout(10)
async def test_a_paused_transport_holds_new_requests_until_it_resumes() -> None:
    link, transport, _ = await _authenticated_link()
    link.pause_writing()
    pending = asyncio.ensure_future(link.request({"op": "nkeys"}))
    await asyncio.sleep(0.05)
    assert transport.take() == b"", "nothing may be written while the transport is paused"
    link.resume_writing()
    await asyncio.sleep(0)
    (frame,) = FrameDecoder().feed(transport.take())
    link.data_received(_frames(({"id": frame.header["id"], "ok": True, "value": 3}, b"")))
    assert (await pending)[0]["value"] == 3


@pytest.mark.timeout(10)
async def test_a_lost_link_fails_pending_requests_saying_they_were_sent() -> None:
    lost: list[Any] = []
    link, _, _ = await _authenticated_link()
    link._on_lost = lambda lk, exc: lost.append(exc)  # observe the hand-off to the session
    pending = asyncio.ensure_future(link.request({"op": "add", "key": "n", "amount": 1}))
    await asyncio.sleep(0)
    link.connection_lost(ConnectionResetError("reset by peer"))
    with pytest.raises(LinkLost) as info:
        await pending
    assert info.value.sent is True
    assert lost and isinstance(lost[0], ConnectionResetError)
    with pytest.raises(LinkLost) as again:
        await link.request({"op": "nkeys"})
    assert again.value.sent is False


@pytest.mark.timeout(10)
async def test_a_server_with_another_token_fails_the_handshake_with_authentication_error() -> None:
    link = CoordinatorLink(
        ClientHandshake("mine", role=ROLE_WORKER, job="j"), lambda e: None, lambda *_: None
    )
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    server = ServerHandshake("theirs", roles={ROLE_WORKER})
    link.data_received(server.receive_data(transport.take()))
    with pytest.raises(AuthenticationError, match="the server holds a different token from this process"):
        await link.ready
    assert transport.aborted


@pytest.mark.timeout(10)
async def test_join_checks_its_arguments_before_sending_anything() -> None:
    session = CoordinatorSession("127.0.0.1", 9, job="j")  # never connected: nothing can be sent
    with pytest.raises(ValueError, match="out of range"):
        await session.join(4, 4, [], "h")
    with pytest.raises(ValueError, match="world_size"):
        await session.join(None, 0, [], "h")
    with pytest.raises(TypeError, match="rank"):
        await session.join("0", 2, [], "h")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="addrs"):
        await session.join(0, 2, [("127.0.0.1", "80")], "h")  # type: ignore[list-item]
    store_session = CoordinatorSession("127.0.0.1", 9, job="j", role=ROLE_STORE)
    with pytest.raises(RendezvousError, match="role"):
        await store_session.join(0, 1, [], "h")
    with pytest.raises(TypeError, match="42"):
        await session.set(42, b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role"):
        CoordinatorSession("127.0.0.1", 9, role="boss")


def test_tcp_urls_are_parsed_and_bad_ones_refused_with_an_example() -> None:
    assert parse_tcp_url("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_tcp_url("tcp://[::1]:7") == ("::1", 7)
    for bad in ("127.0.0.1:29500", "http://127.0.0.1:1", "tcp://127.0.0.1", "tcp://:80", "tcp://h:notaport"):
        with pytest.raises(ValueError, match="tcp://"):
            parse_tcp_url(bad)
