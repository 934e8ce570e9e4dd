"""How the engine fails operations, and what the engines of a job tell each other about it.

A lost peer (a link closed, or the coordinator's notice) fails every pending operation of every
group containing it; a peer that leaves in order says from which sequence number of each group
(``{"k": "left"}``), and only those operations fail; a mismatch found on one rank is sent to the
group's other ranks (tag ``("x",)``); a rank whose own deadline ran out says so (``"gave_up"``),
and a stalled rank's report of what it waits for (``"stuck"``) is kept for the timeout's message
(both sent by client/data/_deadlines.py). Each failure reads, for every operation it fails, as
that operation's own (``for_op``), and a later call on the group it broke is refused with it
(``_check_usable``).

Imports foundations (aiocoll._errors, aiocoll.algorithms._transport) and the engine's records
(client/data/_op_record.py) and progress tracking; never the public surface, and not the engine
itself: ``FailureFanout`` is the engine's base, and the engine settles the operations it fails
(``_abort``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from aiocoll._errors import (
    CollectiveTimeout,
    DistError,
    MismatchError,
    PeerLostError,
    chain,
    group_name,
    peer_gone,
)
from aiocoll.algorithms._transport import Tag, Transport

from .._progress import ProgressTracker
from ._op_record import GroupState, Operation

__all__ = ["CONTROL_TAG", "EMPTY", "FailureFanout", "for_op", "gone", "ignore_outcome"]

log = logging.getLogger("aiocoll.client.data.engine")

CONTROL_TAG: Tag = ("x",)
EMPTY = memoryview(b"")
_EMPTY_SINK = memoryview(bytearray(0))  # control messages carry no payload; a writable target
_MAX_ORPHAN_NOTICES = 1024
MAX_STUCK_REPORTS = 64
_monotonic = time.monotonic


class FailureFanout:
    """The engine's failure handling and control messages (client/data/engine.py's Engine sets
    the state below and settles what fails here)."""

    transport: Transport
    rank: int
    progress: ProgressTracker
    _groups: dict[str, GroupState]
    _orphan_notices: dict[str, dict[int, DistError]]
    _loop: asyncio.AbstractEventLoop
    _closed: bool
    _leaving: bool
    _recorded_losses: set[int]
    _lost_first: tuple[int, str] | None  # the first rank this one lost (not one that left), and why
    _mismatch_at: float

    def _abort(self, op: Operation, exc: BaseException) -> None:
        raise NotImplementedError  # the engine's: it settles the operation

    def _farewell(self, groups: Iterable[GroupState], *, closing: bool) -> list[asyncio.Task[None]]:
        """Tell every other member of ``groups`` that this rank leaves them, and from which
        sequence number of each (its first operation there not completed): one control message
        per peer, ahead of anything it sends later (its links' goodbye)."""
        by_peer: dict[int, dict[str, int]] = {}
        for group in groups:
            reached = min((op.seq for op in group.pending if op.seq >= 0), default=group.next_seq)
            for peer in group.ranks:
                if peer != self.rank:
                    by_peer.setdefault(peer, {})[group.gid] = reached
        lost = self.transport.lost_peers
        meta: dict[str, Any] = {"k": "left", "g": "", "s": -1, "all": closing}
        if self._lost_first is not None:
            # A rank that leaves because it lost another says whom: its peers may hear its
            # farewell before they see that loss themselves, and the loss is the news.
            meta["lost"] = list(self._lost_first)
        return [
            self._loop.create_task(self.transport.send(peer, CONTROL_TAG, EMPTY, {**meta, "gs": seqs}))
            for peer, seqs in by_peer.items()
            if peer not in lost
        ]

    def _peer_left(self, src: int, seqs: dict[str, int], closing: bool, lost: Any = None) -> None:
        """Rank ``src`` left the groups of ``seqs`` (gid -> the first seq it did not complete),
        having lost rank ``lost[0]`` first (``lost``: [rank, why], or None)."""
        first = None
        if isinstance(lost, list) and len(lost) == 2 and isinstance(lost[0], int) and lost[0] != self.rank:
            # what the lost rank's own link still holds says more than the leaver's word
            first = self.transport.take_in_from(lost[0]) or PeerLostError(
                lost[0], f"rank {src} lost it first, then left too ({str(lost[1])[:500]})"
            )
        for gid, seq in seqs.items():
            gid, seq = str(gid), int(seq)
            group = self._groups.get(gid)
            label = group.label if group is not None else group_name(gid)
            why = "closed its process group" if closing else f"destroyed group {label!r}"
            err = PeerLostError(src, why, left=True)
            if first is not None and (group is None or first.rank in group.members):
                err = first
            if group is None:
                # not formed here yet (it formed on the leaver first): failed when it forms
                self._fail_at(gid, seq, err)
                continue
            if src in group.members:
                self._break(group, err, from_seq=seq)

    def _lost_ranks(self) -> set[int]:
        return set(self.transport.lost_peers)

    def peer_lost(self, rank: int, exc: BaseException | str = "") -> None:
        """A peer is gone: fail every pending operation of every group containing it."""
        if rank == self.rank:
            # The coordinator thinks *we* are gone (our loop stalled past the heartbeat timeout,
            # say). Our peers hear the same notice and fail what involves us; here there is
            # nothing to fail on our own behalf.
            log.warning("rank %d: the coordinator reported this rank lost: %s", self.rank, exc)
            return
        # Told by another (the coordinator): first take in what the rank sent before it went, so
        # that it is delivered, and what fails fails with its own link's account when it has one.
        own = self.transport.take_in_from(rank)
        if own is not None:
            err = own
        elif isinstance(exc, PeerLostError):
            err = exc
        else:
            err = PeerLostError(rank, str(exc) or "lost")
        self.transport.mark_lost(rank, err.reason)  # re-enters here through the transport's handler; harmless
        self._note_lost(err)
        if rank not in self._recorded_losses and not self._closed and not self._leaving:
            self._recorded_losses.add(rank)
            if not err.left or any(rank in g.members and g.pending for g in self._groups.values()):
                # (a peer that left while nothing here waits for it is the usual end of a job)
                self.progress.lost_peer(rank, err.reason, left=err.left)
        # A turn of the loop later: a control notice that arrived just before the peer's goodbye
        # (a mismatch it found, say) has woken the control loop already, and is handled first.
        self._loop.call_soon(self._break_groups_of, rank, err)

    def _note_lost(self, err: PeerLostError) -> None:
        """Remember the first rank this one lost (told by its link, the coordinator, or an
        operation that found it gone), for the farewell when this rank leaves."""
        if not err.left and self._lost_first is None and not self._leaving and err.rank != self.rank:
            self._lost_first = (err.rank, err.reason)

    def _break_groups_of(self, rank: int, err: PeerLostError) -> None:
        for group in list(self._groups.values()):
            if rank not in group.members:
                continue
            broken = group.broken
            # (a leave told with its farewell says from which seq; the goodbye after it adds nothing)
            if not isinstance(broken, PeerLostError) or (broken.left and not err.left):
                self._break(group, err, from_seq=0)

    def _break(
        self, group: GroupState, err: BaseException, *, from_seq: int, except_op: Operation | None = None
    ) -> None:
        if isinstance(err, MismatchError):
            self._mismatch_at = _monotonic()
        broken = group.broken
        if broken is None:
            group.broken, group.broken_seq = err, from_seq
        else:
            # What the group's later calls are told: a lost peer outranks every other cause, and
            # a peer that left outranks what is not a loss; an earlier failure, a later one.
            if isinstance(err, PeerLostError):
                replace = not isinstance(broken, PeerLostError) or (broken.left and not err.left)
            else:
                replace = from_seq < group.broken_seq and not isinstance(broken, PeerLostError)
            if replace:
                group.broken = err
            group.broken_seq = min(group.broken_seq, from_seq)
        self._fail_pending(group, err, from_seq=from_seq, except_op=except_op)

    def _fail_pending(
        self, group: GroupState, err: BaseException, *, from_seq: int, except_op: Operation | None = None
    ) -> None:
        # Failing an operation can fail the next one from inside (a shared-memory arena fails
        # its queued operations when one is stopped, and each failure breaks the group again):
        # such a failure waits its turn here instead of recursing, which with a few hundred
        # operations in flight exhausted the stack and left the rest pending forever.
        failing = group.failing
        failing.append((err, from_seq, except_op))
        if len(failing) > 1:
            return
        try:
            while failing:
                err, from_seq, except_op = failing[0]
                # A peer that left in order fails the group's collectives (they need every
                # member); point-to-point with the other members goes on, and with the rank that
                # left its link fails it.
                left = err.rank if isinstance(err, PeerLostError) and err.left else None
                for op in list(group.pending):
                    if op is except_op or (left is not None and op.seq < 0 and left not in op.peers):
                        continue
                    if op.seq < 0 or op.seq >= from_seq:
                        self._abort(op, for_op(err, op))
                failing.pop(0)
        finally:
            failing.clear()

    def _check_usable(
        self, group: GroupState, kind: str, seq: int, peers: Iterable[int] = (), tag: Tag = ()
    ) -> None:
        """Refuse an operation ``kind`` of the broken ``group`` (its ``seq``; -1 for point-to-point
        with ``peers`` under ``tag``) unless the group's failure leaves it free to run: raise that
        failure, told as this call's (``submit_op`` asks only once the group is broken)."""
        cause = group.broken
        if cause is None or (seq >= 0 and seq < group.broken_seq):
            return
        if seq < 0 and isinstance(cause, PeerLostError) and cause.left:
            if cause.rank not in peers:
                return  # point-to-point with the remaining members goes on (see _fail_pending)
            if kind == "recv" and self.transport.holds(cause.rank, tag):
                return  # what it sent before it left stays receivable
        where = f"{kind} (group {group.label!r}" + (f", seq {seq})" if seq >= 0 else ")")
        if isinstance(cause, PeerLostError):
            raise chain(
                PeerLostError(
                    cause.rank,
                    cause.reason,
                    message=f"{where} cannot run: {gone(cause)}; the group is unusable, create a new "
                    f"one from the remaining ranks",
                    left=cause.left,
                ),
                cause,
            )
        if isinstance(cause, MismatchError):
            raise chain(
                MismatchError(
                    f"{where} cannot run: the group is broken since seq {cause.seq}, where ranks called "
                    f"different operations ({cause}); create a new group",
                    group=group.gid,
                    seq=cause.seq,
                    ranks=cause.ranks,
                ),
                cause,
            )
        if isinstance(cause, CollectiveTimeout):
            raise chain(
                CollectiveTimeout(
                    kind,
                    group.label,
                    seq,
                    cause.missing_ranks,
                    cause.timeout,
                    message=f"{where} cannot run: {cause.op} at seq {cause.seq} timed out waiting for "
                    f"rank(s) {cause.missing_ranks}, so the group is out of step; create a new group",
                ),
                cause,
            )
        raise chain(DistError(f"{where} cannot run: the group is broken ({cause})"), cause)

    def _name_mismatch(self, op: Operation, exc: MismatchError) -> MismatchError:
        if exc.seq >= 0 and exc.group:
            return exc
        ranks = sorted(set(exc.ranks) | {self.rank})
        return chain(
            MismatchError(
                f"{op.describe()} on rank {self.rank}: {exc}", group=op.group.gid, seq=op.seq, ranks=ranks
            ),
            exc,
        )

    def _notify_mismatch(self, op: Operation, err: MismatchError) -> None:
        if op.seq < 0:
            return
        meta = {"g": op.group.gid, "s": op.seq, "r": self.rank, "why": str(err)[:2000], "ranks": err.ranks}
        self._tell(op.group.ranks, meta)

    def _tell(self, ranks: Iterable[int], meta: dict[str, Any]) -> None:
        """Send the control message ``meta`` to every rank of ``ranks`` but this one (best effort)."""
        for peer in ranks:
            if peer != self.rank:
                task = self._loop.create_task(self.transport.send(peer, CONTROL_TAG, EMPTY, meta))
                task.add_done_callback(ignore_outcome)

    async def _control_loop(self) -> None:
        while True:
            try:
                src, meta = await self.transport.recv(None, CONTROL_TAG, _EMPTY_SINK)
            except asyncio.CancelledError:
                raise
            except PeerLostError:
                # A receive from any source fails only once no other rank is left (the matcher's
                # rule): nobody can send a notice any more.
                return
            except DistError:
                return  # the transport is closed
            except Exception:
                log.exception("rank %d: receiving control messages failed; retrying", self.rank)
                await asyncio.sleep(0.1)
                continue
            try:
                self._on_notice(src, meta)
            except Exception:
                log.exception("rank %d: bad control message from rank %d: %r", self.rank, src, meta)

    def _on_stray(self, src: int, tag: Tag, meta: dict[str, Any]) -> None:
        if len(tag) < 3 or tag[0] != "c":
            return
        gid, seq = str(tag[1]), tag[2]
        group = self._groups.get(gid)
        if group is None or not isinstance(seq, int) or self._closed:
            return
        if group.broken is not None and group.broken_seq <= seq:
            return  # already known to be out of step: late messages are expected
        desc = ", ".join(f"{k}={v!r}" for k, v in meta.items())
        err = MismatchError(
            f"rank {src} sent rank {self.rank} a message for seq {seq} of group {group.label!r} that "
            f"rank {self.rank}'s call did not expect (rank {src} called {{{desc}}}): the ranks "
            f"called different operations or roots at this point. Every rank of a group must call "
            f"the same operations, with the same root, dtype, size and reduce op, in the same order.",
            group=gid,
            seq=seq,
            ranks=sorted({src, self.rank}),
        )
        log.warning("rank %d: %s", self.rank, err)
        meta_out = {"g": gid, "s": seq, "r": self.rank, "why": str(err)[:2000], "ranks": err.ranks}
        self._tell(group.ranks, meta_out)
        if seq >= group.next_seq:
            group.notices[seq] = err
        self._break(group, err, from_seq=seq)

    def _on_notice(self, src: int, meta: dict[str, Any]) -> None:
        gid, seq = str(meta["g"]), int(meta["s"])
        if meta.get("k") == "stuck":
            group = self._groups.get(gid)
            if group is not None:
                waits = [int(w) for w in meta.get("waits", [])]
                group.stuck.setdefault(seq, {})[src] = waits
                while len(group.stuck) > MAX_STUCK_REPORTS:
                    del group.stuck[next(iter(group.stuck))]
            return
        if meta.get("k") == "gave_up":
            self._peer_gave_up(src, gid, seq, meta)
            return
        if meta.get("k") == "want":  # a stalled rank asks for a full progress report (store mode)
            self.progress.wanted = True
            return
        if meta.get("k") == "left":
            self._peer_left(src, dict(meta.get("gs") or {}), bool(meta.get("all")), meta.get("lost"))
            return
        ranks = sorted({int(r) for r in meta.get("ranks", [])} | {src, self.rank})
        why = str(meta.get("why", ""))
        group = self._groups.get(gid)
        label = group.label if group is not None else group_name(gid)
        # ``why`` already says where (aiocoll._signature's wording): said once, with who found it
        where = "" if f"at seq {seq} of group" in why else f" at seq {seq} of group {label!r}"
        err = MismatchError(
            f"rank {src} found that the ranks' calls{where} disagree: {why}",
            group=gid,
            seq=seq,
            ranks=ranks,
        )
        self._fail_at(gid, seq, err)

    def ask_progress(self, ranks: Iterable[int]) -> None:
        """Ask ``ranks`` for a full progress report (store mode: they publish it in the store)."""
        self._tell(ranks, {"k": "want", "g": "", "s": -1})

    async def share_mismatch(self, gid: str, seq: int, ranks: Sequence[int], why: str) -> None:
        """Store mode: this rank found the mismatch; tell the group's other ranks first (their
        notices must be on the wire before this rank's failure lets it leave), then fail here."""
        group = self._groups.get(gid)
        if group is not None and not self._closed:
            meta = {"g": gid, "s": seq, "r": self.rank, "why": why[:2000], "ranks": list(ranks)}
            sends = [self.transport.send(p, CONTROL_TAG, EMPTY, meta) for p in group.ranks if p != self.rank]
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 1.0)
        self.remote_mismatch(gid, seq, ranks, why)

    def remote_mismatch(self, gid: str, seq: int, ranks: Sequence[int], why: str) -> None:
        """Progress hook: the members' progress reports, compared (by the coordinator, or by a
        rank in store mode), show that they called different operations at (gid, seq): fail it
        here too, as a MismatchError."""
        if self._closed:
            return
        known = self._groups.get(gid)
        label = known.label if known is not None else group_name(gid)
        err = MismatchError(
            f"comparing the ranks' progress reports showed that their calls at seq {seq} of group {label!r} "
            f"disagree: {why}",
            group=gid,
            seq=seq,
            ranks=sorted({int(r) for r in ranks}),
        )
        log.warning("rank %d: %s", self.rank, err)
        self._fail_at(gid, seq, err)

    def _peer_gave_up(self, src: int, gid: str, seq: int, meta: dict[str, Any]) -> None:
        """Rank ``src``'s own deadline for (gid, seq) ran out: fail it here now as well."""
        group = self._groups.get(gid)
        if group is None or (group.broken is not None and group.broken_seq <= seq):
            return
        kind = next((op.kind for op in group.pending if op.seq == seq), None) or str(
            meta.get("op") or "operation"
        )
        waits = [int(w) for w in meta.get("waits", [])]
        timeout = meta.get("t")
        why = str(meta.get("why", ""))[:500]
        err = CollectiveTimeout(
            kind,
            group.label,
            seq,
            waits,
            float(timeout) if isinstance(timeout, (int, float)) else None,
            message=f"{kind} (group {group.label!r}, seq {seq}) failed: rank {src} gave up on it after its "
            f"timeout of {timeout}s, waiting for rank(s) {waits}, and so does this rank"
            + (f"; the ranks' progress reports show that {why}" if why else ""),
        )
        log.warning("rank %d: %s", self.rank, err)
        self._fail_at(gid, seq, err)

    def _fail_at(self, gid: str, seq: int, err: DistError) -> None:
        """Fail (gid, seq) and what follows it: now if called, else when it is called."""
        group = self._groups.get(gid)
        if group is None:
            bucket = self._orphan_notices.setdefault(gid, {})
            if len(self._orphan_notices) <= _MAX_ORPHAN_NOTICES:
                bucket[seq] = err
            return
        if seq >= group.next_seq:
            group.notices[seq] = err
            self.progress.failed(f"before calling seq {seq} of group {group.label!r}: {err}")
        self._break(group, err, from_seq=seq)


def gone(err: PeerLostError) -> str:
    """'lost rank 1 (why)', or 'rank 1 left (why)' for a peer that went in order."""
    if err.left:
        return peer_gone(err.rank, err.reason, True)
    return f"lost rank {err.rank}" + (f" ({err.reason})" if err.reason else "")


def for_op(err: BaseException, op: Operation) -> BaseException:
    """The error as it should read for ``op`` (a group-wide failure names each operation)."""
    where = op.describe()
    if isinstance(err, PeerLostError):
        out: BaseException = PeerLostError(
            err.rank, err.reason, message=f"{where} failed: {gone(err)}", left=err.left
        )
    elif isinstance(err, MismatchError):
        if err.seq == op.seq:
            return err
        out = MismatchError(
            f"{where} failed: the group broke at seq {err.seq}: {err}",
            group=err.group,
            seq=err.seq,
            ranks=err.ranks,
        )
    elif isinstance(err, CollectiveTimeout):
        if err.seq == op.seq and err.op == op.kind:
            return err
        out = CollectiveTimeout(
            op.kind,
            op.group.label,
            op.seq,
            err.missing_ranks,
            err.timeout,
            message=f"{where} failed: {err.op} at seq {err.seq} of this group timed out waiting for rank(s) "
            f"{err.missing_ranks}",
        )
    else:
        return err
    return chain(out, err)


def ignore_outcome(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()
