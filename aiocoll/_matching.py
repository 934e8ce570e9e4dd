"""The message matcher: one per process, sans-IO (events in, outcomes out; no sockets, no loop).

Imports only the standard library, aiocoll._errors and its records (aiocoll/_match_records.py:
tags, completions, posted and polled receives, early messages; re-exported here); never asyncio,
sockets, numpy, client/, server/ or the public surface. Every link kind (client/data/transports:
tcp, shm, and memory for unit tests) feeds the one Matcher of its process, so the rules below hold
identically whatever carries the bytes, and nothing else in aiocoll matches messages.

Rules (the Transport contract of aiocoll/algorithms/_transport.py, decided here once):

- A message is identified by (source rank, tag). Receives are posted by (source, tag) or by tag
  from any source; a message goes to the earliest-posted receive that accepts it, and messages of
  one source with one tag match in the order they were sent (links are FIFO).
- A message that arrives before its receive waits in a bounded per-source inbox. Once a source's
  inbox holds ``inbox_messages`` messages or ``inbox_bytes`` bytes the matcher tells that source's
  link to stop reading (``Flow.pause_reading``) and to resume once a receive drains it below both
  bounds: backpressure, so a rank far ahead of another cannot grow memory without bound.
- A payload whose length differs from the receive's buffer fails that receive with MismatchError
  carrying the sender's meta (``.remote_meta``); the message is consumed, so streams stay in step.
- ``discard(prefix)`` drops buffered messages and cancels posted receives under a tag prefix and
  drops late ones; ``retire(prefix)`` marks a prefix finished successfully: a message under it that
  is still buffered or arrives later is a *stray* (a rank that called something else), handed to
  the stray handlers. The last ``discard_memory`` prefixes are remembered.
- Loss of a peer: receives bound to it fail with PeerLostError; messages it delivered before
  going stay receivable. A receive from any source keeps waiting while some other rank is still
  live (a message may still come from it, as with MPI or torch's ``recv(src=None)`` in a group
  that does not contain the lost rank) and fails with PeerLostError only once no other rank is
  left to send; the engine fails every operation of a group that contains a lost rank itself.

Outcomes go to the ``Completion`` handed in with each receive (an asyncio.Future fits, or any
object with the same four methods), called synchronously from the event that decides them: a
completion must not raise, and may re-enter the matcher (post, discard) from its callback.

Zero-copy receive: a link that learns a payload's length before its bytes (a stream decoder, a
shared-memory slot header) asks ``claim`` where to put them, in stream order; ``claim`` returns
the posted receive's own buffer when it is next in line, so the payload lands in place, and the
link reports the finished frame with ``landed``; a frame it did not claim it reports with
``arrived``. A link that holds a whole message in memory of its own for a moment (a
shared-memory mailbox) hands it over with ``deliver``: copied once, to where ``claim`` would
have placed it; or, to a receive that reads the link in place while ``first_to_poll`` says
nothing here comes before it, straight into that receive's buffer when its tag and size are
the receive's (the transport's straight path).

A polled receive (``poll`` ... ``unpoll``): a receive that reads its source's link in place for a
moment before it would be posted (the transport's straight path) is next in line after every
posted receive for its message, and gets the first message of its source and tag that arrives
meanwhile, in its own buffer: through ``arrived``, or through ``claim`` when the link hands the
payload over whole within the same call (``whole``), so that a receive that stops polling is
never left bound to a message still arriving (should the link land it later after all, its
sender held off its core mid-copy, ``unpoll`` unbinds it: it is then reported as an early message
when it lands). Its outcome is kept in the ``Polled`` for the
caller to read (``outcome``).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from aiocoll._errors import DistError, PeerLostError
from aiocoll._match_records import (
    Completion,
    Early,
    Flow,
    Polled,
    Posted,
    StrayHandler,
    Tag,
    length_mismatch,
)

__all__ = [
    "Completion",
    "Early",
    "Flow",
    "LARGE_PAYLOAD",
    "Matcher",
    "Polled",
    "Posted",
    "StrayHandler",
    "Tag",
    "length_mismatch",
]

log = logging.getLogger("aiocoll.matching")

# An early payload at least this large is landed by ``claim`` in memory from ``landing`` (the
# transport's uninitialised allocation), since zeroing a buffer about to be overwritten costs as
# much as receiving it; smaller ones are left to the link's own allocation.
LARGE_PAYLOAD = 64 * 1024
_DISCARD_MEMORY = 4096


class _Mismatched:
    """A receive bound by ``claim`` to a message of another size (it fails once the frame lands)."""

    __slots__ = ("posted",)

    def __init__(self, posted: Posted) -> None:
        self.posted = posted


# The place in ``_filling`` of a message claimed for a polled receive that stopped before the
# message landed (``unpoll``): it lands in that receive's buffer, which may be its caller's again
# by then, so what is kept of it is a copy.
_UNBOUND: Any = object()


def _take_matching(posted: dict[Any, deque[Posted]], matches: Callable[[Any], bool]) -> list[Posted]:
    """Remove the queues of ``posted`` whose key ``matches``; their receives, in order."""
    return [waiter for key in [k for k in posted if matches(k)] for waiter in posted.pop(key)]


def _fresh(n: int) -> memoryview:
    return memoryview(bytearray(n))


class Matcher:
    """Posted receives, early arrivals and their bounds for one process (see the module header).

    Args:
        rank, world_size: this process's global rank and the job's size (``assign`` sets them
            later when they are not known yet; a process alone in its world is rank 0 of 1).
        inbox_bytes, inbox_messages: per-source bounds on messages buffered before their receive.
        landing: allocates ``n`` bytes for a large early payload (default: a zeroed bytearray).
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        *,
        inbox_bytes: int = 64 * 1024 * 1024,
        inbox_messages: int = 8192,
        landing: Callable[[int], memoryview] = _fresh,
        discard_memory: int = _DISCARD_MEMORY,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.inbox_bytes = inbox_bytes
        self.inbox_messages = inbox_messages
        self._landing = landing
        self._discard_memory = discard_memory
        self._posted: dict[tuple[int, Tag], deque[Posted]] = {}
        self._posted_any: dict[Tag, deque[Posted]] = {}
        self._inbox: dict[Tag, deque[Early]] = {}
        self._count: dict[int, int] = {}
        self._size: dict[int, int] = {}
        self._flows: dict[int, Flow] = {}
        # Receives bound by ``claim`` (or None for a claimed early payload), per source, in
        # stream order: one read may complete several frames before they are reported.
        self._filling: dict[int, deque[Posted | _Mismatched | None]] = {}
        self._order = 0
        self._polled: Polled | None = None
        # Finished prefixes by length: True reports late messages as strays, False drops them.
        self._finished: dict[int, dict[Tag, bool]] = {}
        self._finished_fifo: deque[Tag] = deque()
        self._stray_handlers: list[StrayHandler] = []
        self.lost: dict[int, str] = {}
        self.left: set[int] = set()  # of ``lost``, the ranks that went in order (said goodbye)
        self.closed_reason: str | None = None
        # Diagnostics: payloads received straight into their receive's buffer vs. through the inbox.
        self.received_direct = 0
        self.received_buffered = 0

    def assign(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    # -- links ------------------------------------------------------------------------------
    def attach(self, peer: int, flow: Flow) -> None:
        """Start matching messages from ``peer``, whose link's reading ``flow`` switches."""
        self._flows[peer] = flow
        self._count.setdefault(peer, 0)
        self._size.setdefault(peer, 0)
        self._filling.setdefault(peer, deque())
        if self._count[peer] >= self.inbox_messages or self._size[peer] >= self.inbox_bytes:
            flow.pause_reading()
        else:
            flow.resume_reading()

    def is_full(self, peer: int) -> bool:
        """Whether ``peer``'s inbox is at its bound (its link should not read)."""
        return self._count.get(peer, 0) >= self.inbox_messages or self._size.get(peer, 0) >= self.inbox_bytes

    # -- receiving --------------------------------------------------------------------------
    def take(self, src: int | None, tag: Tag, into: memoryview) -> tuple[int, dict[str, Any]] | None:
        """Copy a message that arrived before its receive into ``into``; None when none is here.

        Raises:
            MismatchError: its payload is not ``len(into)`` bytes (it is consumed all the same).
        """
        if not self._inbox:  # (the common case: nothing came early)
            return None
        early = self.take_early(src, tag, len(into))
        if early is None:
            return None
        if len(into):
            into[:] = early.payload
        return early.src, early.meta

    def holds(self, src: int, tag: Tag) -> bool:
        """Whether a message ``tag`` from ``src`` arrived before its receive and waits for it."""
        queue = self._inbox.get(tag)
        return queue is not None and any(early.src == src for early in queue)

    def take_early(self, src: int | None, tag: Tag, want: int) -> Early | None:
        """Take a message that arrived before its receive, leaving its payload where it is.

        Raises:
            MismatchError: its payload is not ``want`` bytes long (it is consumed all the same).
        """
        queue = self._inbox.get(tag)
        if queue:
            for i, early in enumerate(queue):
                if src is None or early.src == src:
                    del queue[i]
                    if not queue:
                        del self._inbox[tag]
                    self._unbuffer(early)
                    if len(early.payload) != want:
                        raise length_mismatch(early.src, tag, len(early.payload), want, early.meta)
                    return early
        return None

    def post(
        self, src: int | None, tag: Tag, into: memoryview, done: Completion, *, in_place: bool = False
    ) -> Posted:
        """Post a receive for a message not here yet (``take`` first); ``done`` gets its outcome.

        Raises:
            PeerLostError: ``src`` is gone (or, from any source, every other rank is).
            DistError: the transport is closed.
        """
        if self.closed_reason is not None:
            raise DistError(f"{self.closed_reason}; no more messages can be received")
        if src is not None:
            if src in self.lost:
                raise PeerLostError(src, self.lost[src], left=src in self.left)
        elif self.lost and self._no_live_source():
            last = next(reversed(self.lost))
            raise PeerLostError(last, f"every other rank is gone ({self.lost[last]})")
        self._order += 1
        posted = Posted(src, tag, into, done, self._order, in_place)
        if src is None:
            queue = self._posted_any.get(tag)
            if queue is None:
                queue = self._posted_any[tag] = deque()
        else:
            queue = self._posted.get((src, tag))
            if queue is None:
                queue = self._posted[(src, tag)] = deque()
        queue.append(posted)
        return posted

    def unpost(self, posted: Posted) -> None:
        """Withdraw a receive whose caller stopped waiting (a cancelled await)."""
        if posted.src is None:
            queues: dict[Any, deque[Posted]] = self._posted_any
            key: Any = posted.tag
        else:
            queues = self._posted
            key = (posted.src, posted.tag)
        queue = queues.get(key)
        if queue is not None:
            try:
                queue.remove(posted)
            except ValueError:
                pass
            if not queue:
                del queues[key]

    def first_to_poll(self, src: int, tag: Tag) -> bool:
        """Whether a receive that would poll for the next message ``tag`` from ``src`` now is
        the first it goes to: no receive is posted that would take it before, none polls now
        (and, as the caller found with ``take``, none waits in the inbox). A link that holds
        such a message whole may then hand it straight over (LinkTransport.recv_now)."""
        posted = self._posted
        return self._polled is None and not (posted and (src, tag) in posted) and tag not in self._posted_any

    def poll(self, src: int, tag: Tag, into: memoryview) -> Polled:
        """Start polling for the next message ``tag`` from ``src`` into ``into`` (``take`` first:
        none is here); ``unpoll`` once done, in every case."""
        polled = self._polled = Polled(src, tag, into, self._polled)
        return polled

    def unpoll(self, polled: Polled) -> None:
        """Stop polling (``polled.outcome()`` says what came). A message ``claim`` bound to it
        that has not landed yet (its link could not hand it over within the call after all: a
        sender held off its core mid-copy) is no longer its: it is reported as an early one
        when it lands, in its place in the stream, to the receive next in line then (the
        caller's receive, posted again, whose buffer it is landing in) or to the inbox."""
        self._polled = polled.prev
        if polled.result is None and polled.error is None:  # (nothing came: is one coming?)
            filling = self._filling.get(polled.src)
            if filling:
                for i, entry in enumerate(filling):
                    if isinstance(entry, Posted) and entry.done is polled:
                        filling[i] = _UNBOUND

    def _polling(self, src: int, tag: Tag) -> Polled | None:
        """The polled receive that takes a message ``tag`` from ``src`` no posted receive takes."""
        polled = self._polled
        if polled is None or polled.src != src or polled.tag != tag:
            return None
        if polled.result is not None or polled.error is not None:
            return None
        return polled

    def _no_live_source(self) -> bool:
        others = self.world_size - 1
        return others > 0 and sum(1 for r in self.lost if r != self.rank) >= others

    # -- arrivals ---------------------------------------------------------------------------
    def _next_in_line(self, src: int, tag: Tag) -> Posted | None:
        anyq = self._posted_any.get(tag)
        # (a receive from any source is always posted, the engine's for control messages; one from
        # a given source seldom is)
        if self._posted:
            specific = self._posted.get((src, tag))
            if specific and (not anyq or specific[0].order < anyq[0].order):
                return specific[0]
        return anyq[0] if anyq else None

    def _match(self, src: int, tag: Tag) -> Posted | None:
        specific = self._posted.get((src, tag))
        anyq = self._posted_any.get(tag)
        if specific and (not anyq or specific[0].order < anyq[0].order):
            posted = specific.popleft()
            if not specific:
                del self._posted[(src, tag)]
            return posted
        if anyq:
            posted = anyq.popleft()
            if not anyq:
                del self._posted_any[tag]
            return posted
        return None

    def claim(self, src: int, tag: Tag, nbytes: int, whole: bool = False) -> memoryview | None:
        """Where the ``nbytes`` payload of a message from ``src`` whose header just arrived should
        land: the next posted receive's own buffer (bound now, in stream order, so a later message
        in the same read cannot overtake it), a landing buffer for a large early or mis-sized
        payload, or None (the link lands it itself and reports it with ``arrived``). A frame given
        a buffer here must be reported with ``landed``, in order. ``whole``: the link lands the
        payload and reports it within this call (a polled receive may take it)."""
        posted = self._next_in_line(src, tag)
        if posted is None and whole and self._polled is not None:
            polled = self._polling(src, tag)
            if polled is not None and len(polled.into) == nbytes:
                self._filling[src].append(polled.bound())
                return polled.into
        if posted is not None and not posted.done.done():
            want = len(posted.into)
            if want == nbytes:
                self._match(src, tag)
                self._filling[src].append(posted)
                self.received_direct += 1
                return posted.into
            if want:
                # Its (mismatched) message: binding it now keeps the stream order. A zero-length
                # receive is left to ``arrived``: zero-length payloads are never claimed.
                self._match(src, tag)
                self._filling[src].append(_Mismatched(posted))
                return self._landing(nbytes)
        if nbytes < LARGE_PAYLOAD:
            return None
        self._filling[src].append(None)
        return self._landing(nbytes)

    def landed(self, src: int, tag: Tag, meta: dict[str, Any], payload: memoryview) -> None:
        """A frame whose payload went where ``claim`` said has fully arrived."""
        entry = self._filling[src].popleft()
        if entry is None:
            self.arrived(src, tag, meta, payload)
        elif entry is _UNBOUND:
            self.arrived(src, tag, meta, memoryview(bytes(payload)))
        elif isinstance(entry, _Mismatched):
            posted = entry.posted
            if not posted.done.done():
                posted.done.set_exception(length_mismatch(src, tag, len(payload), len(posted.into), meta))
        elif not entry.done.done():
            entry.done.set_result((src, meta, entry.into) if entry.in_place else (src, meta))

    def deliver(
        self, src: int, tag: Tag, meta: dict[str, Any], payload: bytes | memoryview, *, lasting: bool = False
    ) -> None:
        """A whole message from ``src`` that a link holds in memory of its own, handed over in one
        call: copied into the receive next in line for it (or the polled one), as ``claim`` and
        ``landed`` would place it, else to ``arrived``, in a copy unless ``lasting`` (``payload``
        then stays valid and is kept as it is). The matcher keeps no other reference to
        ``payload``: the link may reuse its memory once this returns."""
        # (a receive from any source posted for another tag, the engine's, is no reason to look)
        posted = self._next_in_line(src, tag) if self._posted or tag in self._posted_any else None
        if posted is not None:
            done = posted.done
            if not done.done():
                self._match(src, tag)
                into = posted.into
                if len(into) != len(payload):
                    done.set_exception(length_mismatch(src, tag, len(payload), len(into), meta))
                    return
                if len(into):
                    into[:] = payload
                self.received_direct += 1
                done.set_result((src, meta, into) if posted.in_place else (src, meta))
                return
        elif self._polled is not None:
            polled = self._polling(src, tag)
            if polled is not None:
                into = polled.into
                n = len(into)
                if n == len(payload):
                    if n:
                        into[:] = payload
                    polled.result = (src, meta)
                    return
        self.arrived(src, tag, meta, memoryview(payload if lasting else bytearray(payload)))

    def arrived(self, src: int, tag: Tag, meta: dict[str, Any], payload: memoryview) -> None:
        """A whole message from ``src`` that was not claimed: hand it to its receive (copying
        the payload into the receive's buffer) or keep it in the inbox. ``payload`` must stay
        valid (the matcher keeps it, without copying, until a receive takes it)."""
        if self._finished:
            for n, bucket in self._finished.items():
                report = bucket.get(tag[:n])
                if report is not None:
                    if report:
                        self._stray(src, tag, meta)
                    return
        while True:
            posted = self._match(src, tag)
            if posted is None:
                break
            done = posted.done
            if done.done():
                continue
            if len(payload) != len(posted.into):
                done.set_exception(length_mismatch(src, tag, len(payload), len(posted.into), meta))
            elif posted.in_place:
                # posted before its message: it lands in place, as when a link claimed it (a
                # link may hand a small payload over without claiming it first)
                if len(payload):
                    posted.into[:] = payload
                done.set_result((src, meta, posted.into))
            else:
                if len(payload):
                    posted.into[:] = payload
                done.set_result((src, meta))
            return
        if self._polled is not None:
            polled = self._polling(src, tag)
            if polled is not None:
                into = polled.into
                if len(payload) != len(into):
                    polled.set_exception(length_mismatch(src, tag, len(payload), len(into), meta))
                else:
                    if len(payload):
                        into[:] = payload
                    polled.set_result((src, meta))
                return
        queue = self._inbox.get(tag)
        if queue is None:
            queue = self._inbox[tag] = deque()
        queue.append(Early(src, meta, payload))
        self.received_buffered += 1
        if src != self.rank:
            count = self._count[src] = self._count.get(src, 0) + 1
            size = self._size[src] = self._size.get(src, 0) + len(payload)
            if count >= self.inbox_messages or size >= self.inbox_bytes:
                flow = self._flows.get(src)
                if flow is not None:
                    flow.pause_reading()

    def _unbuffer(self, early: Early) -> None:
        src = early.src
        if src == self.rank:
            return
        count = self._count[src] = self._count[src] - 1
        size = self._size[src] = self._size[src] - len(early.payload)
        if count < self.inbox_messages and size < self.inbox_bytes:
            flow = self._flows.get(src)
            if flow is not None:
                flow.resume_reading()

    # -- finished operations ----------------------------------------------------------------
    def discard(self, tag_prefix: Tag) -> None:
        """Drop buffered messages and cancel posted receives under ``tag_prefix``; late ones
        are dropped too."""
        self._forget(tag_prefix, report=False)

    def retire(self, tag_prefix: Tag) -> None:
        """Mark an operation that completed successfully: a message under ``tag_prefix`` still
        buffered, or arriving later, is handed to the stray handlers."""
        if self._inbox:
            self._forget(tag_prefix, report=True)
        else:  # the usual case, once per collective: nothing buffered to look through
            self._remember(tag_prefix, True)

    def on_stray(self, handler: StrayHandler) -> None:
        """Register ``handler(src, tag, meta)`` for messages under a retired prefix."""
        self._stray_handlers.append(handler)

    def _forget(self, tag_prefix: Tag, *, report: bool) -> None:
        n = len(tag_prefix)
        strays: list[tuple[int, Tag, dict[str, Any]]] = []
        if self._inbox:
            for tag in [t for t in self._inbox if t[:n] == tag_prefix]:
                for early in self._inbox.pop(tag):
                    self._unbuffer(early)
                    strays.append((early.src, tag, early.meta))
        if report:
            # A finished operation has no receives left: only late messages need watching for.
            self._remember(tag_prefix, report)
            for src, tag, meta in strays:
                self._stray(src, tag, meta)
            return
        # Unpost every matching receive before cancelling any: a cancelled receive may call back
        # into its operation, which may discard other prefixes right away.
        waiting = _take_matching(self._posted, lambda key: key[1][:n] == tag_prefix)
        waiting += _take_matching(self._posted_any, lambda tag: tag[:n] == tag_prefix)
        self._remember(tag_prefix, report)
        for posted in waiting:
            if not posted.done.done():
                posted.done.cancel()

    def _remember(self, tag_prefix: Tag, report: bool) -> None:
        bucket = self._finished.get(len(tag_prefix))
        if bucket is None:
            bucket = self._finished[len(tag_prefix)] = {}
        if tag_prefix not in bucket:
            self._finished_fifo.append(tag_prefix)
            if len(self._finished_fifo) > self._discard_memory:
                old = self._finished_fifo.popleft()
                self._finished[len(old)].pop(old, None)
        bucket[tag_prefix] = report

    def _stray(self, src: int, tag: Tag, meta: dict[str, Any]) -> None:
        for handler in list(self._stray_handlers):
            try:
                handler(src, tag, meta)
            except Exception:
                log.exception("stray-message handler failed")

    # -- loss and closing -------------------------------------------------------------------
    def peer_lost(self, peer: int, reason: str, *, left: bool = False) -> bool:
        """``peer``'s link is gone (``left``: in order): fail the receives bound to it (and
        receives from any source once no other rank is left). Its delivered messages stay
        receivable. False when it was already known lost."""
        if peer in self.lost or peer == self.rank:
            return False
        self.lost[peer] = reason
        if left:
            self.left.add(peer)
        self._flows.pop(peer, None)
        # Take every receive out first, then fail them: failing one may call back into its
        # operation and on into ``discard`` of other prefixes.
        waiting: list[Posted] = []
        filling = self._filling.get(peer)
        if filling:
            for entry in filling:
                posted = entry.posted if isinstance(entry, _Mismatched) else entry
                if posted is not None and posted is not _UNBOUND:
                    waiting.append(posted)
            filling.clear()
        waiting += _take_matching(self._posted, lambda key: key[0] == peer)
        if self._posted_any and self._no_live_source():
            waiting += _take_matching(self._posted_any, lambda tag: True)
        for posted in waiting:
            if not posted.done.done():
                posted.done.set_exception(PeerLostError(peer, reason, left=left))
        return True

    def close(self, reason: str) -> None:
        """The transport is closing: fail every posted receive with DistError(``reason``) and
        refuse new ones. Twice is fine."""
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        waiting = [p for q in self._posted.values() for p in q]
        waiting += [p for q in self._posted_any.values() for p in q]
        waiting += [
            e.posted if isinstance(e, _Mismatched) else e
            for q in self._filling.values()
            for e in q
            if e is not None and e is not _UNBOUND
        ]
        self._posted.clear()
        self._posted_any.clear()
        for queue in self._filling.values():
            queue.clear()
        self._flows.clear()
        for posted in waiting:
            if not posted.done.done():
                posted.done.set_exception(DistError(f"{reason} while a receive was waiting"))

    def debug_state(self) -> dict[str, Any]:
        """A snapshot for diagnosing a stuck operation."""
        return {
            "posted": {repr(k): len(v) for k, v in self._posted.items()},
            "posted_any": {repr(k): len(v) for k, v in self._posted_any.items()},
            "inbox": {repr(k): [(e.src, len(e.payload)) for e in v] for k, v in self._inbox.items()},
            "buffered": {p: (self._count[p], self._size[p]) for p in self._count if self._count[p]},
            "filling": {p: len(q) for p, q in self._filling.items() if q},
            "lost": dict(self.lost),
        }

    def buffered(self, peer: int) -> int:
        """Messages from ``peer`` waiting in the inbox."""
        return self._count.get(peer, 0)
