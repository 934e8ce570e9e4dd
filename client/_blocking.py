"""Blocking connections to the coordinator: connect and authenticate on a plain socket, for the
threads that must not depend on an event loop (the beat thread, the blocking store client).

May import foundations only (protocol, _errors).
"""

from __future__ import annotations

import socket

from aiocoll.protocol import ClientHandshake

__all__ = ["connect_blocking"]


def connect_blocking(address: tuple[str, int], handshake: ClientHandshake, timeout: float) -> socket.socket:
    """A TCP connection to ``address`` that has run ``handshake`` to its end (TCP_NODELAY set),
    with ``timeout`` seconds for connecting and for each read of the handshake.

    Raises:
        OSError: the connection failed or was closed (TimeoutError when it took too long).
        AuthenticationError, ProtocolError: the handshake's own verdicts.
    """
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(handshake.start())
        while not handshake.done:
            data = sock.recv(4096)
            if not data:  # a connection failure (retried), not proof of another protocol
                raise ConnectionResetError(
                    f"the coordinator at {address[0]}:{address[1]} closed the connection during the handshake"
                )
            out = handshake.receive_data(data)
            if out:
                sock.sendall(out)
    except BaseException:
        sock.close()
        raise
    return sock
