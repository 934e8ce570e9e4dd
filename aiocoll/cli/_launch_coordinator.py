"""The launcher's coordinator: the one `aiocoll run` embeds when no --coordinator is given, and
the check that a --coordinator answers before any worker starts.

Two small functions, so the launcher depends on the coordinator service through a single seam:
one starts ``aiocoll.server.Coordinator`` on the launcher's own event loop, on 127.0.0.1 with a
port the kernel picks, and hands back a handle to stop it; the other waits (bounded) until
something accepts a connection at an external coordinator's address, so that a wrong or dead
address fails the launch at once instead of leaving every worker to find out. It lives on the
public-surface side (aiocoll/cli) and may import aiocoll.server, never the other way round.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "CoordinatorNotAnswering",
    "EmbeddedCoordinator",
    "EmbeddedCoordinatorUnavailable",
    "start_embedded_coordinator",
    "wait_for_coordinator",
]

EMBEDDED_HOST = "127.0.0.1"


class EmbeddedCoordinatorUnavailable(RuntimeError):
    """This installation has no coordinator service to embed."""


class CoordinatorNotAnswering(ConnectionError):
    """Nothing accepted a connection at the coordinator's address in time; ``reason`` says what
    the last attempt met (``connection refused``, ``timed out``, a name that does not resolve)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _why(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer: timed out"
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve: {exc.strerror or exc}"
    if isinstance(exc, OSError) and exc.errno == errno.ECONNREFUSED:
        return "connection refused: nothing listens on that port"
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return repr(exc)


async def wait_for_coordinator(
    host: str, port: int, timeout: float, on_wait: Callable[[str], None] | None = None
) -> None:
    """Return once something accepts a TCP connection at ``host:port``, trying for ``timeout`` s.

    Only the connection is checked (it is closed at once, before any handshake, which a
    coordinator passes over in silence): whether it is an aiocoll coordinator and holds the
    job's token, the workers' own handshake says.

    Args:
        host, port: the coordinator's address (--coordinator).
        timeout: seconds to keep trying (a coordinator may be starting beside the launcher).
        on_wait: called once, with the reason, when the first attempt fails and trying goes on.

    Raises:
        CoordinatorNotAnswering: nothing accepted within ``timeout``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    told = False
    while True:
        left = deadline - loop.time()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), max(left, 0.1))
        except (OSError, asyncio.TimeoutError) as exc:
            reason = _why(exc)
            left = deadline - loop.time()
            if left <= 0:
                raise CoordinatorNotAnswering(reason) from None
            if not told and on_wait is not None:
                on_wait(reason)
            told = True
            await asyncio.sleep(min(0.25, left))
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return


class EmbeddedCoordinator(Protocol):
    """What the launcher needs of a running coordinator."""

    @property
    def port(self) -> int: ...

    async def stop(self) -> None: ...


async def start_embedded_coordinator(
    token: str | None, port: int = 0
) -> tuple[EmbeddedCoordinator, str, int]:
    """Start a coordinator in this process, listening on 127.0.0.1 only, by default on a free port.

    It serves every generation of the job (restarts rendezvous again under the same job id), and
    stops when the launcher exits. Loopback only: workers of a single-node job are local, and
    nothing else should be able to join without --coordinator being chosen on purpose.

    Args:
        token: the shared secret workers will present, or None.
        port: the port to listen on; 0 lets the kernel pick a free one.

    Returns:
        (coordinator, host, port): call ``await coordinator.stop()`` when the job is over.

    Raises:
        EmbeddedCoordinatorUnavailable: if aiocoll.server.Coordinator cannot be imported.
        OSError: if the listening socket cannot be opened.
    """
    try:
        from aiocoll.server import Coordinator  # type: ignore[attr-defined,unused-ignore]
    except ImportError as exc:
        raise EmbeddedCoordinatorUnavailable(
            f"this aiocoll installation has no coordinator to embed ({exc}); start one with "
            "'aiocoll coordinator --port 29500' and pass --coordinator 127.0.0.1:29500"
        ) from exc
    coordinator: Any = Coordinator(host=EMBEDDED_HOST, port=port, token=token)
    await coordinator.start()
    return coordinator, EMBEDDED_HOST, int(coordinator.port)
