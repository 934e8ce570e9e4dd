"""FaultProxy: a TCP proxy for tests that delays, pauses, drops or cuts the links through it.

Part of the testing surface; imports only asyncio. Tests put it between a client and a
coordinator (or between two peers) to make loss, silence and slowness happen on demand:

    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        session = await CoordinatorSession.connect("127.0.0.1", proxy.port, ...)
        proxy.cut()        # every link through the proxy drops now; new ones are accepted
        proxy.pause()      # bytes stop moving both ways (a silent peer), until resume()
        proxy.hold_replies()  # requests still reach the target; its answers wait, until resume()

Buffers are bounded: a pump reads one chunk and holds it until it can forward it.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

__all__ = ["FaultProxy"]

_CHUNK = 64 * 1024
# A target that never answers a connect (SYNs dropped) must not leave the accepting task waiting
# forever: the client's link is aborted, as a refused connect would be.
_CONNECT_TIMEOUT = 10.0


class _Link:
    __slots__ = ("client", "tasks", "upstream")

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class FaultProxy:
    """Forward every connection on ``port`` to ``target_host:target_port``, with faults on demand.

    Args:
        target_host, target_port: where links go. host, port: where the proxy listens (port 0:
            a free one, read ``.port`` after ``start()``).
    """

    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1", port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._replies_flowing = asyncio.Event()  # target-to-client bytes (cleared by hold_replies)
        self._replies_flowing.set()
        self._delay = 0.0
        self._dropping = False
        self._refusing = False
        self.accepted = 0

    @property
    def links(self) -> int:
        """How many links are open through the proxy now."""
        return len(self._links)

    async def start(self) -> int:
        """Listen; returns the port."""
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def retarget(self, target_host: str, target_port: int) -> None:
        """Send new links elsewhere (a coordinator that came back on another port)."""
        self.target_host, self.target_port = target_host, target_port

    def cut(self) -> None:
        """Abort every open link now (both sides see a reset); later connections go through."""
        for link in list(self._links):
            link.abort()
        self._links.clear()

    def pause(self) -> None:
        """Stop forwarding bytes in both directions (links stay open, nobody hears anything)."""
        self._flowing.clear()

    def hold_replies(self) -> None:
        """Stop forwarding bytes from the target to the clients, while requests still go
        through: the target carries out requests whose answers nobody hears (until resume() or
        a cut). Tests use it to lose replies to requests known to be applied, whatever the
        machine's load, where a delay would only make that likely."""
        self._replies_flowing.clear()

    def resume(self) -> None:
        """Forward again (both ways), starting with what was held."""
        self._flowing.set()
        self._replies_flowing.set()

    def delay(self, seconds: float) -> None:
        """Hold each chunk ``seconds`` before forwarding it (0 forwards at once)."""
        if seconds < 0:
            raise ValueError(f"delay must be >= 0 seconds, got {seconds}")
        self._delay = seconds

    def drop(self, enabled: bool = True) -> None:
        """Discard every byte in both directions while enabled (a black hole that keeps links open)."""
        self._dropping = enabled

    def refuse(self, enabled: bool = True) -> None:
        """Close new connections as soon as they arrive while enabled."""
        self._refusing = enabled

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._refusing:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), _CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()
            return
        link = _Link(writer, up_writer)
        self._links.add(link)
        link.tasks = [
            asyncio.ensure_future(self._pump(reader, up_writer, link, None)),
            asyncio.ensure_future(self._pump(up_reader, writer, link, self._replies_flowing)),
        ]

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        link: _Link,
        replies: asyncio.Event | None,
    ) -> None:
        """Forward ``reader`` to ``writer``; ``replies`` (target-to-client pumps) also holds."""
        try:
            while True:
                data = await reader.read(_CHUNK)
                if not data:
                    break
                await self._held(replies)
                if self._delay:
                    await asyncio.sleep(self._delay)
                    await self._held(replies)
                if self._dropping:
                    continue
                writer.write(data)
                await writer.drain()
            # One side closed: close the other, as a direct connection would.
            with contextlib.suppress(OSError, RuntimeError):
                writer.write_eof()
        except (OSError, asyncio.IncompleteReadError):
            # One side was reset (a peer killed with bytes unread, say): reset the other too, as
            # a direct connection would be; left open, it would wait for answers that never come.
            link.abort()
        finally:
            if all(t.done() or t is asyncio.current_task() for t in link.tasks):
                self._links.discard(link)
                link.client.close()
                link.upstream.close()

    async def _held(self, replies: asyncio.Event | None) -> None:
        """Wait while a pause (or, for replies, a hold) lasts."""
        await self._flowing.wait()
        if replies is not None:
            await replies.wait()

    async def stop(self) -> None:
        """Stop listening and cut every link. Twice is fine."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self.resume()
        self.cut()

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
