"""The coordinator `aiocoll run` embeds when no --coordinator is given.

One small function, so the launcher depends on the coordinator service through a single seam:
it starts ``aiocoll.server.Coordinator`` on the launcher's own event loop, on 127.0.0.1 with a
port the kernel picks, and hands back a handle to stop it. It lives on the public-surface side
(aiocoll/cli) and may import aiocoll.server, never the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["EmbeddedCoordinator", "EmbeddedCoordinatorUnavailable", "start_embedded_coordinator"]

EMBEDDED_HOST = "127.0.0.1"


class EmbeddedCoordinatorUnavailable(RuntimeError):
    """This installation has no coordinator service to embed."""


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
