"""The transport interface the algorithm executor runs over; imports only the standard library.

A transport moves whole messages between the ranks of one job (global ranks). Implementations:
client/transports/memory.py (in-process, for unit tests of algorithms), client/transports/tcp.py
(authenticated peer links), and later shm (same host) and cuda (staging / IPC). Algorithms never
see which one they run on.

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
from collections.abc import Callable, Hashable
from typing import Any

__all__ = ["LostPeerHandler", "RecvCallback", "Tag", "Transport"]

Tag = tuple[Hashable, ...]
LostPeerHandler = Callable[[int, BaseException], None]
RecvCallback = Callable[[tuple[int, dict[str, Any]] | None, BaseException | None], None]
"""``callback(result, exc)`` for ``post_recv``: ``result`` is what ``recv`` returns, or ``exc`` what
it raises (asyncio.CancelledError when the receive was discarded)."""


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

    def post_recv(self, src: int | None, tag: Tag, into: memoryview, callback: RecvCallback) -> None:
        """Post a receive like ``recv`` whose outcome is handed to ``callback`` on the loop
        instead of being awaited (small operations run without a task of their own this way).

        Transports that can call ``callback`` straight from their reader override this, which
        saves an event-loop iteration per message; this default runs ``recv`` in a task.
        ``callback`` may run before ``post_recv`` returns, when the message is already here.
        """
        task = asyncio.ensure_future(self.recv(src, tag, into))
        task.add_done_callback(functools.partial(_hand_over, callback))

    @abstractmethod
    def discard(self, tag_prefix: Tag) -> None:
        """Forget buffered messages and cancel waiting recvs whose tag starts with ``tag_prefix``.

        Used when an operation fails, so late messages for it do not pile up.
        """

    @abstractmethod
    def on_peer_lost(self, handler: LostPeerHandler) -> None:
        """Register a callback run (on the loop) when a peer's link breaks."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close every link; pending recvs fail. Calling it twice is fine."""


def _hand_over(callback: RecvCallback, task: asyncio.Future[tuple[int, dict[str, Any]]]) -> None:
    if task.cancelled():
        callback(None, asyncio.CancelledError())
        return
    exc = task.exception()
    callback(None if exc is not None else task.result(), exc)
