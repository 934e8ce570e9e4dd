"""The launcher's coordinator: the one `aiocoll run` embeds when no --coordinator is given, and
the check that a --coordinator answers before any worker starts.

Two small functions, so the launcher depends on the coordinator service through a single seam:
one starts ``aiocoll.server.Coordinator`` on the launcher's own event loop, on 127.0.0.1 with a
port the kernel picks, and hands back a handle to stop it; the other waits (bounded) until an
external coordinator completes the handshake with the job's token, so that a wrong or dead
address, or a wrong token, fails the launch once instead of leaving every worker to find out. It lives on the
public-surface side (aiocoll/cli) and may import aiocoll.server, never the other way round.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from typing import Any, Protocol

__all__ = [
    "CoordinatorNotAnswering",
    "CoordinatorRefused",
    "EmbeddedCoordinator",
    "EmbeddedCoordinatorUnavailable",
    "start_embedded_coordinator",
    "wait_for_coordinator",
]

EMBEDDED_HOST = "127.0.0.1"


class CoordinatorRefused(ConnectionError):
    """Something answered at the coordinator's address that is not this job's coordinator: another
    token, a web server, a torch store. The message names what answered and what to do."""


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
    host: str,
    port: int,
    timeout: float,
    *,
    token: str | None,
    job: str,
    on_wait: Callable[[str], None] | None = None,
) -> None:
    """Return once an aiocoll coordinator at ``host:port`` completed the handshake with ``token``,
    trying for ``timeout`` s.

    The probe authenticates as an admin (as ``aiocoll status`` does: it creates no job and keeps
    none alive), with the same connect loop the workers use, so whatever would stop every worker
    (another token, a web server or a torch store on that port) stops the launch once instead.

    Args:
        host, port: the coordinator's address (--coordinator).
        timeout: seconds to keep trying (a coordinator may be starting beside the launcher).
        token: the job's token (None: none). job: the job's name.
        on_wait: called once, with the reason, when the first attempt fails and trying goes on.

    Raises:
        CoordinatorNotAnswering: nothing answered within ``timeout``.
        CoordinatorRefused: something answered that is not this job's coordinator (the message
            says what and what to do).
    """
    from aiocoll._deadline import Deadline
    from aiocoll._errors import AuthenticationError, ProtocolError
    from aiocoll.client.control._connection import open_link
    from aiocoll.client.control._link_keeper import ConnectTries, CoordinatorUnreachable
    from aiocoll.protocol import ClientHandshake
    from aiocoll.protocol._coordinator import ROLE_ADMIN

    deadline = Deadline(timeout)
    tries = ConnectTries(host, port, first=True)
    told = False
    while True:
        try:
            link, _ = await open_link(
                host,
                port,
                ClientHandshake(token, role=ROLE_ADMIN, job=job),
                on_event=lambda _event: None,
                on_lost=lambda _link, _exc: None,
                timeout=tries.attempt_time(deadline),
                silence=tries.silence,
            )
        except (OSError, asyncio.TimeoutError, AuthenticationError, ProtocolError) as exc:
            try:
                pause = tries.failed(exc, deadline)
            except CoordinatorUnreachable:
                raise CoordinatorNotAnswering(_why(exc)) from None
            except (AuthenticationError, ProtocolError) as verdict:
                raise CoordinatorRefused(str(verdict)) from None
            if not told and on_wait is not None:
                on_wait(_why(exc))
            told = True
            await asyncio.sleep(pause)
            continue
        link.close()
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
