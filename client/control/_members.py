"""The members of a rendezvous round as a worker sees them: ``Member``, ``Membership``, and
``MemberTable``, the immutable table that keeps the coordinator's encoding and decodes it on first
use; plus this process's cache of decoded tables, so that the sessions of one process that join
the same round share one table instead of each decoding N members.

May import foundations only (protocol, _errors). The session (session.py) fills them from join
replies.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import msgpack

from aiocoll._errors import ProtocolError

__all__ = [
    "JOINS_IN_FLIGHT",
    "TABLES",
    "TABLES_KEPT",
    "TABLE_FETCHES",
    "Member",
    "MemberTable",
    "Membership",
    "decode_members",
    "remember_table",
]


@dataclass(frozen=True)
class Member:
    """One member of a rendezvous round: its rank, the addresses its peer listener accepts
    connections on, and its host identity (ranks with equal ``host`` share a machine)."""

    rank: int
    addrs: list[tuple[str, int]]
    host: str


@dataclass(frozen=True)
class Membership:
    """The result of a completed rendezvous.

    Attributes:
        rank, world_size: this member's rank and the round's size.
        round: the job's round number (grows each time the job re-forms).
        session: the id the coordinator gave this member, used to resume after a reconnect.
        members: every member, sorted by rank (an immutable sequence, a MemberTable, shared by
            the sessions of this process that joined the same round and decoded on first use).
    """

    rank: int
    world_size: int
    round: int
    session: str
    members: Sequence[Member] = field(default_factory=tuple)


@dataclass(frozen=True)
class HostMembership:
    """The result of a completed rendezvous for the ranks one connection joined together (a
    host's ranks, see ``CoordinatorSession.join_host``).

    Attributes:
        ranks, sessions: each member's rank and session id, in the order they were named.
        world_size, round: the round's size and number.
    """

    ranks: tuple[int, ...]
    sessions: tuple[str, ...]
    world_size: int
    round: int


# Member tables decoded in this process, by digest: sessions of one process that join the same
# round share one immutable table instead of each decoding its own copy (N sessions x N members).
TABLES_KEPT = 8
TABLES: collections.OrderedDict[bytes, MemberTable] = collections.OrderedDict()
# Tables being fetched, by (event loop, digest): one ``table`` request per process and round.
TABLE_FETCHES: dict[tuple[int, bytes], asyncio.Future[MemberTable]] = {}
# Joins in flight, by (event loop, coordinator address, job): the first takes the table inline.
JOINS_IN_FLIGHT: dict[tuple[int, str, str], int] = {}


def remember_table(digest: bytes, table: MemberTable) -> MemberTable:
    TABLES[digest] = table
    TABLES.move_to_end(digest)
    while len(TABLES) > TABLES_KEPT:
        TABLES.popitem(last=False)
    return table


def _unpack_table(payload: bytes) -> Any:
    try:
        return msgpack.unpackb(payload, raw=False)
    except Exception as exc:
        raise ProtocolError(f"the coordinator sent an undecodable member table: {exc}") from exc


def decode_members(raw: Any) -> tuple[Member, ...]:
    """Members from the wire's list of {rank, addrs, host} maps, sorted by rank."""
    if not isinstance(raw, list):
        raise ProtocolError(f"the coordinator sent a member table of type {type(raw).__name__}")
    # Filled in place of Member.__init__ (a frozen dataclass's __init__ goes through
    # object.__setattr__ per field: half the cost of a 10,000-member table), after the same
    # checks its fields' types would need.
    new = object.__new__
    members = []
    try:
        for m in raw:
            rank, addrs, host = m["rank"], m.get("addrs", ()), m.get("host", "")
            pairs = [(h, p) for h, p in addrs]
            if type(rank) is not int or type(host) is not str:
                raise TypeError(f"entry {m!r:.200}")
            for h, p in pairs:
                if type(h) is not str or type(p) is not int:
                    raise TypeError(f"address in entry {m!r:.200}")
            member = new(Member)
            fields = member.__dict__
            fields["rank"] = rank
            fields["addrs"] = pairs
            fields["host"] = host
            members.append(member)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ProtocolError(f"the coordinator sent a malformed member table: {exc!r}") from exc
    if any(members[i].rank > members[i + 1].rank for i in range(len(members) - 1)):
        members.sort(key=lambda m: m.rank)
    return tuple(members)


class MemberTable(Sequence[Member]):
    """The members of a round, sorted by rank: an immutable sequence of ``Member`` that keeps
    the coordinator's encoding and decodes it on first use (len, index, iteration, equality).

    A join returns as soon as the table's bytes are here, as a TCPStore rendezvous returns
    with its address strings; the Member objects are built once per process and table, when
    someone first looks. A malformed table raises ProtocolError then.
    """

    __slots__ = ("_members", "_raw")

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._members: tuple[Member, ...] | None = None

    def _decoded(self) -> tuple[Member, ...]:
        members = self._members
        if members is None:
            members = self._members = decode_members(_unpack_table(self._raw))
            self._raw = b""
        return members

    @overload
    def __getitem__(self, index: int) -> Member: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Member, ...]: ...
    def __getitem__(self, index: int | slice) -> Member | tuple[Member, ...]:
        return self._decoded()[index]

    def __len__(self) -> int:
        return len(self._decoded())

    def __iter__(self) -> Iterator[Member]:
        return iter(self._decoded())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MemberTable):
            return other is self or self._decoded() == other._decoded()
        if isinstance(other, (tuple, list)):
            return list(self._decoded()) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"MemberTable({list(self._decoded())!r})"
