"""The shm link kind: peers on this host, joined by an authenticated Unix socket that also
handed over each side's shared-memory arena (client._shm).

Imports foundations, client._shm and this package's tcp module; never the public surface.

Messages between two ranks of one host (point-to-point, and collectives that do not run over
the arenas) travel as frames over the Unix socket, with the tcp kind's framing and zero-copy
reads (the link is a TcpLink over another socket: no TCP/IP stack, no loopback device). The
collectives of a group whose members all share this host read each other's arenas directly
(client._shm_coll); this kind makes the arenas available to them (``shm_host``).

The link's end-of-file is the peer's loss: a rank killed with SIGKILL closes its socket in the
kernel, and its peers get PeerLostError naming it at once through the links' usual path.

Choosing (client/transports/_factory.py): ``auto`` prefers this kind for peers with our host
identity; when a peer's address cannot be reached (another network namespace: two containers
on one machine) or its memory turns out not to be shared, the pair falls back to tcp and the
job goes on (logged). ``AIOCOLL_TRANSPORT=shm`` makes that an error instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from aiocoll._deadline import Deadline
from aiocoll._errors import AuthenticationError, RendezvousError

from .._shm import ShmHost, ShmPeer, ShmUnavailable
from ._factory import SHM_PORT, TRANSPORT_ENV, LinkKind, PeerEntry, shm_address, tcp_addresses
from ._link import LinkTransport
from .tcp import TcpLink, TcpTransport

__all__ = ["SHM_CHUNK_ENV", "ShmKind", "ShmLink", "prepare_shm", "shm_host"]

log = logging.getLogger("aiocoll.client.shm")

SHM_CHUNK_ENV = "AIOCOLL_SHM_CHUNK"
_DEFAULT_CHUNK = 1 << 20
_REGIONS = 64  # groups of one process that can use the arena at once (one region each)


class ShmLink(TcpLink):
    """A link to a peer on this host: frames over the authenticated Unix socket."""

    kind = "shm"


def _chunk() -> int:
    raw = os.environ.get(SHM_CHUNK_ENV, "")
    try:
        chunk = int(raw) if raw else _DEFAULT_CHUNK
    except ValueError:
        raise ValueError(f"{SHM_CHUNK_ENV}={raw!r} is not a number of bytes") from None
    if chunk < 64 * 1024 or chunk % 4096:
        raise ValueError(f"{SHM_CHUNK_ENV}={chunk}: use a multiple of 4096 bytes of at least 64 KiB")
    return chunk


def shm_host(transport: LinkTransport) -> ShmHost | None:
    """The process's shared-memory host, when the shm kind was prepared on ``transport``."""
    host = transport.kind_state.get(ShmKind.name)
    return host if isinstance(host, ShmHost) else None


def prepare_shm(transport: TcpTransport, *, token: str | None, job: str, forced: bool) -> list[Any]:
    """Make this process's arena and listen for peers of this host (before rendezvous).

    Returns:
        the address to publish beside the tcp one: ``["@name", SHM_PORT]``.
    """
    from .._shm_coll import region_bytes

    chunk = _chunk()

    def on_peer(peer: ShmPeer) -> None:
        transport.attach(ShmLink(peer.sock, peer.rank, transport, max_payload=transport.max_payload))

    host = ShmHost(
        None if transport.rank < 0 else transport.rank,
        token=token,
        job=job,
        regions=_REGIONS,
        region_bytes=region_bytes(chunk),
        watch=False,  # the link reads the socket; its close is the peer's loss
        on_peer=on_peer,
    )
    host.chunk = chunk
    host.forced = forced
    transport.kind_state[ShmKind.name] = host
    transport.on_close(host.close)
    return [host.listen(), SHM_PORT]


class ShmKind(LinkKind):
    name = "shm"
    same_host_only = True

    def unavailable(self) -> str | None:
        if not (hasattr(os, "memfd_create") and hasattr(os, "eventfd")):
            return "shared memory needs Linux (memfd_create and eventfd)"
        return None

    async def connect(
        self,
        transport: LinkTransport,
        peers: Sequence[int],
        table: Mapping[int, PeerEntry],
        deadline: Deadline,
    ) -> None:
        host = shm_host(transport)
        assert isinstance(transport, TcpTransport)  # open_transport made it
        if host is not None:
            host.assign(transport.rank)
        # Higher ranks dial; we wait for every peer's link, whichever kind it ends up being.
        dials = [self._dial(transport, host, p, table, deadline) for p in peers if p < transport.rank]
        tasks = [asyncio.ensure_future(d) for d in dials]
        try:
            await transport.wait_links(peers, deadline)
        finally:
            for task in tasks:
                task.cancel()

    async def _dial(
        self,
        transport: TcpTransport,
        host: ShmHost | None,
        peer: int,
        table: Mapping[int, PeerEntry],
        deadline: Deadline,
    ) -> None:
        addrs = table[peer].addrs
        address = shm_address(addrs)
        forced = host is not None and host.forced
        try:
            if host is None:
                raise ShmUnavailable("this process made no shared-memory arena")
            if not address:
                raise ShmUnavailable(f"rank {peer} published no shared-memory address")
            await host.connect(peer, address, timeout=deadline.remaining() or 10.0)
            return  # on_peer attached the link
        except AuthenticationError as exc:
            transport.fail_link(peer, exc)
            return
        except (ShmUnavailable, OSError) as exc:
            if forced:
                transport.fail_link(
                    peer,
                    RendezvousError(
                        f"{TRANSPORT_ENV}=shm: rank {transport.rank} cannot share memory with rank {peer} "
                        f"although both report host {table[peer].host!r} ({exc}); set {TRANSPORT_ENV}=auto "
                        "(tcp where memory cannot be shared) or tcp"
                    ),
                )
                return
            log.info("rank %d: no shared memory with rank %d (%s); using tcp", transport.rank, peer, exc)
        await transport.connect({peer: tcp_addresses(addrs)}, deadline, [peer])

