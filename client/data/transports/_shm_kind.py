"""The shm link kind: which peers it serves (those on this host), this process's shared-memory
host (its arena, the rings of each pair and the Unix socket peers dial, made before rendezvous:
``prepare_shm``) and the dialling of peers, with the fall-back to tcp. The links it makes are
client.data.transports.shm's.

Imports foundations, client.data._shm and this package's _kind, tcp and shm modules; never the
public surface.

The collectives of a group whose members all share this host read each other's arenas directly
(client.data._shm_coll); this kind makes the arenas available to them (``shm_host``).

Choosing (client/data/transports/_factory.py): ``auto`` prefers this kind for peers with our host
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
from aiocoll._env import env_int
from aiocoll._errors import AuthenticationError, RendezvousError

from .._shm import ShmHost, ShmPeer, ShmUnavailable, region_bytes
from ._kind import SHM_PORT, TRANSPORT_ENV, LinkKind, PeerEntry, shm_address, tcp_addresses
from ._link import LinkTransport
from .shm import ShmLink
from .tcp import TcpTransport

__all__ = ["SHM_CHUNK_ENV", "ShmKind", "prepare_shm", "shm_host"]

log = logging.getLogger("aiocoll.client.shm")

SHM_CHUNK_ENV = "AIOCOLL_SHM_CHUNK"
_DEFAULT_CHUNK = 1 << 20
_REGIONS = 64  # groups of one process that can use the arena at once (one region each)
_RING_BYTES = 4 << 20  # each direction of each pair: bounded, touched only as far as used


def _chunk() -> int:
    chunk = env_int(SHM_CHUNK_ENV) or _DEFAULT_CHUNK
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
    chunk = _chunk()

    def on_peer(peer: ShmPeer) -> None:
        transport.attach(ShmLink(peer, transport, max_payload=transport.max_payload, own_arena=host.mem))

    host = ShmHost(
        None if transport.rank < 0 else transport.rank,
        token=token,
        job=job,
        regions=_REGIONS,
        region_bytes=region_bytes(chunk),
        ring_bytes=_RING_BYTES,
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
