"""The coordinator's small HTTP server, exercised with real requests over loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from aiocoll.server import _http
from aiocoll.server._http import MAX_REQUEST_BYTES, start_http_server

pytestmark = pytest.mark.timeout(30)


async def _health() -> tuple[int, str, bytes]:
    return 200, "text/plain; charset=utf-8", b"ok\n"


async def _jobs() -> tuple[int, str, bytes]:
    return 200, "application/json", json.dumps([{"job": "default"}]).encode()


async def _broken() -> tuple[int, str, bytes]:
    raise RuntimeError("route exploded")


async def _raw(port: int, request: bytes, *, close_write: bool = False) -> tuple[int, dict[str, str], bytes]:
    """Send raw bytes; return (status, headers, body) of the reply."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        if close_write:
            writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


@pytest.fixture
async def server():
    srv = await start_http_server("127.0.0.1", 0, {"/healthz": _health, "/jobs": _jobs, "/boom": _broken})
    try:
        yield srv
    finally:
        await srv.close()


async def test_get_known_path_returns_route_body_and_headers(server) -> None:
    status, headers, body = await _raw(server.port, b"GET /jobs HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"] == "close"
    assert json.loads(body) == [{"job": "default"}]


async def test_urllib_client_can_read_healthz(server) -> None:
    def fetch() -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz?verbose=1", timeout=10) as r:
            return r.status, r.read()

    status, body = await asyncio.to_thread(fetch)
    assert (status, body) == (200, b"ok\n")


async def test_head_returns_headers_without_body(server) -> None:
    status, headers, body = await _raw(server.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200
    assert headers["content-length"] == "3"
    assert body == b""


async def test_unknown_path_is_404_naming_known_paths(server) -> None:
    status, _, body = await _raw(server.port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 404
    assert b"/healthz" in body and b"/jobs" in body


@pytest.mark.parametrize("method", [b"POST", b"PUT", b"DELETE", b"OPTIONS"])
async def test_other_methods_are_405_with_allow_header(server, method: bytes) -> None:
    status, headers, _ = await _raw(server.port, method + b" /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 405
    assert headers["allow"] == "GET, HEAD"


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /healthz\r\n\r\n",  # no version
        b"GET  /healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # double space
        b"GET http://evil/healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # absolute form
        b"GET /healthz HTTP/1.1\r\n\r\n",  # HTTP/1.1 without Host
        b"GET /healthz HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",  # two Hosts
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n",  # space in a field name
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",  # obsolete line folding
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",  # a body
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n",  # a TLS hello, say
    ],
)
async def test_malformed_requests_are_400(server, request_bytes: bytes) -> None:
    status, _, _ = await _raw(server.port, request_bytes)
    assert status == 400


async def test_http_1_0_without_host_is_served(server) -> None:
    status, _, body = await _raw(server.port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert (status, body) == (200, b"ok\n")


async def test_unsupported_http_version_is_505(server) -> None:
    status, _, _ = await _raw(server.port, b"GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n")
    assert status == 505


async def test_oversized_request_head_is_431(server) -> None:
    padding = b"X-Pad: " + b"a" * (2 * MAX_REQUEST_BYTES) + b"\r\n"
    status, _, _ = await _raw(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + padding + b"\r\n")
    assert status == 431


async def test_request_never_finished_is_closed_after_read_deadline(server, monkeypatch) -> None:
    monkeypatch.setattr(_http, "READ_TIMEOUT", 0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost:")  # and then nothing
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # a hang here fails the test by timeout
    writer.close()
    assert data.startswith(b"HTTP/1.1 408 ")


async def test_route_that_raises_gives_500_and_server_keeps_serving(server) -> None:
    status, _, _ = await _raw(server.port, b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 500
    status, _, body = await _raw(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, body) == (200, b"ok\n")


async def test_slow_route_gives_503(monkeypatch) -> None:
    monkeypatch.setattr(_http, "HANDLER_TIMEOUT", 0.1)

    async def slow() -> tuple[int, str, bytes]:
        await asyncio.sleep(30)
        return 200, "text/plain", b""

    srv = await start_http_server("127.0.0.1", 0, {"/slow": slow})
    try:
        status, _, _ = await _raw(srv.port, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 503
    finally:
        await srv.close()


async def test_client_closing_early_does_not_disturb_others(server) -> None:
    for _ in range(5):
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /hea")
        writer.close()
    status, _, _ = await _raw(server.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200


async def test_connections_over_the_cap_are_closed_and_the_cap_frees_up(monkeypatch) -> None:
    monkeypatch.setattr(_http, "MAX_CONNECTIONS", 3)
    srv = await start_http_server("127.0.0.1", 0, {"/healthz": _health})
    idle = []
    try:
        for _ in range(3):  # hold the cap with connections that never send a request
            idle.append(await asyncio.open_connection("127.0.0.1", srv.port))
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            data = await asyncio.wait_for(reader.read(), 10)
            if not data:
                raise ConnectionResetError("closed without a reply")
        writer.close()
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.2)
        status, _, _ = await _raw(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
    finally:
        await srv.close()


async def test_close_aborts_open_connections_and_is_idempotent() -> None:
    srv = await start_http_server("127.0.0.1", 0, {"/healthz": _health})
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    writer.write(b"GET /heal")
    await writer.drain()
    await asyncio.sleep(0.05)
    await asyncio.wait_for(srv.close(), 5)
    await srv.close()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", srv.port)


async def test_host_must_be_an_ip_literal() -> None:
    with pytest.raises(OSError):
        await start_http_server("localhost", 0, {"/healthz": _health})


async def test_route_paths_must_start_with_slash() -> None:
    with pytest.raises(ValueError, match="healthz"):
        await start_http_server("127.0.0.1", 0, {"healthz": _health})


async def test_urllib_sees_404_as_http_error(server) -> None:
    def fetch() -> int:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/missing", timeout=10)
        except urllib.error.HTTPError as exc:
            return exc.code
        return 200

    assert await asyncio.to_thread(fetch) == 404
