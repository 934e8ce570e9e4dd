"""The rendezvous' data: rounds, their members, the joins that wait for a round, and the states
a member and a round move through. Pure data; imports _model and _tables only. The joining
(_rendezvous) and what follows it (_membership) both work on these.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from typing import Any

from ._model import Conn, Job, MemberState, can_move
from ._tables import encode_rows, table_digest

__all__ = [
    "ALIVE",
    "JOINING",
    "LEFT",
    "LOST",
    "RESUMING",
    "JoinRequest",
    "Member",
    "Round",
    "RoundState",
    "round_can_move",
]

JOINING, ALIVE, RESUMING, LEFT, LOST = (
    MemberState.JOINING,
    MemberState.ALIVE,
    MemberState.RESUMING,
    MemberState.LEFT,
    MemberState.LOST,
)


class RoundState(enum.Enum):
    FORMING = "forming"  # members are joining
    COMPLETE = "complete"  # full; every member has its rank
    BROKEN = "broken"  # complete, and a member has since left or been lost: the next join opens a new one


# The only moves a round makes, as MemberState's (_model._MOVES): live and on restore alike (a
# restored round is made FORMING and moved on, so a snapshot cannot hold a round no run could).
_ROUND_MOVES: dict[RoundState, tuple[RoundState, ...]] = {
    RoundState.FORMING: (RoundState.COMPLETE,),
    RoundState.COMPLETE: (RoundState.BROKEN,),
    RoundState.BROKEN: (),
}


def round_can_move(old: RoundState, new: RoundState) -> bool:
    """Whether a round in state ``old`` may move to ``new``."""
    return new in _ROUND_MOVES[old]


class Member:
    """One rank of one rendezvous round."""

    __slots__ = (
        "addrs",
        "assigned",
        "beat",
        "conn",
        "host",
        "last_seen",
        "look_at",
        "rank",
        "reason",
        "request",
        "round",
        "session",
        "state",
    )

    def __init__(self, rank: int, addrs: Iterable[Sequence[Any]], host: str, rnd: Round) -> None:
        self.rank = rank
        # The coordinator picked this rank (the join asked for none): until the round completes
        # it may move to another free rank, so that a member asking for this one gets it.
        self.assigned = False
        # Tuples of str and int: the cyclic garbage collector stops tracking them, so a round of
        # 100,000 members is 100,000 objects for it to walk, not 300,000.
        self.addrs = tuple((host, port) for host, port in addrs)
        self.host = host
        self.session = ""
        self.state = JOINING
        self.conn: Conn | None = None
        self.beat: Conn | None = None  # its beat connection (ROLE_BEAT), heard apart from conn
        self.round = rnd
        self.request: JoinRequest | None = None  # the join it came with, until the round completes
        self.reason = ""
        self.last_seen = 0.0
        self.look_at = -1  # the liveness slot it is due in (_liveness); -1: none yet

    def move(self, new: MemberState) -> None:
        assert can_move(self.state, new), f"member {self.rank}: {self.state} -> {new}"
        self.state = new

    def restore(self, state: MemberState) -> None:
        """Move a member restored into a completed round (made JOINING) to the ``state`` the
        snapshot or journal gives it: every such member was alive once."""
        self.move(ALIVE)
        if state is not ALIVE:
            self.move(state)


class JoinRequest:
    """One ``join`` waiting for its round: the members it brought and how to answer it."""

    __slots__ = (
        "conn",
        "deadline",
        "many",
        "members",
        "req_id",
        "started",
        "table_in_payload",
        "table_ref",
        "timeout",
    )

    def __init__(self, conn: Conn, req_id: int, started: float, timeout: float | None, many: bool) -> None:
        self.conn = conn
        self.req_id = req_id
        self.started = started
        self.timeout = timeout
        self.deadline: float | None = None
        self.many = many  # it named its members in a list: answered with lists
        self.members: list[Member] = []
        self.table_in_payload = False
        self.table_ref = False

    @property
    def waiting(self) -> bool:
        """It still waits for its round (the deadline heap asks)."""
        return bool(self.members) and self.members[0].state is JOINING

    def ranks(self) -> str:
        ranks = [m.rank for m in self.members]
        return (
            f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[:16]}{'...' if len(ranks) > 16 else ''}"
        )


class Round:
    __slots__ = (
        "free_hint",
        "gave_up",
        "job",
        "members",
        "number",
        "state",
        "table",
        "table_digest",
        "world_size",
    )

    def __init__(self, job: Job, number: int, world_size: int) -> None:
        self.job = job
        self.number = number
        self.world_size = world_size
        self.members: dict[int, Member] = {}
        # Ranks whose join timed out while the round formed: they had joined, so a later timeout's
        # message counts them among the joined, not the missing.
        self.gave_up: set[int] = set()
        self.state = RoundState.FORMING
        self.free_hint = 0  # lowest rank that may be free
        # The completed round's member table, msgpack-encoded once, and its digest; made when a
        # join or a ``table`` request first needs it.
        self.table: bytes | None = None
        self.table_digest = b""

    def move(self, new: RoundState) -> None:
        assert round_can_move(self.state, new), f"round {self.number}: {self.state.value} -> {new.value}"
        self.state = new

    def breaks(self) -> None:
        """A member of a complete round left or was lost: the round is broken (once)."""
        if self.state is RoundState.COMPLETE:
            self.move(RoundState.BROKEN)

    @property
    def complete(self) -> bool:
        return self.state is not RoundState.FORMING

    @property
    def broken(self) -> bool:
        return self.state is RoundState.BROKEN

    def full_table(self) -> tuple[bytes, bytes]:
        """The member table (msgpack, sorted by rank) and its digest, encoded once."""
        if self.table is None:
            self.table = encode_rows(sorted(self.members.values(), key=lambda m: m.rank))
            self.table_digest = table_digest(self.table)
        return self.table, self.table_digest
