"""The fault-injection proxy itself, over loopback against an echo server: it forwards, holds
bytes while paused (or only the replies), delays, drops, refuses and cuts, so that the tests
that rely on it can."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from aiocoll.testing.fault_proxy import FaultProxy

pytestmark = pytest.mark.integration


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()


async def _roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await reader.readexactly(len(data))


@pytest.mark.timeout(30)
async def test_proxy_forwards_holds_while_paused_and_cuts(echo_port: int) -> None:
    async with FaultProxy("127.0.0.1", echo_port) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(reader, writer, b"hello") == b"hello"
        assert proxy.links == 1

        proxy.pause()
        writer.write(b"held")
        await writer.drain()
        pending = asyncio.ensure_future(reader.readexactly(4))
        await asyncio.sleep(0.2)
        assert not pending.done(), "a paused proxy must not forward"
        proxy.resume()
        assert await asyncio.wait_for(pending, 5) == b"held"

        proxy.cut()
        assert proxy.links == 0
        assert await asyncio.wait_for(reader.read(), 5) == b"", "a cut link is closed for the client"
        writer.close()

        # New links go through after a cut.
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await _roundtrip(reader, writer, b"again") == b"again"
        writer.close()


@pytest.mark.timeout(30)
async def test_proxy_holding_replies_lets_requests_through_and_answers_after_resume() -> None:
    received: list[bytes] = []

    async def recording_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            received.append(data)
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(recording_echo, "127.0.0.1", 0)
    try:
        async with FaultProxy("127.0.0.1", server.sockets[0].getsockname()[1]) as proxy:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            proxy.hold_replies()
            writer.write(b"req1")
            await writer.drain()
            pending = asyncio.ensure_future(reader.readexactly(4))
            for _ in range(500):
                if received:
                    break
                await asyncio.sleep(0.01)
            assert received == [b"req1"], "a request must reach the target while replies are held"
            await asyncio.sleep(0.2)
            assert not pending.done(), "a held reply must not be forwarded"
            proxy.resume()
            assert await asyncio.wait_for(pending, 5) == b"req1"
            writer.close()
    finally:
        server.close()


@pytest.mark.timeout(30)
async def test_proxy_delays_drops_and_refuses_on_demand(echo_port: int) -> None:
    async with FaultProxy("127.0.0.1", echo_port) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        proxy.delay(0.15)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await _roundtrip(reader, writer, b"slow") == b"slow"
        assert loop.time() - started >= 0.25, "each direction adds the delay"
        proxy.delay(0)

        proxy.drop()
        writer.write(b"lost")
        await writer.drain()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), 0.3)
        proxy.drop(False)
        assert await _roundtrip(reader, writer, b"kept") == b"kept"
        writer.close()

        proxy.refuse()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        with pytest.raises(ValueError):
            proxy.delay(-1)
