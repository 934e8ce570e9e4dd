"""The one factory of a worker's transport: which link kind serves each peer, and making them.

Imports foundations and client/data/transports (the link kinds); never the public surface. The
public layer calls ``open_transport`` before rendezvous (the tcp listener: its address goes
into the membership table) and ``connect_links`` after it; nothing else names a link kind.

Choosing: from the membership table (each member's rank, addresses and host identity) and the
setting ``AIOCOLL_TRANSPORT`` (or the ``choice`` argument, for tests and benchmarks):

- ``auto`` (default): for each peer, the first kind of ``AUTO_ORDER`` that is available in this
  process and serves the pair (a same-host kind only peers with the same host identity);
- ``tcp``: tcp for every peer;
- ``shm``: shared memory for every peer on this host (an error where it is not available), tcp
  across hosts.

Every member computes the same choice from the same table, so both ends of a pair agree.

Adding a link kind (a GPU-direct link, say): write its Link (see _link_interface.py), a
``LinkKind`` whose ``connect`` makes the links for the peers it was given and ``attach``es them
to the transport, add it to ``KINDS`` (and to ``AUTO_ORDER`` where ``auto`` should prefer it).
Nothing else changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from aiocoll._deadline import Deadline
from aiocoll._env import env_text
from aiocoll._host import host_identity

from ._kind import (
    CHOICES,
    SHM_PORT,
    TRANSPORT_ENV,
    LinkKind,
    PeerEntry,
    PeerRow,
    shm_address,
    tcp_addresses,
)
from ._link import LinkTransport
from ._shm_kind import ShmKind
from .tcp import TcpTransport

__all__ = [
    "AUTO_ORDER",
    "CHOICES",
    "KINDS",
    "SHM_PORT",
    "TRANSPORT_ENV",
    "LinkKind",
    "PeerEntry",
    "PeerRow",
    "choose_link_kinds",
    "connect_links",
    "host_identity",
    "listen_addresses",
    "open_transport",
    "shm_address",
    "tcp_addresses",
    "transport_choice",
]


class _Tcp(LinkKind):
    name = "tcp"

    async def connect(
        self,
        transport: LinkTransport,
        peers: Sequence[int],
        table: Mapping[int, PeerEntry],
        deadline: Deadline,
    ) -> None:
        assert isinstance(transport, TcpTransport)  # open_transport made it
        await transport.connect({r: tcp_addresses(table[r].addrs) for r in peers}, deadline, peers)


KINDS: dict[str, LinkKind] = {"tcp": _Tcp(), "shm": ShmKind()}
# ``auto``'s preference, first match wins; tcp serves every pair, so it comes last.
AUTO_ORDER: tuple[str, ...] = ("shm", "tcp")


def transport_choice(value: str | None = None) -> str:
    """The link-kind setting: ``value``, else ``AIOCOLL_TRANSPORT``, else "auto"; checked.

    Raises:
        ValueError: not one of auto, tcp, shm; or shm, which this process cannot use.
    """
    raw = value if value is not None else (env_text(TRANSPORT_ENV) or "")
    choice = raw.strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{TRANSPORT_ENV}={raw!r} is not one of {', '.join(CHOICES)} (default auto)")
    if choice != "auto":
        kind = KINDS.get(choice)
        why = "this aiocoll has no shared-memory link kind yet" if kind is None else kind.unavailable()
        if why is not None:
            raise ValueError(f"{TRANSPORT_ENV}={choice}: {why}; set {TRANSPORT_ENV}=auto or tcp")
    return choice


def choose_link_kinds(rank: int, table: Mapping[int, PeerEntry], choice: str) -> dict[int, str]:
    """Each peer's link kind (see the module header); ``choice`` as from ``transport_choice``."""
    mine = table[rank].host
    order = AUTO_ORDER if choice == "auto" else (choice, "tcp")
    usable = [KINDS[name] for name in order if name in KINDS and KINDS[name].unavailable() is None]
    kinds: dict[int, str] = {}
    for peer, entry in table.items():
        if peer == rank:
            continue
        same_host = bool(mine) and entry.host == mine
        kinds[peer] = next(k.name for k in usable if same_host or not k.same_host_only)
    return kinds


def open_transport(
    rank: int | None, world_size: int | None, *, token: str | None, job: str, choice: str | None = None
) -> TcpTransport:
    """The process's transport, before rendezvous: it listens for tcp links (tcp serves every
    pair the other kinds do not). Call its ``listen`` and publish the address.

    Raises:
        ValueError: a bad link-kind setting (checked here, before anything is started).
    """
    transport_choice(choice)
    return TcpTransport(rank, world_size, token=token, job=job)


async def listen_addresses(
    transport: TcpTransport, iface: str, *, token: str | None, job: str, choice: str | None = None
) -> list[list[Any]]:
    """Start listening for every link kind this process may use (before rendezvous); returns
    the addresses to publish in the membership table: the tcp one, and the shared-memory one
    unless the setting is tcp."""
    addr = await transport.listen(iface)
    addrs: list[list[Any]] = [[addr[0], addr[1]]]
    setting = transport_choice(choice)
    shm = KINDS.get("shm")
    if setting != "tcp" and shm is not None and shm.unavailable() is None:
        from ._shm_kind import prepare_shm

        addrs.append(prepare_shm(transport, token=token, job=job, forced=setting == "shm"))
    return addrs


async def connect_links(
    transport: LinkTransport,
    table: Sequence[PeerEntry] | Mapping[int, PeerEntry],
    deadline: Deadline,
    choice: str | None = None,
) -> dict[int, str]:
    """Link ``transport`` to every other member of ``table``, each over its chosen kind, all
    kinds at once; returns each peer's kind.

    Raises:
        RendezvousError: some link was not made within the deadline (names the ranks).
        AuthenticationError: a peer refused our token.
    """
    rows = table if isinstance(table, Mapping) else {entry.rank: entry for entry in table}
    kinds = choose_link_kinds(transport.rank, rows, transport_choice(choice))
    by_kind: dict[str, list[int]] = {}
    for peer, name in sorted(kinds.items()):
        by_kind.setdefault(name, []).append(peer)
    connects = [KINDS[name].connect(transport, peers, rows, deadline) for name, peers in by_kind.items()]
    if len(connects) == 1:
        await connects[0]
    elif connects:
        await asyncio.gather(*connects)
    return kinds
