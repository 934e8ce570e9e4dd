"""Test doubles for the coordinator link without sockets: a transport that records what the link
writes, and a link already through a real handshake (shared by the tests of client/control/_connection.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiocoll.client.control._connection import CoordinatorLink

from aiocoll.protocol import ClientHandshake, ServerHandshake
from aiocoll.protocol._coordinator import ROLE_WORKER


class FakeTransport:
    """Records every write the link makes (one entry per write call); lets a test play the
    coordinator."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.aborted = False
        self.limits: dict[str, int] = {}

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, pieces: list[Any]) -> None:
        self.writes.append(b"".join(bytes(piece) for piece in pieces))

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        self.limits = {"high": high, "low": low}

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 29500) if name == "peername" else None

    def abort(self) -> None:
        self.aborted = True

    def take_writes(self) -> list[bytes]:
        """The writes since the last take, one entry per write call."""
        writes, self.writes = self.writes, []
        return writes

    def take(self) -> bytes:
        """The bytes written since the last take."""
        return b"".join(self.take_writes())


async def handshaken_link(
    token: str = "t", on_settle: Callable[[list[Any], bytes], None] | None = None
) -> tuple[CoordinatorLink, FakeTransport]:
    """A worker link that went through a real handshake against ServerHandshake."""
    hello = ClientHandshake(token, role=ROLE_WORKER, job="j")
    link = CoordinatorLink(hello, lambda e: None, lambda *_: None, on_settle=on_settle)
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    server = ServerHandshake(token, roles={ROLE_WORKER})
    link.data_received(server.receive_data(transport.take()))
    link.data_received(server.receive_data(transport.take()))
    await asyncio.wait_for(link.ready, 1)
    return link, transport
