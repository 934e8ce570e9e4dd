"""``aiocoll.connect_store``: a Store backed by a running coordinator.

Part of the public surface (it may import aiocoll.client); it exists so that users get a
coordinator-backed store from a URL without knowing about sessions.
"""

from __future__ import annotations

import datetime
import logging
import warnings
from urllib.parse import urlsplit

from aiocoll._env import env_text
from aiocoll.client.control.session import CoordinatorSession
from aiocoll.protocol._coordinator import ROLE_STORE

__all__ = ["connect_store", "parse_tcp_url"]

log = logging.getLogger("aiocoll")


def parse_tcp_url(url: str) -> tuple[str, int]:
    """Split ``tcp://HOST:PORT`` (IPv6 as ``tcp://[::1]:PORT``) into (host, port).

    Raises:
        ValueError: for another scheme, a missing host or a missing or invalid port.
    """
    if not isinstance(url, str):
        raise TypeError(f"store URL must be a str like 'tcp://127.0.0.1:29500', not {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme != "tcp":
        raise ValueError(f"store URL {url!r} must start with tcp:// (for example tcp://127.0.0.1:29500)")
    try:
        port = parts.port
    except ValueError:
        port = None
    if not parts.hostname or port is None:
        raise ValueError(f"store URL {url!r} must name a host and a port, as in tcp://127.0.0.1:29500")
    return parts.hostname, port


async def connect_store(
    url: str,
    *,
    token: str | None = None,
    job: str | None = None,
    timeout: float | datetime.timedelta = 300.0,
    pipeline_sets: bool = True,
) -> CoordinatorSession:
    """Connect to the coordinator at ``url`` as a plain store client.

    Args:
        url: ``tcp://HOST:PORT`` of a running aiocoll coordinator.
        token: the shared secret; default: the environment variable AIOCOLL_TOKEN.
        job: whose key space to use; default: AIOCOLL_JOB, else "default".
        timeout: seconds for connecting, reconnecting after a drop, and every wait by default.
        pipeline_sets: True (the default): ``set``, ``append`` and ``multi_set`` return once
            queued, as torch's TCPStore's set does; a later call of this store sees the value, a
            refusal is raised by a later call, ``flush()`` or ``aclose()``, and ``flush()`` waits
            for the acknowledgement (docs/COORDINATOR.md, "What a set promises"). False: each
            returns once acknowledged (one round trip).

    Returns:
        An ``aiocoll.Store`` (a CoordinatorSession with role "store"); close it with ``aclose``.

    Raises:
        ValueError: for a malformed URL. CoordinatorUnreachable: nothing answered in time.
        AuthenticationError: the coordinator holds another token.
    """
    host, port = parse_tcp_url(url)
    if token is None:
        token = env_text("AIOCOLL_TOKEN", strip=False)
    if job is None:
        job = env_text("AIOCOLL_JOB", strip=False) or "default"
    if not token:
        message = (
            f"connecting to the coordinator at {host}:{port} without a token: anyone who can reach that "
            f"port can read and change job {job!r}'s keys. Set AIOCOLL_TOKEN (or pass token=) on the "
            f"coordinator and every client"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        log.warning(message)
    return await CoordinatorSession.connect(
        host, port, token=token, job=job, role=ROLE_STORE, timeout=timeout, pipeline_sets=pipeline_sets
    )
