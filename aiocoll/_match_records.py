"""The records the matcher (aiocoll/_matching.py) takes in and hands out: tags, completions,
links' reading sides, posted and polled receives, early messages, and the size-mismatch error.

Imports only the standard library and aiocoll._errors; never asyncio, sockets, numpy, client/,
server/ or the public surface (sans-IO, as the matcher). It exists apart from the matcher so that
the matcher's module holds its rules alone; aiocoll._matching re-exports every name here, and
callers import them from there.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol

from aiocoll._errors import MismatchError

__all__ = ["Completion", "Early", "Flow", "Polled", "Posted", "StrayHandler", "Tag", "length_mismatch"]

Tag = tuple[Hashable, ...]
StrayHandler = Callable[[int, Tag, dict[str, Any]], None]


class Completion(Protocol):
    """Where a receive's outcome goes: ``(src, meta)``, or ``(src, meta, memory)`` for an in-place
    receive, or an exception; ``cancel`` when the receive is discarded."""

    def done(self) -> bool: ...

    def set_result(self, result: Any) -> None: ...

    def set_exception(self, exception: BaseException) -> None: ...

    def cancel(self) -> bool: ...


class Flow(Protocol):
    """A link's reading side, switched by the matcher for backpressure."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Posted:
    """A posted receive. ``in_place``: its result names the memory holding the payload (``into``,
    or the buffer an early payload already landed in, which is then not copied)."""

    __slots__ = ("done", "in_place", "into", "order", "src", "tag")

    def __init__(
        self, src: int | None, tag: Tag, into: memoryview, done: Completion, order: int, in_place: bool
    ):
        self.src = src
        self.tag = tag
        self.into = into
        self.done = done
        self.order = order
        self.in_place = in_place


class Polled:
    """A polled receive and its completion (see the module header): ``outcome`` is
    ``(src, meta)``, None while nothing came, or raises what failed it (a size mismatch)."""

    __slots__ = ("error", "into", "prev", "result", "src", "tag")

    def __init__(self, src: int, tag: Tag, into: memoryview, prev: Polled | None) -> None:
        self.src = src
        self.tag = tag
        self.into = into
        self.result: tuple[int, dict[str, Any]] | None = None
        self.error: BaseException | None = None
        self.prev = prev  # the receive polled when this one started (nested), restored after

    def bound(self) -> Posted:
        """This receive as a posted one, once ``claim`` binds it to a message (rare: most come
        whole, through ``deliver`` or ``arrived``)."""
        return Posted(self.src, self.tag, self.into, self, -1, False)

    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def set_result(self, result: Any) -> None:
        self.result = result

    def set_exception(self, exception: BaseException) -> None:
        self.error = exception

    def cancel(self) -> bool:
        return False

    def outcome(self) -> tuple[int, dict[str, Any]] | None:
        if self.error is not None:
            raise self.error
        return self.result


class Early:
    """A message that arrived before its receive."""

    __slots__ = ("meta", "payload", "src")

    def __init__(self, src: int, meta: dict[str, Any], payload: memoryview):
        self.src = src
        self.meta = meta
        self.payload = payload


def length_mismatch(src: int, tag: Tag, got: int, want: int, meta: dict[str, Any]) -> MismatchError:
    """The error for a payload of ``got`` bytes where the receive expected ``want``."""
    err = MismatchError(
        f"rank {src} sent {got} bytes for message {tag!r} but this rank expected {want}: the ranks "
        f"called the operation with different sizes or dtypes (sender's signature: {meta!r})",
        ranks=[src],
    )
    err.remote_meta = meta  # type: ignore[attr-defined]
    return err
