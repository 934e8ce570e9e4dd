"""The transport interface the algorithm driver and the engine run over; imports only the
standard library (and aiocoll._matching for the Tag type).

A transport moves whole messages between the ranks of one job (global ranks). There is one per
process: client/data/transports/_link.py's LinkTransport, which matches messages with the one
sans-IO matcher (aiocoll/_matching.py) and moves them over one link per peer, whatever its kind
(tcp, shm, and memory for unit tests). Algorithms and the engine never see which
kinds they run on. Every method the engine or the driver calls is declared here (nothing is
reached by getattr), and aiocoll/testing/transport_conformance.py covers each one for every
link kind.

Matching: a message is identified by (source rank, tag). Tags are tuples of str/int; collective
operations use ("c", group_id, seq, step), which is unique, so order never matters; point-to-point
uses ("p", group_id, user_tag), and messages with the same source and tag match in the order they
were sent (links are FIFO). A message that arrives before its ``recv`` is posted is kept in a
bounded per-peer inbox; when the inbox is full the link stops reading (backpressure) until a recv
consumes it.

Each message carries ``meta``: a small msgpack-able dict (the operation's signature, for mismatch
detection). Payloads are bytes-like views; a receive writes straight into ``into`` where the
transport can.
"""

from __future__ import annotations

import asyncio
import functools
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

from aiocoll._errors import PeerLostError
from aiocoll._matching import StrayHandler, Tag

__all__ = ["LandedCallback", "LostPeerHandler", "RecvCallback", "StrayHandler", "Tag", "Transport"]

LostPeerHandler = Callable[[int, BaseException], None]
RecvCallback = Callable[[tuple[int, dict[str, Any]] | None, BaseException | None], None]
"""``callback(result, exc)`` for ``post_recv``: ``result`` is what ``recv`` returns, or ``exc`` what
it raises (asyncio.CancelledError when the receive was discarded)."""
LandedCallback = Callable[[tuple[int, dict[str, Any], memoryview] | None, BaseException | None], None]
"""``callback(result, exc)`` for ``post_recv_landed``: ``result`` is what ``recv_landed`` returns,
or ``exc`` what it raises (as for RecvCallback)."""


class Transport(ABC):
    """Point-to-point message passing for one process.

    Attributes:
        rank: this process's global rank. world_size: ranks in the job.
    """

    rank: int
    world_size: int

    @abstractmethod
    async def send(self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]) -> None:
        """Send one message to ``dst``; returns once ``payload`` may be reused or freed.

        Raises:
            PeerLostError: ``dst`` is gone (or becomes so before the bytes are handed off).
        """

    def send_nowait(
        self, dst: int, tag: Tag, payload: memoryview, meta: dict[str, Any]
    ) -> Awaitable[None] | None:
        """Start ``send`` without a coroutine where the transport can: None when the payload was
        handed off at once (the common case for small messages: the caller may reuse it), else an
        awaitable that finishes the send (await it before reusing ``payload``). This default
        returns the ``send`` coroutine, not started.

        Raises:
            PeerLostError: ``dst`` is gone (at once, when that is already known).
        """
        return self.send(dst, tag, payload, meta)

    @abstractmethod
    async def recv(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]]:
        """Receive the next message with ``tag`` from ``src`` (None: from any rank) into ``into``.

        Returns:
            (source rank, the sender's meta).
        Raises:
            PeerLostError: the source is gone before the message arrived.
            MismatchError: the message's payload length differs from ``len(into)`` (the message is
                consumed; the sender's meta is attached to the error as ``.remote_meta``).
        """

    async def recv_landed(
        self, src: int | None, tag: Tag, into: memoryview
    ) -> tuple[int, dict[str, Any], memoryview]:
        """``recv`` for a payload that is only read afterwards (to be reduced): returns (source,
        meta, the memory holding the payload). That is ``into`` itself, unless the transport kept
        a message that arrived before its receive in a buffer of its own: then that buffer, and
        the copy into ``into`` is saved. This default always receives into ``into``."""
        got, meta = await self.recv(src, tag, into)
        return got, meta, into

    def recv_now(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | None:
        """A receive that completes inside its call, when it can: what ``recv`` returns if the
        message is here (or comes within a short in-place wait the transport chooses), else None
        with nothing posted. This default never can.

        Raises:
            MismatchError: the message's payload is not ``len(into)`` bytes (it is consumed).
        """
        return None

    def post_recv(self, src: int | None, tag: Tag, into: memoryview, callback: RecvCallback) -> None:
        """Post a receive like ``recv`` whose outcome is handed to ``callback`` on the loop
        instead of being awaited (small operations run without a task of their own this way).

        Transports that can call ``callback`` straight from their reader override this, which
        saves an event-loop iteration per message; this default runs ``recv`` in a task.
        ``callback`` may run before ``post_recv`` returns, when the message is already here.
        """
        task = asyncio.ensure_future(self.recv(src, tag, into))
        task.add_done_callback(functools.partial(_hand_over, callback))

    def post_recv_landed(self, src: int | None, tag: Tag, into: memoryview, callback: LandedCallback) -> None:
        """``recv_landed`` in ``post_recv``'s form: its outcome, (source, meta, the memory holding
        the payload), is handed to ``callback`` (a large reduced receive costs no task this way).

        Transports that can call ``callback`` straight from their reader override this; this
        default runs ``recv_landed`` in a task. ``callback`` may run before this returns.
        """
        task = asyncio.ensure_future(self.recv_landed(src, tag, into))
        task.add_done_callback(functools.partial(_hand_over, callback))

    @abstractmethod
    def discard(self, tag_prefix: Tag) -> None:
        """Forget buffered messages and cancel waiting recvs whose tag starts with ``tag_prefix``.

        Used when an operation fails, so late messages for it do not pile up.
        """

    def holds(self, src: int, tag: Tag) -> bool:
        """Whether a message ``tag`` from ``src`` arrived and waits for its receive (a message
        sent before its sender left stays receivable). This default: False."""
        return False

    @abstractmethod
    def retire(self, tag_prefix: Tag) -> None:
        """Mark an operation that completed successfully: a message under ``tag_prefix`` still
        buffered, or arriving later, was sent by a rank that called something else, and is handed
        to the ``on_stray`` handlers (the engine turns it into a MismatchError)."""

    @abstractmethod
    def on_stray(self, handler: StrayHandler) -> None:
        """Register ``handler(src, tag, meta)`` for messages under a retired prefix."""

    @abstractmethod
    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        """Register a callback run (on the loop) when a peer's link breaks."""

    @abstractmethod
    def mark_lost(self, rank: int, reason: str) -> None:
        """Treat ``rank`` as gone (the coordinator said so): close its link, fail its receives."""

    def take_in_from(self, rank: int) -> PeerLostError | None:
        """Before ``rank`` is failed on another's word: take in what it sent that is not read yet
        (its messages are delivered, an offer of its memory is read). Returns how its link ended,
        when it ended meanwhile (the rank's own account of its end), else None. Transports that
        read nothing ahead of the event loop have nothing to take in."""
        return None

    @property
    @abstractmethod
    def lost_peers(self) -> dict[int, str]:
        """Ranks whose link is gone (lost, or closed in order), with the reason."""

    @abstractmethod
    def debug_state(self) -> dict[str, Any]:
        """A snapshot of matching and link state, for diagnosing a stuck operation."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every link; pending recvs fail. Calling it twice is fine."""


def _hand_over(callback: Callable[[Any, BaseException | None], None], task: asyncio.Future[Any]) -> None:
    if task.cancelled():
        callback(None, asyncio.CancelledError())
        return
    exc = task.exception()
    callback(None if exc is not None else task.result(), exc)
