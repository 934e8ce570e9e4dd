"""The coordinator's listening socket, accepting in batches: libuv (under uvloop) accepts one
connection per loop turn, so a herd of thousands of hosts connecting at once would wait in the
kernel's queue, one per turn, and overflow it (each dropped SYN costs its client a second). Here
every readiness accepts up to ACCEPT_BATCH connections and hands each to the loop as a transport.
May import only the standard library; the Coordinator (_coordinator.py) owns it.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Callable

__all__ = ["ACCEPT_BATCH", "Listener"]

log = logging.getLogger("aiocoll.server")

# Connections accepted per readiness of the listening socket (the rest wait for the next turn).
ACCEPT_BATCH = 256
# The most connections the kernel queues for us; it caps this at net.core.somaxconn.
BACKLOG = 65535
# Out of descriptors: stop accepting for this long (the queue holds the connections meanwhile).
_PAUSE_WHEN_EXHAUSTED = 0.1
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Listener:
    """A bound, listening TCP socket whose accepted connections become ``protocol_factory()``'s."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        *,
        on_exhausted: Callable[[OSError], None],
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # "::" means IPv6 only, as asyncio's servers do: "0.0.0.0" is the IPv4 listener.
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._loop = loop
        self._sock: socket.socket | None = sock
        self._factory = protocol_factory
        self._on_exhausted = on_exhausted
        self._pending: set[asyncio.Task[None]] = set()
        self.port: int = sock.getsockname()[1]
        loop.add_reader(sock.fileno(), self._accept_ready)

    def _accept_ready(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # reset by the client before we took it
            except OSError as exc:
                if exc.errno in _EXHAUSTED:
                    self._on_exhausted(exc)
                    self._loop.remove_reader(sock.fileno())
                    self._loop.call_later(_PAUSE_WHEN_EXHAUSTED, self._resume)
                    return
                raise
            task = self._loop.create_task(self._adopt(conn))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _adopt(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:  # gone before it became a transport: nothing to tell anyone
            log.debug("event=accept_failed reason=%s", exc)
            conn.close()

    def _resume(self) -> None:
        if self._sock is not None:
            self._loop.add_reader(self._sock.fileno(), self._accept_ready)

    def close(self) -> None:
        """Stop accepting (connections already accepted are not touched)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            self._loop.remove_reader(sock.fileno())
            sock.close()
