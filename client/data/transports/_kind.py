"""What every link kind shares: the kind interface, the membership rows it reads, the addresses.

Imports foundations (aiocoll._deadline) and this package's _link; never a kind's module nor the
factory, so the kinds (tcp.py, shm.py) and the factory (_factory.py) all build on it without
importing each other in a circle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from aiocoll._deadline import Deadline

from ._link import LinkTransport

__all__ = [
    "CHOICES",
    "SHM_PORT",
    "TRANSPORT_ENV",
    "LinkKind",
    "PeerEntry",
    "PeerRow",
    "is_shm_address",
    "shm_address",
    "tcp_addresses",
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
    """One row of the membership table (client.control.session.Member fits)."""

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
