"""Sans-IO handshake: mutual challenge-response authentication with the shared token.
Imports only _errors and _framing; no sockets, no asyncio.

    client -> server   MAGIC, HELLO {t, v, role, job, nonce, ...extra}
    server -> client   CHALLENGE {t, v, nonce, proof=HMAC(token, "server" | hello | snonce), ...info}
    client -> server   AUTH {t, proof=HMAC(token, "client" | hello | snonce)} | MISMATCH {t}
    server -> client   WELCOME {t} | REJECT {t, reason, busy?}

A client whose check of the server's proof fails sends MISMATCH (``ClientHandshake.farewell``)
before it hangs up, never its own proof: the server then knows the tokens differ, and tells that
apart from a client that closed in the middle (it exited, or gave up), which is no auth failure.

The token never crosses the wire; both sides prove they hold it, and the proofs cover the exact
hello bytes, so the job, role and rank a client announced cannot be altered in flight. Before the
handshake completes nothing larger than ``HANDSHAKE_MAX_HEADER`` is parsed and no payload is
accepted. Either side raises AuthenticationError (wrong token) or ProtocolError (not our protocol).

The client's errors say what answered and what to do: a server whose first bytes cannot begin a
CHALLENGE is named at once (an HTTP server, or the bytes themselves); a failed proof says which
side holds no token, when one of them holds none. ``ClientHandshake.server`` names the other end
in those messages ("the coordinator at HOST:PORT"); whoever opens the connection sets it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from typing import Any

import msgpack

from .._errors import AuthenticationError, ProtocolError
from ._framing import PREFIX, Frame, FrameDecoder, encode_header

__all__ = [
    "HANDSHAKE_MAX_HEADER",
    "MAGIC",
    "PROTOCOL_VERSION",
    "ClientHandshake",
    "ServerBusy",
    "ServerHandshake",
    "SilentServer",
    "token_bytes",
]

MAGIC = b"AIOCOLL\x00"
PROTOCOL_VERSION = 1
HANDSHAKE_MAX_HEADER = 4096
_NONCE_BYTES = 32


class ServerBusy(ConnectionError):
    """The server refused the connection for a reason that is not the client's (it has no file
    descriptor to spare, say): trying again later may succeed."""


class SilentServer(TimeoutError):
    """The server accepted the connection but sent not one byte in answer to our hello within
    the time the opener allowed. An aiocoll server answers a hello at once, so silence on several
    attempts in a row means something else listens there (a torch TCPStore waits for more)."""


_OTHER_RELEASE = "it is not an aiocoll server, or runs another aiocoll release (use the same on both sides)"
# How many of a server's first bytes an error quotes.
_QUOTED_BYTES = 24


def foreign_reply(first: bytes, address: str) -> ProtocolError | None:
    """None when ``first`` (the first bytes a server sent, at least PREFIX.size of them) can
    begin a handshake frame; else the error that says what answered at ``address`` instead."""
    header_len, payload_len = PREFIX.unpack_from(first)
    if 0 < header_len <= HANDSHAKE_MAX_HEADER and payload_len == 0:
        return None
    # A status line, or an HTML page with none (an HTTP/0.9 answer: Python's http.server gives
    # one to a request line it cannot parse).
    if first.startswith(b"HTTP/") or first[:5].lower() in (b"<!doc", b"<html"):
        return ProtocolError(
            f"an HTTP server answered at {address} (the coordinator's --http-port, or another web "
            f"service), not an aiocoll coordinator: use the coordinator's main port (--port, 29500 "
            f"by default)"
        )
    return ProtocolError(
        f"{address} answered with bytes that are not aiocoll's (first bytes: "
        f"{first[:_QUOTED_BYTES]!r}): it is not an aiocoll coordinator or peer; check the port"
    )


def token_bytes(token: str | bytes | None) -> bytes:
    """The HMAC key for a token; None and "" both mean the empty secret."""
    if token is None:
        return b""
    return token.encode("utf-8") if isinstance(token, str) else bytes(token)


def _proof(key: bytes, label: bytes, hello_raw: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(key, label + b"|" + hello_raw + b"|" + server_nonce, hashlib.sha256).digest()


def _frame_bytes(header: dict[str, Any]) -> bytes:
    head = encode_header(header)
    return PREFIX.pack(len(head), 0) + head


def _one_frame(decoder: FrameDecoder, data: bytes, expecting: str) -> tuple[Frame | None, bytes]:
    """Feed ``data``; return at most one frame plus the raw bytes of its header (for proofs)."""
    frames = decoder.feed(data)
    if not frames:
        return None, b""
    if len(frames) > 1 or decoder.mid_frame:
        raise ProtocolError(f"unexpected data after the {expecting} frame during the handshake")
    frame = frames[0]
    return frame, msgpack.packb(frame.header, use_bin_type=True)


class ClientHandshake:
    """The connecting side. Call ``start()``, send its bytes, then ``receive_data`` until ``done``.

    Args:
        token: shared secret; role: "worker", "peer", "admin", ...; job: job id;
        extra: more hello fields (rank, session id), covered by the proofs.
    """

    def __init__(
        self, token: str | bytes | None, *, role: str, job: str, extra: dict[str, Any] | None = None
    ):
        self._key = token_bytes(token)
        self.role = role
        self.job = job
        self._hello: dict[str, Any] = {
            "t": "hello",
            "v": PROTOCOL_VERSION,
            "role": role,
            "job": job,
            "nonce": os.urandom(_NONCE_BYTES),
            **(extra or {}),
        }
        self._hello_raw = encode_header(self._hello)
        self._decoder = FrameDecoder(max_header=HANDSHAKE_MAX_HEADER, max_payload=0)
        self._state = "init"
        self._first: bytes | None = b""  # the server's first bytes, until there are enough to check them
        self.server_info: dict[str, Any] = {}
        self.done = False
        # Bytes to send before hanging up once the server's proof failed (MISMATCH), else b"".
        self.farewell = b""
        # What the errors call the other end (see ``name_server``).
        self.address = "the server"
        self.server = "the server"

    def name_server(self, address: str, server: str | None = None) -> None:
        """Name the other end in this handshake's errors: its ``address`` (HOST:PORT) and what
        it should be (default "the coordinator at ADDRESS"; a peer link says "rank 3 at ...")."""
        self.address = address
        self.server = server or f"the coordinator at {address}"

    def start(self) -> bytes:
        if self._state != "init":
            raise RuntimeError("handshake already started")
        self._state = "challenge"
        return MAGIC + PREFIX.pack(len(self._hello_raw), 0) + self._hello_raw

    def receive_data(self, data: bytes) -> bytes:
        """Feed bytes from the server; returns bytes to send (possibly empty).

        Raises:
            ProtocolError: the bytes are not aiocoll's (naming what answered). AuthenticationError:
                the server's proof failed, or it refused us. ServerBusy: it cannot take us now.
        """
        if self._first is not None:
            # Checked before the decoder sees them: its verdict on an HTTP reply would be "frame
            # header of 1213486160 bytes", which says nothing to whoever chose the port.
            self._first += data
            if len(self._first) < PREFIX.size:
                return b""
            data, self._first = self._first, None
            foreign = foreign_reply(data, self.address)
            if foreign is not None:
                raise foreign
        frames = self._decoder.feed(data)
        out = b""
        for frame in frames:
            out += self._on_frame(frame.header)
        return out

    def _on_frame(self, header: dict[str, Any]) -> bytes:
        kind = header.get("t")
        if kind == "reject":
            reason = header.get("reason", "no reason")
            if header.get("busy") is True:
                raise ServerBusy(f"{self.server} refused the connection: {reason}")
            raise AuthenticationError(f"{self.server} refused the connection: {reason}")
        if self._state == "challenge" and kind == "challenge":
            nonce, proof = header.get("nonce"), header.get("proof")
            if not isinstance(nonce, bytes) or not isinstance(proof, bytes):
                raise ProtocolError(f"malformed challenge from {self.server}: {_OTHER_RELEASE}")
            expected = _proof(self._key, b"server", self._hello_raw, nonce)
            if not hmac.compare_digest(expected, proof):
                self.farewell = _frame_bytes({"t": "mismatch"})
                raise AuthenticationError(self._tokens_differ(proof, nonce))
            self.server_info = {k: v for k, v in header.items() if k not in ("t", "nonce", "proof")}
            self._state = "welcome"
            return _frame_bytes({"t": "auth", "proof": _proof(self._key, b"client", self._hello_raw, nonce)})
        if self._state == "welcome" and kind == "welcome":
            self.server_info.update({k: v for k, v in header.items() if k != "t"})
            self._state = "done"
            self.done = True
            return b""
        raise ProtocolError(
            f"unexpected {kind!r} frame from {self.server} in handshake state {self._state!r}: "
            f"{_OTHER_RELEASE}"
        )

    def _tokens_differ(self, proof: bytes, nonce: bytes) -> str:
        """Which side lacks a token, when one does: we know our own, and a server without one
        proves with the empty secret."""
        if not self._key:
            return (
                f"this process has no token (AIOCOLL_TOKEN is not set) but {self.server} requires "
                f"one: set AIOCOLL_TOKEN (or pass token=) to the token it was started with (its "
                f"--token-file or AIOCOLL_TOKEN)"
            )
        if hmac.compare_digest(_proof(b"", b"server", self._hello_raw, nonce), proof):
            return (
                f"{self.server} has no token but this process has one (AIOCOLL_TOKEN or token=): "
                f"give it the same token (--token-file or AIOCOLL_TOKEN where it starts), or unset "
                f"AIOCOLL_TOKEN here"
            )
        return (
            f"{self.server} holds a different token from this process: set the same AIOCOLL_TOKEN "
            f"(or token=, --token-file) on both sides"
        )


class ServerHandshake:
    """The accepting side. Feed it bytes with ``receive_data``; send what it returns.

    After ``done``, ``hello`` holds the client's authenticated hello fields (role, job, rank...).
    A failure raises; ``reject_bytes(reason)`` gives a REJECT frame to send before closing.

    Args:
        token: shared secret; info: extra CHALLENGE fields (server id, version);
        roles: the roles this listener accepts.
    """

    def __init__(
        self,
        token: str | bytes | None,
        *,
        roles: frozenset[str] | set[str],
        info: dict[str, Any] | None = None,
    ):
        self._key = token_bytes(token)
        self._roles = frozenset(roles)
        self._info = info or {}
        # A small buffer: a server holds one per connection still in its handshake, and hundreds
        # of half-open connections must not cost 256 KiB (the decoder's default) each.
        self._decoder = FrameDecoder(
            max_header=HANDSHAKE_MAX_HEADER, max_payload=0, read_size=PREFIX.size + HANDSHAKE_MAX_HEADER
        )
        self._magic = b""
        self._state = "magic"
        self._hello_raw = b""
        self._nonce = os.urandom(_NONCE_BYTES)
        self.hello: dict[str, Any] = {}
        self.done = False
        self.mismatch = False  # the client said our proof failed its check (MISMATCH)

    @property
    def has_token(self) -> bool:
        """Whether this side holds a token (an empty one is none)."""
        return bool(self._key)

    @property
    def state(self) -> str:
        return self._state

    def receive_data(self, data: bytes) -> bytes:
        if self._state == "magic":
            need = len(MAGIC) - len(self._magic)
            self._magic += data[:need]
            data = data[need:]
            if not MAGIC.startswith(self._magic):
                raise ProtocolError("not an aiocoll client (bad magic bytes)")
            if len(self._magic) < len(MAGIC):
                return b""
            self._state = "hello"
        if not data:
            return b""
        if self._state == "hello":
            frame, raw = _one_frame(self._decoder, data, "hello")
            if frame is None:
                return b""
            return self._on_hello(frame.header, raw)
        if self._state == "auth":
            frame, _ = _one_frame(self._decoder, data, "auth")
            if frame is None:
                return b""
            return self._on_auth(frame.header)
        raise ProtocolError(f"unexpected data in handshake state {self._state!r}")

    def _on_hello(self, hello: dict[str, Any], raw: bytes) -> bytes:
        if hello.get("t") != "hello":
            raise ProtocolError(f"expected a hello frame, got {hello.get('t')!r}")
        version = hello.get("v")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"client speaks protocol version {version!r}; this server speaks {PROTOCOL_VERSION}: "
                f"use the same aiocoll release on both sides"
            )
        role, job, nonce = hello.get("role"), hello.get("job"), hello.get("nonce")
        if not isinstance(role, str) or role not in self._roles:
            raise ProtocolError(f"role {role!r} is not accepted here (accepted: {sorted(self._roles)})")
        if not isinstance(job, str) or not job or len(job) > 256:
            raise ProtocolError("hello must name a job (a non-empty string of at most 256 characters)")
        if not isinstance(nonce, bytes) or len(nonce) != _NONCE_BYTES:
            raise ProtocolError("hello carries no valid nonce")
        self.hello = hello
        # The proof covers the re-encoded hello; msgpack round trips are canonical for the types
        # a hello may hold, and a client that encoded differently simply fails authentication.
        self._hello_raw = raw
        self._state = "auth"
        return _frame_bytes(
            {
                "t": "challenge",
                "v": PROTOCOL_VERSION,
                "nonce": self._nonce,
                "proof": _proof(self._key, b"server", raw, self._nonce),
                **self._info,
            }
        )

    def _on_auth(self, header: dict[str, Any]) -> bytes:
        if header.get("t") == "mismatch":
            self.mismatch = True
            raise AuthenticationError(
                f"client (role {self.hello.get('role')!r}, job {self.hello.get('job')!r}) found our "
                f"proof wrong: the tokens differ, or one side holds none"
            )
        proof = header.get("proof")
        if header.get("t") != "auth" or not isinstance(proof, bytes):
            raise ProtocolError("expected an auth frame")
        expected = _proof(self._key, b"client", self._hello_raw, self._nonce)
        if not hmac.compare_digest(expected, proof):
            raise AuthenticationError(
                f"client (role {self.hello.get('role')!r}, job {self.hello.get('job')!r}) "
                f"failed authentication: wrong token"
            )
        self._state = "done"
        self.done = True
        return _frame_bytes({"t": "welcome"})

    @staticmethod
    def reject_bytes(reason: str, *, busy: bool = False) -> bytes:
        """A REJECT frame; ``busy``: not about the client (the server cannot take it now), so
        the client may try again (it raises ServerBusy, not AuthenticationError)."""
        header: dict[str, Any] = {"t": "reject", "reason": reason[:512]}
        if busy:
            header["busy"] = True
        return _frame_bytes(header)
