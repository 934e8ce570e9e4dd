"""A small, strict HTTP/1.1 server on asyncio for the coordinator's web page and its /healthz,
/metrics, /auth and /jobs.

Imports only the standard library: it must not import the client, the public surface or any
HTTP framework, so the coordinator stays a dependency-light service. It exists because those
read-only endpoints need far less than a web framework, but must still be safe on a port
that anyone may reach: GET and HEAD only, no request bodies, a bounded request head, a deadline
for reading it and for writing the reply, a cap on concurrent connections, one request per
connection (``Connection: close``), and no DNS lookups of any kind.

A route is ``async def route()`` (an endpoint that needs nothing of the request) or
``async def route(request)`` (it reads the query or a header: ``Request``); it answers
(status, content type, body), or (status, content type, body, extra headers).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import re
import socket
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Union

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "READ_TIMEOUT",
    "HANDLER_TIMEOUT",
    "HttpServer",
    "Reply",
    "Request",
    "Route",
    "start_http_server",
]

log = logging.getLogger("aiocoll.server.http")


@dataclass(frozen=True)
class Request:
    """What a route may read of a request.

    Attributes:
        method: "GET" or "HEAD". path: the path, without the query.
        query: the query's fields (the last one wins when a name repeats).
        headers: header fields by lower-case name (the last one wins). peer: the client's address.
    """

    method: str
    path: str
    query: Mapping[str, str]
    headers: Mapping[str, str]
    peer: str


# A route answers (status, content type, body), or (status, content type, body, extra headers).
Reply = Union[tuple[int, str, bytes], tuple[int, str, bytes, Mapping[str, str]]]
Route = Union[Callable[[], Awaitable[Reply]], Callable[[Request], Awaitable[Reply]]]

MAX_REQUEST_BYTES = 8 * 1024  # request line + headers; a GET needs a few hundred bytes
READ_TIMEOUT = 5.0  # seconds a client has to send its whole request head
WRITE_TIMEOUT = 10.0  # seconds a client has to take the whole reply
HANDLER_TIMEOUT = 10.0  # seconds a route may take before the client gets 503
MAX_CONNECTIONS = 64  # concurrent HTTP connections; more are closed at once
MAX_QUERY_FIELDS = 16  # a query with more is refused
LINGER_TIMEOUT = 1.0  # seconds to wait for the client to close after the reply
LINGER_BYTES = 64 * 1024  # most unread request bytes discarded before closing anyway

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 token (method, header name)
_TARGET = re.compile(rb"^/[!-~]*$")  # origin-form: a path, visible ASCII only
_VERSION = re.compile(rb"^HTTP/1\.[01]$")
_FIELD_VALUE = re.compile(rb"^[\t -~\x80-\xff]*$")  # no control characters (CR, LF, NUL)
_ALLOWED = ("GET", "HEAD")


async def _discard(reader: asyncio.StreamReader) -> None:
    received = 0
    while received < LINGER_BYTES:
        chunk = await reader.read(4096)
        if not chunk:
            return
        received += len(chunk)


class _BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]]:
    """Validate a request head (up to and without the blank line); return (method, path, query,
    headers by lower-case name).

    Raises:
        _BadRequest: with the status to answer when the head breaks HTTP/1.1's grammar.
    """
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise _BadRequest(400, "malformed request line")
    method, target, version = parts
    if not _TOKEN.match(method):
        raise _BadRequest(400, "malformed method")
    if not _VERSION.match(version):
        if version.startswith(b"HTTP/"):
            raise _BadRequest(505, f"unsupported version {version[:16]!r}")
        raise _BadRequest(400, "malformed request line")
    if not _TARGET.match(target):
        raise _BadRequest(400, "request target must be an absolute path")
    host_count = 0
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):  # also refuses obsolete line folding
            raise _BadRequest(400, "malformed header line")
        value = value.strip(b" \t")
        if not _FIELD_VALUE.match(value):
            raise _BadRequest(400, "control character in a header value")
        lname = name.lower()
        headers[lname.decode("ascii")] = value.decode("latin-1")
        if lname == b"host":
            host_count += 1
        elif lname == b"transfer-encoding" or (lname == b"content-length" and value != b"0"):
            # These endpoints take no body; refusing one leaves no framing ambiguity to exploit.
            raise _BadRequest(400, "request bodies are not accepted")
    if version == b"HTTP/1.1" and host_count != 1:
        raise _BadRequest(400, "an HTTP/1.1 request needs exactly one Host header")
    path, _, query = target.decode("ascii").partition("?")
    return method.decode("ascii"), path, query, headers


def _parse_query(query: str) -> dict[str, str]:
    """The fields of a query string.

    Raises:
        _BadRequest: when it has more than MAX_QUERY_FIELDS fields.
    """
    try:
        fields = urllib.parse.parse_qsl(query, keep_blank_values=True, max_num_fields=MAX_QUERY_FIELDS)
    except ValueError:
        raise _BadRequest(400, f"a query of more than {MAX_QUERY_FIELDS} fields") from None
    return dict(fields)


def _header_lines(headers: Mapping[str, str]) -> str:
    """A route's extra header fields as lines of a reply head.

    Raises:
        ValueError: a name that is not a token or a value with a control character (a route's
            bug; it must never become a response splitting hole).
    """
    lines = []
    for name, value in headers.items():
        if not _TOKEN.match(name.encode("latin-1")) or not _FIELD_VALUE.match(value.encode("latin-1")):
            raise ValueError(f"bad reply header {name!r}: {value[:64]!r}")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines)


def _peer_text(peer: object) -> str:
    """A client's address as HOST:PORT ([HOST]:PORT for IPv6)."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer)


def _takes_request(route: Route) -> bool:
    """Whether ``route`` is ``async def route(request)`` rather than ``async def route()``."""
    try:
        params = inspect.signature(route).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it bare
        return False
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _response(status: int, content_type: str, body: bytes, *, head_only: bool, extra: str = "") -> bytes:
    reason = _REASONS.get(status, "Unknown")
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        "Connection: close\r\n"
        f"{extra}\r\n"
    ).encode("latin-1")
    return head if head_only else head + body


def _text(status: int, message: str, *, head_only: bool = False, extra: str = "") -> bytes:
    return _response(
        status, "text/plain; charset=utf-8", (message + "\n").encode(), head_only=head_only, extra=extra
    )


class HttpServer:
    """A running HTTP server; ``close()`` stops it (calling it twice is fine).

    Attributes:
        port: the TCP port it listens on (the real one when 0 was asked for).
        host: the address it was bound to.
    """

    def __init__(self, server: asyncio.Server, host: str, routes: dict[str, Route]) -> None:
        self._server = server
        self._routes = {path: (route, _takes_request(route)) for path, route in routes.items()}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self.host = host
        sockets = server.sockets or ()
        self.port: int = sockets[0].getsockname()[1] if sockets else 0

    async def close(self) -> None:
        """Stop listening, abort connections still open and wait until they are gone."""
        if self._closed:
            return
        self._closed = True
        self._server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()

    # -- per connection ------------------------------------------------------------------------
    def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._closed or len(self._tasks) >= MAX_CONNECTIONS:
            # Over the cap: close at once rather than queue, so a flood costs us nothing.
            writer.transport.abort()
            return
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        try:
            reply = await self._answer(reader, peer)
            writer.write(reply)
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)
            if writer.can_write_eof():
                writer.write_eof()
            # Lingering close: closing with unread bytes (a refused body) would send a reset
            # that can destroy the reply before the client reads it; read a little first.
            await asyncio.wait_for(_discard(reader), LINGER_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError, OSError) as exc:
            log.debug("http connection from %s ended: %s", peer, exc or type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _answer(self, reader: asyncio.StreamReader, peer: object) -> bytes:
        """Read and check one request; return the whole reply to send."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
        except asyncio.TimeoutError:
            log.debug("http client %s sent no complete request within %ss", peer, READ_TIMEOUT)
            return _text(408, "request not received in time")
        except asyncio.LimitOverrunError:
            log.debug("http client %s sent a request head over %d bytes", peer, MAX_REQUEST_BYTES)
            return _text(431, f"request head exceeds {MAX_REQUEST_BYTES} bytes")
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("client closed before finishing its request") from None
        try:
            method, path, query, headers = _parse_head(head[:-4])
            fields = _parse_query(query) if query else {}
        except _BadRequest as exc:
            log.debug("http client %s: %s", peer, exc.reason)
            return _text(exc.status, exc.reason)
        head_only = method == "HEAD"
        if method not in _ALLOWED:
            return _text(405, f"method {method} not allowed", extra="Allow: GET, HEAD\r\n")
        entry = self._routes.get(path)
        if entry is None:
            known = ", ".join(sorted(self._routes))
            return _text(404, f"no such path {path!r}; try one of: {known}", head_only=head_only)
        route, takes_request = entry
        try:
            if takes_request:
                request = Request(method, path, fields, headers, _peer_text(peer))
                reply = await asyncio.wait_for(route(request), HANDLER_TIMEOUT)  # type: ignore[call-arg]
            else:
                reply = await asyncio.wait_for(route(), HANDLER_TIMEOUT)  # type: ignore[call-arg]
            status, content_type, body = reply[:3]
            extra = _header_lines(reply[3]) if len(reply) > 3 else ""
        except asyncio.TimeoutError:
            log.warning("http route %s took longer than %ss", path, HANDLER_TIMEOUT)
            return _text(503, f"{path} did not answer in time", head_only=head_only)
        except Exception:
            log.exception("http route %s failed", path)
            return _text(500, f"{path} failed; see the coordinator's log", head_only=head_only)
        return _response(status, content_type, body, head_only=head_only, extra=extra)


async def start_http_server(host: str, port: int, routes: dict[str, Route]) -> HttpServer:
    """Start serving ``routes`` over HTTP/1.1 on ``host:port``.

    Args:
        host: address to bind (an IP literal; "0.0.0.0" for every IPv4 interface).
        port: TCP port; 0 picks a free one (read it back from ``HttpServer.port``).
        routes: path (e.g. ``"/metrics"``) -> coroutine function, with no argument or with the
            ``Request``, returning (status, content type, body[, extra headers]). The query
            string is not part of the path matched.

    Returns:
        The running HttpServer.

    Raises:
        OSError: when the address cannot be bound (port in use, address not local).
    """
    for path in routes:
        if not path.startswith("/"):
            raise ValueError(f"route {path!r} must start with '/'")
    holder: list[HttpServer] = []

    def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        holder[0]._on_connect(reader, writer)

    # AI_NUMERICHOST: the host must be an IP literal, so binding never waits on a resolver.
    server = await asyncio.start_server(
        on_connect,  # a plain callback: the connection task is created (and tracked) by HttpServer
        host,
        port,
        limit=MAX_REQUEST_BYTES,
        flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE,
        reuse_address=True,
        start_serving=False,  # accept only once ``holder`` is filled
    )
    http = HttpServer(server, host, routes)
    holder.append(http)
    await server.start_serving()
    log.info("http endpoints %s on %s:%d", ", ".join(sorted(routes)), host, http.port)
    return http
