"""The link interface: what one peer's link of any kind provides, and what it reports to.

Imports only foundations (aiocoll._matching, aiocoll.algorithms._transport); never the transport
(_link.py), a kind's module or the public surface, so that the transport, its in-place waits and
its polling (_in_place.py, _loop_polling.py) and every kind build on it without a circle. A link
kind is a plug-in: adding one (as shm was added beside tcp) means writing a ``Link`` subclass and
its connector (see _factory.py), nothing else; the engine, the driver and the matcher never learn
which kind carries a message.

The interface, both directions:

``Link`` (one object per peer, made by its kind's connector) must provide
  - ``peer`` (the other end's global rank), ``kind`` (a class attribute: "tcp", "memory", ...)
    and ``closed`` (True once closed, never reset);
  - ``send_nowait(tag, payload, meta)``: queue one message, FIFO with every other message on this
    link; return None once ``payload`` was handed off (the caller may reuse it), else an awaitable
    that finishes when it was. Cancelling that awaitable withdraws the message if none of it has
    left yet (the stream stays whole either way). Raise PeerLostError when the link is closed;
  - ``pause_reading()`` / ``resume_reading()``: stop and restart taking messages from the peer
    (the matcher calls them for backpressure; a paused link must make its peer's sends wait once
    whatever buffering the medium has is full, never drop or reorder);
  - ``close(reason, lost=...)``: close at once (queued sends fail with PeerLostError); ``lost``
    says whether this was unexpected (a crash, a cut) or orderly; twice is fine;
  - ``aclose()``: an orderly goodbye (the peer sees an orderly close), bounded in time, then
    ``close(..., lost=False)``; twice is fine;
  - ``debug_state()``: a small dict for diagnosing a stuck operation.

and must report to its ``LinkHost`` (the LinkTransport it was attached to):
  - every message it takes from the peer, to ``host.matcher``: ``claim(peer, tag, nbytes)`` when it
    learns a payload's length before its bytes (land them where it answers, then
    ``landed(peer, tag, meta, payload)``), or ``arrived(peer, tag, meta, payload)`` for a whole
    message it did not claim (the matcher keeps ``payload`` without copying: it must stay valid);
  - its closing, once, to ``host.link_closed(link, reason, lost)``, from inside ``close``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import Any, ClassVar, Protocol

from aiocoll._matching import Matcher
from aiocoll.algorithms._transport import Tag

__all__ = ["Link", "LinkHost", "as_bytes_view"]

_EMPTY = memoryview(b"")


def as_bytes_view(buf: memoryview) -> memoryview:
    """``buf`` as a flat byte view (no copy); the empty view for an empty buffer."""
    if buf.format == "B" and buf.ndim == 1:
        return buf
    if not len(buf):
        return _EMPTY
    return buf.cast("B")


class LinkHost(Protocol):
    """What a link reports to (a LinkTransport)."""

    matcher: Matcher

    def link_closed(self, link: Link, reason: str, lost: bool) -> None: ...


class Link(ABC):
    """One peer's link, of one kind (see the module header for the whole contract)."""

    kind: ClassVar[str]
    peer: int
    closed: bool
    # Whether a receive waiting for this peer keeps the event loop polling for a bounded time
    # (LoopPolling.poll_for, _loop_polling.py) rather than letting it sleep: for peers whose messages
    # come within microseconds (this host), a sleep and its wake-up cost more than the wait.
    poll_while_waiting: ClassVar[bool] = False

    @abstractmethod
    def send_nowait(self, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> Awaitable[None] | None:
        """Queue one message; None once handed off, else an awaitable finishing the hand-off.

        Raises:
            PeerLostError: the link is closed.
        """

    def read_now(self) -> bool:
        """Take in what the peer sent so far, here and now, as the event loop's reader would
        (its frames are dispatched to the matcher the same way); True when a frame came. A
        receive that expects a reply within microseconds polls with this instead of letting the
        loop sleep (LinkTransport.recv_now). Links without such a read return False."""
        return False

    def take_now(self, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | bool:
        """``read_now`` for a receive of the next message ``tag`` from this peer, when nothing
        in the matcher comes before it (LinkTransport.recv_now): a message that the link holds
        whole in memory of its own (the shm kind's mailbox), of that tag and ``len(into)``
        bytes, is copied into ``into`` and its (peer, meta) returned; else True when something
        else came (handed to the matcher, or announced and left for ``read_now``: the receive
        then goes through the matcher), False when nothing did."""
        return self.read_now()

    def peer_waits(self) -> bool:
        """Whether the peer waits in place for a message from us (its receive's spin, ``watch``)
        and has taken in all we sent: then it sends us nothing before its wait ends. Links
        that cannot tell return False."""
        return False

    def watch(self, on: bool, in_place: bool = True) -> None:
        """A receive starts (True) or stops (False) calling ``read_now`` in a spin (``in_place``),
        or the event loop's polling turns do (LoopPolling._poll_turn): a link whose peer can
        hand it a message in memory while it is read (the shm kind's mailbox) tells the peer so,
        which then need not wake this rank, and takes what came as it stopped. Others do
        nothing."""
        return None

    @abstractmethod
    def pause_reading(self) -> None:
        """Stop taking messages from the peer (its sends wait once the medium's buffers fill)."""

    @abstractmethod
    def resume_reading(self) -> None:
        """Take messages from the peer again."""

    @abstractmethod
    def close(self, reason: str, *, lost: bool) -> None:
        """Close at once; reports to the host once. Twice is fine."""

    @abstractmethod
    async def aclose(self) -> None:
        """Say goodbye (bounded in time), then close as orderly. Twice is fine."""

    @abstractmethod
    def debug_state(self) -> dict[str, Any]:
        """A small dict for diagnosing a stuck operation."""
