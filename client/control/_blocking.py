"""Blocking connections to the coordinator: connect and authenticate on a plain socket, for the
threads that must not depend on an event loop (the beat thread, the blocking store client).

May import foundations only (protocol, _errors).
"""

from __future__ import annotations

import contextlib
import socket

from aiocoll._net import host_port
from aiocoll.protocol import ClientHandshake
from aiocoll.protocol._handshake import SilentServer

__all__ = ["connect_blocking"]


def connect_blocking(
    address: tuple[str, int], handshake: ClientHandshake, timeout: float, silence: float | None = None
) -> socket.socket:
    """A TCP connection to ``address`` that has run ``handshake`` to its end (TCP_NODELAY set),
    with ``timeout`` seconds for connecting and for each read of the handshake.

    Args:
        silence: seconds the server may take to send its first byte once connected (None: the
            same as any read, ``timeout``).

    Raises:
        OSError: the connection failed or was closed (TimeoutError when it took too long).
        SilentServer: it accepted the connection and sent nothing within ``silence``.
        AuthenticationError, ProtocolError: the handshake's own verdicts (naming the address).
    """
    where = host_port(*address)
    handshake.name_server(where)
    limit = timeout if silence is None else min(timeout, silence)
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(handshake.start())
        sock.settimeout(limit)
        heard = False
        while not handshake.done:
            try:
                data = sock.recv(4096)
            except TimeoutError:
                if heard:
                    raise TimeoutError(
                        f"the handshake with {where} did not finish within {timeout:.3g}s"
                    ) from None
                said = (
                    f"{where} accepted the connection but sent nothing in answer to aiocoll's hello "
                    f"within {limit:g}s"
                )
                if silence is not None and limit >= silence:
                    raise SilentServer(said) from None
                raise TimeoutError(said) from None
            if not heard:
                heard = True
                sock.settimeout(timeout)
            if not data:  # a connection failure (retried), not proof of another protocol
                raise ConnectionResetError(
                    f"the coordinator at {where} closed the connection during the handshake"
                )
            out = handshake.receive_data(data)
            if out:
                sock.sendall(out)
    except BaseException:
        if handshake.farewell:  # the server's proof failed: say so before hanging up
            with contextlib.suppress(OSError):
                sock.sendall(handshake.farewell)
        sock.close()
        raise
    return sock
