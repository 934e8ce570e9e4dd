"""The one factory of a worker's transport: which link kind serves each peer, and making them.

Imports foundations and client/transports (the link kinds); never the public surface. The
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

Adding a link kind (shm, cuda): write its Link (see _link.py), a ``LinkKind`` whose ``connect``
makes the links for the peers it was given and ``attach``es them to the transport, add it to
``KINDS`` (and to ``AUTO_ORDER`` where ``auto`` should prefer it). Nothing else changes.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiocoll._deadline import Deadline
from aiocoll._host import host_identity

from ._link import LinkTransport
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

TRANSPORT_ENV = "AIOCOLL_TRANSPORT"
CHOICES = ("auto", "tcp", "shm")
SHM_PORT = 0  # a membership address ["@name", SHM_PORT] is a shared-memory (abstract Unix) listener


def shm_address(addrs: Sequence[Sequence[Any]]) -> str | None:
    """A membership row's shared-memory address ("@name"), if it published one."""
    return next((str(a[0]) for a in addrs if is_shm_address(a)), None)


def is_shm_address(addr: Sequence[Any]) -> bool:
    return len(addr) == 2 and str(addr[0]).startswith("@") and addr[1] == SHM_PORT


def tcp_addresses(addrs: Sequence[Sequence[Any]]) -> list[Sequence[Any]]:
    """A membership row's addresses without the shared-memory one."""
    return [a for a in addrs if not is_shm_address(a)]


class PeerEntry(Protocol):
    """One row of the membership table (client.session.Member fits)."""

    @property
    def rank(self) -> int: ...

    @property
    def addrs(self) -> Sequence[Sequence[Any]]: ...

    @property
    def host(self) -> str: ...


@dataclass(frozen=True)
class PeerRow:
    """A membership-table row built from other sources than the coordinator (a store)."""

    rank: int
    addrs: Sequence[Sequence[Any]]
    host: str = ""


class LinkKind(ABC):
    """How links of one kind are made."""

    name: str
    same_host_only: bool = False

    def unavailable(self) -> str | None:
        """None when this kind can be used in this process, else why not (for the error)."""
        return None

    @abstractmethod
    async def connect(
        self,
        transport: LinkTransport,
        peers: Sequence[int],
        table: Mapping[int, PeerEntry],
        deadline: Deadline,
    ) -> None:
        """Make and ``attach`` a link to every rank of ``peers``; returns once all are attached.

        Raises:
            RendezvousError (names the ranks), AuthenticationError.
        """


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


KINDS: dict[str, LinkKind] = {"tcp": _Tcp()}
# ``auto``'s preference, first match wins; tcp serves every pair, so it comes last.
AUTO_ORDER: tuple[str, ...] = ("shm", "tcp")


def transport_choice(value: str | None = None) -> str:
    """The link-kind setting: ``value``, else ``AIOCOLL_TRANSPORT``, else "auto"; checked.

    Raises:
        ValueError: not one of auto, tcp, shm; or shm, which this process cannot use.
    """
    raw = value if value is not None else os.environ.get(TRANSPORT_ENV, "")
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
        from .shm import prepare_shm

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


# The shm kind builds on the names above (LinkKind, the tcp kind's transport).
from .shm import ShmKind  # noqa: E402

KINDS["shm"] = ShmKind()
