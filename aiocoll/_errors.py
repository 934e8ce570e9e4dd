"""The error hierarchy every layer raises; it imports nothing from aiocoll.

All errors derive from DistError (torch.distributed's name for its base error). Where a builtin
describes the failure too, we inherit it as well, so ``except TimeoutError`` keeps working.
Messages always name what went wrong: rank, operation, group, sequence number, key.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "AuthenticationError",
    "CollectiveTimeout",
    "DistError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "StoreError",
    "StoreTimeout",
]


class DistError(RuntimeError):
    """Base of every aiocoll error."""


class AuthenticationError(DistError):
    """The peer or coordinator did not prove it holds the shared token (or we did not)."""


class ProtocolError(DistError):
    """Bytes that break the wire grammar: bad magic, oversized header, undecodable frame.

    Attributes:
        remote: True when the other side broke the grammar, False when we were asked to send
            something the protocol cannot carry.
    """

    def __init__(self, message: str, *, remote: bool = True) -> None:
        super().__init__(message)
        self.remote = remote


class RendezvousError(DistError):
    """Rendezvous was refused or could not complete (duplicate rank, world-size disagreement)."""


class StoreError(DistError):
    """A store operation was refused (wrong-typed key or value, value too large, ...)."""


class StoreTimeout(StoreError, TimeoutError):
    """A store wait ran out before the keys existed.

    Attributes:
        keys: the keys that were still missing.
    """

    def __init__(self, keys: Iterable[str], timeout: float | None, message: str | None = None) -> None:
        self.keys = list(keys)
        self.timeout = timeout
        if message is None:
            message = (
                f"timed out after {timeout:.3g}s waiting for store key(s) {self.keys!r}"
                if timeout is not None
                else f"timed out waiting for store key(s) {self.keys!r}"
            )
        super().__init__(message)


class CollectiveTimeout(DistError, TimeoutError):
    """An operation's deadline passed.

    Attributes:
        op: operation name, group: group name, seq: the group's sequence number of the call,
        missing_ranks: the (global) ranks that did not answer in time.
    """

    def __init__(
        self,
        op: str,
        group: str,
        seq: int,
        missing_ranks: Sequence[int],
        timeout: float | None,
        message: str | None = None,
    ) -> None:
        self.op = op
        self.group = group
        self.seq = seq
        self.missing_ranks = sorted(set(missing_ranks))
        self.timeout = timeout
        if message is None:
            # "Timed out" as torch's backends word it: torch's tests and users' retry code match it.
            waited = f" after {timeout:.3g}s" if timeout is not None else ""
            message = (
                f"{op} (group {group!r}, seq {seq}): Timed out{waited} waiting for rank(s) "
                f"{self.missing_ranks}. Check that every rank calls the same operations in the "
                f"same order, or raise the timeout."
            )
        super().__init__(message)


class PeerLostError(DistError):
    """A peer's process or link is gone.

    Attributes:
        rank: the (global) rank that was lost; reason: what we observed.
    """

    def __init__(self, rank: int, reason: str = "", message: str | None = None) -> None:
        self.rank = rank
        self.reason = reason
        if message is None:
            message = f"lost rank {rank}" + (f": {reason}" if reason else "")
        super().__init__(message)


class MismatchError(DistError):
    """Ranks called different operations, roots, dtypes or sizes at the same sequence number.

    Attributes:
        group, seq: where; ranks: the ranks whose calls disagreed; details: both signatures.
    """

    def __init__(self, message: str, *, group: str = "", seq: int = -1, ranks: Sequence[int] = ()) -> None:
        self.group = group
        self.seq = seq
        self.ranks = list(ranks)
        super().__init__(message)
