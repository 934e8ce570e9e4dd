"""Small address helpers shared by every layer: HOST:PORT text and free-port probing.

Foundation module: imports only the standard library. Host names are never resolved here (the
machine's resolver may never answer); hosts are used as given.
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "host_port"]


def host_port(host: str, port: int | str) -> str:
    """``HOST:PORT`` text, an IPv6 host in brackets (``[::1]:29500``) so the port stays unambiguous."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0, read it, close).

    The socket is closed at once, so another program could take the port before the caller binds
    it; use it only where the binding process is not ours to hand a socket to (a worker's store).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
