"""The one executor: applies any Schedule over a Transport; imports only foundations.

``run_collective`` picks (or is told) an algorithm, builds this rank's schedule with the pure
functions of ``_schedule``, maps the schedule's buffer names onto the operation's arrays, and
runs it: lanes as concurrent tasks, each lane's steps in order, each step's sends and receives
concurrently, reductions in place with numpy ``out=`` after the step's transfers completed.
Every message is tagged ``(*tag, step_id)`` and carries the engine's ``meta`` (the operation's
signature); every received meta is compared with ours so a mismatched call fails with
MismatchError on the first message instead of hanging or corrupting data.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import MismatchError
from .._reduce import check_reduce_op, finish_avg, reduce_into
from .._types import ReduceOp
from . import _schedule as S
from ._transport import Tag, Transport

__all__ = ["ALGORITHMS", "KINDS", "CollectiveSpec", "choose_algorithm", "run_collective"]

KINDS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
)

ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "rhd", "tree"),
    "broadcast": ("tree", "direct"),
    "reduce": ("tree", "direct"),
    "all_gather": ("direct", "ring"),
    "gather": ("direct",),
    "scatter": ("direct",),
    "reduce_scatter": ("direct", "ring"),
    "all_to_all": ("direct",),
    "barrier": ("rhd",),
}
"""Algorithms each kind accepts as an override; "rhd" for barrier is the dissemination pattern
(recursive doubling generalised to any world size)."""

# Below this many bytes per rank, latency (number of rounds) matters more than bandwidth.
SMALL_BYTES = 256 * 1024

_SIGNATURE_FIELDS = ("kind", "root", "dtype", "count", "op")


@dataclass(frozen=True)
class CollectiveSpec:
    """One collective operation as this rank sees it.

    Attributes:
        kind: one of KINDS.
        ranks: global ranks of the group; position = group rank.
        me: my group rank (index into ``ranks``).
        send, recv: contiguous 1-D numpy arrays; meaning per kind:
            all_reduce send=(x,) recv=(x,) (in place); broadcast send=() recv=(x,);
            reduce send=(x,) recv=(x,) (result at root; other ranks' x unchanged);
            all_gather send=(x,) recv=(out_0..out_{n-1}); gather send=(x,) recv=outs at root, ()
            elsewhere; scatter send=ins at root, () elsewhere, recv=(x,); reduce_scatter
            send=(in_0..in_{n-1}) recv=(x,); all_to_all send=ins recv=outs (sizes may differ per
            peer); barrier: both empty.
        root: group rank of the root (broadcast, reduce, gather, scatter).
        op: reduce operation. algorithm: override ("ring", "rhd", "tree", "direct") or None.
        dtype: canonical dtype name when the arrays alone cannot tell it (bfloat16 travels as
            uint16 bits); None: the arrays' dtype, read as bfloat16 when they are uint16 and
            ``meta["dtype"] == "bfloat16"``.
    """

    kind: str
    ranks: tuple[int, ...]
    me: int
    send: tuple[np.ndarray, ...]
    recv: tuple[np.ndarray, ...]
    root: int = 0
    op: ReduceOp = ReduceOp.SUM
    algorithm: str | None = None
    dtype: str | None = None


def choose_algorithm(kind: str, nbytes: int, world_size: int) -> str:
    """The default algorithm for an operation; every rank computes the same answer.

    Args:
        kind: one of KINDS.
        nbytes: bytes of one rank's vector (all_reduce/broadcast/reduce: x; all_gather/gather:
            the input x; scatter/reduce_scatter: the output x; all_to_all/barrier: ignored).
        world_size: ranks in the group.
    Raises:
        ValueError: unknown kind.
    """
    if kind not in ALGORITHMS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    if kind == "all_reduce":
        # Few rounds while latency dominates; the pipelined ring (bandwidth optimal) above.
        if nbytes < SMALL_BYTES or world_size <= 1:
            return "rhd"
        # Halving-doubling moves the same bytes as the ring in log2(n) rounds instead of 2(n-1);
        # measured side by side (docs/PERFORMANCE.md) it beat the ring at 4 ranks from 1 MiB to
        # 64 MiB and tied at 2. Above 4 ranks, and for non powers of two (extra ranks fold in
        # and send twice), the ring's even load wins.
        power_of_two = world_size & (world_size - 1) == 0
        return "rhd" if power_of_two and world_size <= 4 else "ring"
    if kind in ("broadcast", "reduce"):
        return "tree"
    if kind in ("all_gather", "reduce_scatter"):
        # Direct moves the same bytes per rank as the ring in a single round; the ring only pays
        # off when many peers would otherwise all send large blocks at one receiver at once.
        return "ring" if world_size > 4 and nbytes * world_size >= 4 * SMALL_BYTES else "direct"
    return ALGORITHMS[kind][0]


class Context:
    """What one running operation needs at every message: transport, tags, meta, op."""

    __slots__ = (
        "bufs",
        "dtype_name",
        "global_ranks",
        "me_global",
        "meta",
        "op",
        "send_nowait",
        "tag",
        "transport",
    )

    def __init__(
        self,
        transport: Transport,
        tag: tuple[Any, ...],
        meta: dict[str, Any],
        global_ranks: Sequence[int],
        me: int,
        bufs: dict[S.BufRef, np.ndarray],
        op: ReduceOp,
        dtype_name: str,
    ) -> None:
        self.transport = transport
        self.tag = tag
        self.meta = meta
        self.global_ranks = global_ranks
        self.me_global = global_ranks[me]
        self.bufs = bufs
        self.op = op
        self.dtype_name = dtype_name
        # Transports that can hand a message to the kernel without a coroutine let a step send
        # inline (no task, no loop iteration per message); see ``start_send``.
        self.send_nowait: Callable[..., Awaitable[None] | None] | None = getattr(
            transport, "send_nowait", None
        )

    def start_send(self, peer: int, step_id: int, data: np.ndarray) -> Awaitable[None] | None:
        """Start sending now; None when the payload was handed off at once, else an awaitable
        (a coroutine, not yet started, for transports without ``send_nowait``) that finishes it.

        Raises:
            PeerLostError: the peer is gone (only when sending inline).
        """
        if self.send_nowait is None:
            return self.send(peer, step_id, data)
        return self.send_nowait(
            self.global_ranks[peer], (*self.tag, step_id), data.view(np.uint8).data, self.meta
        )

    async def send(self, peer: int, step_id: int, data: np.ndarray) -> None:
        await self.transport.send(
            self.global_ranks[peer], (*self.tag, step_id), data.view(np.uint8).data, self.meta
        )

    async def recv(self, peer: int, step_id: int, into: np.ndarray) -> None:
        src = self.global_ranks[peer]
        try:
            _, remote_meta = await self.transport.recv(src, (*self.tag, step_id), into.view(np.uint8).data)
        except MismatchError as exc:
            raise self.recv_error(src, exc) from exc
        if remote_meta != self.meta and not _same_meta(remote_meta, self.meta):
            raise self._mismatch(src, remote_meta)

    async def recv_reduced(self, peer: int, step_id: int, reduction: Reduction) -> None:
        """Receive a payload to be reduced; one that arrived early is reduced from where it
        landed (``reduction.landing`` is pointed there) instead of being copied first."""
        src = self.global_ranks[peer]
        into = reduction.landing.view(np.uint8).data
        try:
            _, remote_meta, landed = await self.transport.recv_landed(src, (*self.tag, step_id), into)
        except MismatchError as exc:
            raise self.recv_error(src, exc) from exc
        if remote_meta != self.meta and not _same_meta(remote_meta, self.meta):
            raise self._mismatch(src, remote_meta)
        if landed is not into:
            reduction.landing = np.frombuffer(landed, dtype=reduction.landing.dtype)

    def recv_error(self, src: int, exc: MismatchError) -> MismatchError:
        """The error to raise for a receive from global rank ``src`` that the transport failed
        with ``exc`` (a message of the wrong length): named by whatever differs in the calls."""
        remote = getattr(exc, "remote_meta", None)
        if isinstance(remote, dict) and not _same_meta(remote, self.meta):
            return self._mismatch(src, remote)
        return self._mismatch(src, remote, size_detail=str(exc))

    def meta_error(self, src: int, remote_meta: dict[str, Any]) -> MismatchError | None:
        """None when global rank ``src``'s signature matches ours, else the MismatchError."""
        if remote_meta == self.meta or _same_meta(remote_meta, self.meta):
            return None
        return self._mismatch(src, remote_meta)

    def _mismatch(self, src: int, remote: Any, size_detail: str | None = None) -> MismatchError:
        group, seq = "", -1
        if len(self.tag) >= 3 and self.tag[0] == "c":
            group, seq = str(self.tag[1]), self.tag[2] if isinstance(self.tag[2], int) else -1
        where = f" (group {group!r}, seq {seq})" if group else ""
        if isinstance(remote, dict) and not _same_meta(remote, self.meta):
            keys = [k for k in _SIGNATURE_FIELDS if self.meta.get(k) != remote.get(k)]
            keys += sorted(
                str(k)
                for k in set(self.meta) | set(remote)
                if k not in _SIGNATURE_FIELDS and self.meta.get(k) != remote.get(k)
            )
            message = (
                f"rank {self.me_global} and rank {src} called different collectives at one point{where}: "
                f"they differ in {', '.join(keys)}; rank {self.me_global}: {_fmt(self.meta)}; rank {src}: "
                f"{_fmt(remote)}. Every rank of a group must call the same operations, with the same "
                "root, dtype, size and reduce op, in the same order."
            )
        else:
            keys = ["size"]
            message = (
                f"rank {self.me_global} received a message of the wrong size from rank {src}{where} "
                f"during {self.meta.get('kind', 'a collective')} ({size_detail}); the ranks passed "
                "tensors (or split sizes) that do not agree."
            )
        err = MismatchError(message, group=group, seq=seq, ranks=sorted({self.me_global, src}))
        err.local_meta = dict(self.meta)  # type: ignore[attr-defined]
        err.remote_meta = remote  # type: ignore[attr-defined]
        err.fields = keys  # type: ignore[attr-defined]
        return err


def _plain(value: Any) -> Any:
    """What a value looks like after a msgpack round trip: tuples become lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _same_meta(remote: Any, local: dict[str, Any]) -> bool:
    # A network transport hands back a decoded copy, so compare as the wire would carry them.
    return bool(remote == local or _plain(remote) == _plain(local))


def _fmt(meta: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={meta[k]!r}" for k in meta) + "}"


async def _all(aws: Sequence[Awaitable[None]]) -> None:
    """Run awaitables concurrently; on the first failure cancel the rest and raise it."""
    if len(aws) <= 1:
        if aws:
            await aws[0]
        return
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            # Cancelled transfers end promptly; waiting for them leaves no orphan behind.
            await asyncio.wait(pending)
    first: BaseException | None = None
    for t in tasks:
        exc = None if t.cancelled() else t.exception()
        # A signature mismatch explains everything else that went wrong; report it first.
        if exc is not None and (
            first is None or (isinstance(exc, MismatchError) and not isinstance(first, MismatchError))
        ):
            first = exc
    if first is not None:
        raise first


async def _pair(send: Awaitable[None], recv: Awaitable[None]) -> None:
    """One send and one receive concurrently, with a single extra task (the common ring step).

    The receive runs inline; if the send fails first, this task is cancelled out of the receive
    and the send's error is raised instead, so a failed send never leaves us waiting.
    """
    task = asyncio.ensure_future(send)
    current = asyncio.current_task()
    receiving = True

    def on_send_done(t: asyncio.Future[None]) -> None:
        if not t.cancelled() and t.exception() is not None and receiving and current is not None:
            current.cancel()

    task.add_done_callback(on_send_done)
    try:
        await recv
    except asyncio.CancelledError:
        if task.done() and not task.cancelled() and task.exception() is not None:
            uncancel = getattr(current, "uncancel", None)  # Python >= 3.11 counts cancellations
            if uncancel is not None:
                uncancel()
            raise task.exception() from None  # type: ignore[misc]
        task.cancel()
        raise
    except BaseException:
        task.cancel()
        raise
    finally:
        receiving = False
    await task


# A receive at least this large is posted one step early when that is safe (see _run_lane): a
# payload that arrives before its receive is posted costs an extra copy through fresh memory.
PREPOST_BYTES = 32 * 1024


async def _run_lane(
    steps: Sequence[S.Step], scratch_need: tuple[int, S.BufRef | None], ctx: Context
) -> None:
    bufs = ctx.bufs
    need, reduced = scratch_need
    # Large messages: post step k+1's receive before waiting for step k, so a peer that runs a
    # step ahead still lands its payload in place. Reduced payloads then alternate between two
    # scratch halves (step k's is still being reduced while step k+1's arrives).
    prepost = len(steps) > 1 and _largest_recv(steps[0], bufs) >= PREPOST_BYTES
    # One scratch per lane, reused by every step: reductions allocate nothing per message.
    scratch = None
    if reduced is not None:
        scratch = np.empty(2 * need if prepost else need, dtype=bufs[reduced].dtype)
    early: tuple[asyncio.Future[None], list[Reduction]] | None = None
    try:
        for k, step in enumerate(steps):
            # Sends start first, inline: a send the kernel takes at once costs no task. Receives
            # are posted before control returns to the loop, so early payloads still land in place.
            sends = start_sends(step, bufs, ctx)
            aws: list[Awaitable[None]]
            if early is not None:
                aws, reductions = [early[0]], early[1]
                early = None
            else:
                aws, reductions = _post_recvs(step, bufs, scratch, need if prepost and k % 2 else 0, ctx)
            if prepost and k + 1 < len(steps) and _may_prepost(step, steps[k + 1]):
                nxt = steps[k + 1]
                more, red = _post_recvs(nxt, bufs, scratch, need if (k + 1) % 2 else 0, ctx)
                task = asyncio.ensure_future(more[0])
                task.add_done_callback(_consume_outcome)
                early = (task, red)
            if len(aws) == 1 and not sends:
                await aws[0]
            elif len(aws) == 1 and len(sends) == 1:
                await _pair(sends[0], aws[0])
            else:
                await _all(aws + sends)
            apply_reductions(reductions, ctx)
    finally:
        if early is not None and not early[0].done():
            early[0].cancel()


def _largest_recv(step: S.Step, bufs: dict[S.BufRef, np.ndarray]) -> int:
    return max(((r.stop - r.start) * bufs[r.buf].itemsize for r in step.recvs), default=0)


def _post_recvs(
    step: S.Step, bufs: dict[S.BufRef, np.ndarray], scratch: np.ndarray | None, base: int, ctx: Context
) -> tuple[list[Awaitable[None]], list[Reduction]]:
    """The step's receives (coroutines, not yet started) and the reductions to run after them;
    reduced payloads land in ``scratch`` from ``base`` on (or stay where they arrived)."""
    landings, reductions = landing_zones(step, bufs, scratch, base)
    return [
        ctx.recv(peer, step.id, landing) if reduction is None else ctx.recv_reduced(peer, step.id, reduction)
        for peer, landing, reduction in landings
    ], reductions


class Reduction:
    """One received payload to combine into ``target`` once its step's transfers completed.

    Attributes:
        target: where the result goes. landing: the received values (scratch, or the transport's
        own buffer when the payload arrived before its receive). first: the received values are
        the left operand.
    """

    __slots__ = ("first", "landing", "target")

    def __init__(self, target: np.ndarray, landing: np.ndarray, first: bool) -> None:
        self.target = target
        self.landing = landing
        self.first = first


def landing_zones(
    step: S.Step, bufs: dict[S.BufRef, np.ndarray], scratch: np.ndarray | None, base: int
) -> tuple[list[tuple[int, np.ndarray, Reduction | None]], list[Reduction]]:
    """Where each receive of ``step`` lands ((group rank, array, its reduction or None) in the
    step's order) and the reductions to run once all arrived. Reduced payloads land in
    ``scratch`` from element ``base`` on, the others in place."""
    landings: list[tuple[int, np.ndarray, Reduction | None]] = []
    reductions: list[Reduction] = []
    offset = base
    for r in step.recvs:
        target = bufs[r.buf][r.start : r.stop]
        if r.reduce:
            assert scratch is not None
            landing = scratch[offset : offset + (r.stop - r.start)]
            offset += r.stop - r.start
            reduction = Reduction(target, landing, r.first)
            reductions.append(reduction)
            landings.append((r.peer, landing, reduction))
        else:
            landings.append((r.peer, target, None))
    return landings, reductions


def apply_reductions(reductions: Sequence[Reduction], ctx: Context) -> None:
    """Combine a step's landed payloads into their targets (after the step's transfers completed:
    a reduced range may also have been the payload of one of the step's sends)."""
    if reductions:
        with np.errstate(all="ignore"):  # overflow to inf/nan is the result, as in torch
            for r in reductions:
                reduce_into(ctx.op, r.target, r.landing, ctx.dtype_name, src_first=r.first)


def _may_prepost(step: S.Step, nxt: S.Step) -> bool:
    """Whether ``nxt``'s single receive may be posted while ``step`` runs: its payload must not
    land on anything ``step`` receives or reduces into (reduced payloads land in the other
    scratch half, so only direct receives need checking), nor on what ``step`` sends to another
    rank. A range that ``step`` sends to the very peer ``nxt`` receives from is safe: that peer
    receives our step-k message in its own step k and sends its step-k+1 message only after that
    step completed (a lane runs its steps in order, ids increasing), so its payload cannot arrive
    before ours has been handed off whole. Halving-doubling relies on this: each all-gather step
    receives into the range the matching reduce-scatter step sent to the same partner."""
    if len(nxt.recvs) != 1:
        return False
    r = nxt.recvs[0]
    if r.reduce:
        return True
    for s in step.sends:
        if s.buf == r.buf and s.start < r.stop and r.start < s.stop and s.peer != r.peer:
            return False
    for q in step.recvs:
        if q.buf == r.buf and q.start < r.stop and r.start < q.stop:
            return False
    return True


def _consume_outcome(fut: asyncio.Future[None]) -> None:
    # An early receive abandoned because its lane failed must not log "never retrieved".
    if not fut.cancelled():
        fut.exception()


def start_sends(step: S.Step, bufs: dict[S.BufRef, np.ndarray], ctx: Context) -> list[Awaitable[None]]:
    """Start every send of ``step``; returns those still in flight. If one fails at once, those
    already in flight are abandoned (their operation fails with the error) and it is raised."""
    pending: list[Awaitable[None]] = []
    try:
        for s in step.sends:
            aw = ctx.start_send(s.peer, step.id, bufs[s.buf][s.start : s.stop])
            if aw is not None:
                pending.append(aw)
    except BaseException:
        for aw in pending:
            if isinstance(aw, Coroutine):
                aw.close()
            elif isinstance(aw, asyncio.Future):
                aw.cancel()
        raise
    return pending


def copies(copies: Sequence[S.Copy], bufs: dict[S.BufRef, np.ndarray]) -> None:
    for c in copies:
        if c.count:
            np.copyto(
                bufs[c.dst][c.dst_start : c.dst_start + c.count],
                bufs[c.src][c.src_start : c.src_start + c.count],
            )


async def execute(schedule: S.Schedule, ctx: Context) -> None:
    """Run one rank's schedule: prologue, lanes concurrently, epilogue."""
    copies(schedule.prologue, ctx.bufs)
    if schedule.lanes:
        await _all(
            [_run_lane(lane, need, ctx) for lane, need in zip(schedule.lanes, schedule.scratch, strict=True)]
        )
    copies(schedule.epilogue, ctx.bufs)


def _check_flat(arrays: Sequence[np.ndarray], what: str) -> None:
    for a in arrays:
        if not isinstance(a, np.ndarray) or a.ndim != 1 or not a.flags.c_contiguous:
            raise ValueError(
                f"{what}: the executor needs contiguous 1-D numpy arrays, got {type(a).__name__}"
            )


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@functools.lru_cache(maxsize=1024)
def _cached_schedule(
    kind: str,
    algorithm: str,
    n: int,
    me: int,
    root: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    rd_max_bytes: int,
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None,
) -> S.Schedule:
    """This rank's schedule; schedules are immutable, so repeated operations reuse them."""
    sized = {"itemsize": itemsize, "chunk_bytes": chunk_bytes}
    if kind == "all_reduce":
        if algorithm == "ring":
            return S.ring_all_reduce_schedule(n, me, count, **sized)
        if algorithm == "rhd":
            return S.rhd_all_reduce_schedule(n, me, count, itemsize=itemsize, rd_max_bytes=rd_max_bytes)
        return S.tree_all_reduce_schedule(n, me, count, **sized)
    if kind == "broadcast":
        if algorithm == "tree":
            return S.tree_broadcast_schedule(n, me, root, count, **sized)
        return S.direct_broadcast_schedule(n, me, root, count)
    if kind == "reduce":
        if algorithm == "tree":
            return S.tree_reduce_schedule(n, me, root, count, **sized)
        return S.direct_reduce_schedule(n, me, root, count)
    if kind == "all_gather":
        if algorithm == "ring":
            return S.ring_all_gather_schedule(n, me, count, **sized)
        return S.direct_all_gather_schedule(n, me, count)
    if kind == "gather":
        return S.direct_gather_schedule(n, me, root, count)
    if kind == "scatter":
        return S.direct_scatter_schedule(n, me, root, count)
    if kind == "reduce_scatter":
        if algorithm == "ring":
            return S.ring_reduce_scatter_schedule(n, me, count, **sized)
        return S.direct_reduce_scatter_schedule(n, me, count)
    if kind == "all_to_all":
        assert splits is not None
        return S.direct_all_to_all_schedule(n, me, splits[0], splits[1])
    return S.dissemination_barrier_schedule(n, me)


def _plan(
    spec: CollectiveSpec, algorithm: str
) -> tuple[S.Schedule, dict[S.BufRef, np.ndarray], list[np.ndarray]]:
    """Build (schedule, buffer map, arrays that hold an AVG result) for this rank."""
    n, me, root, kind = len(spec.ranks), spec.me, spec.root, spec.kind
    send, recv = spec.send, spec.recv
    bufs: dict[S.BufRef, np.ndarray] = {}
    for i, a in enumerate(send):
        bufs[("s", i)] = a
    for i, a in enumerate(recv):
        bufs[("r", i)] = a
    results: list[np.ndarray] = []
    itemsize = recv[0].itemsize if recv else send[0].itemsize if send else 1
    count = 0
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    if kind in ("all_reduce", "reduce"):
        _expect(len(send) == 1 and len(recv) == 1, f"{kind} takes send=(x,) and recv=(x,)")
        _expect(send[0].size == recv[0].size, f"{kind}: send and recv sizes differ")
        count = recv[0].size
        if kind == "all_reduce" or me == root:
            if send[0] is not recv[0]:
                np.copyto(recv[0], send[0])
            bufs[S.W] = recv[0]
            results.append(recv[0])
    elif kind == "broadcast":
        _expect(len(recv) == 1, "broadcast takes recv=(x,)")
        bufs[S.W] = recv[0]
        count = recv[0].size
    elif kind in ("all_gather", "gather"):
        _expect(len(send) == 1, f"{kind} takes send=(x,)")
        count = send[0].size
        if kind == "all_gather" or me == root:
            _expect(len(recv) == n, f"{kind} needs {n} output arrays here, got {len(recv)}")
            _expect(all(r.size == count for r in recv), f"{kind}: every output must have {count} elements")
    elif kind == "scatter":
        _expect(len(recv) == 1, "scatter takes recv=(x,)")
        count = recv[0].size
        if me == root:
            _expect(len(send) == n, f"scatter needs {n} input arrays at the root, got {len(send)}")
            _expect(all(s.size == count for s in send), f"scatter: every input must have {count} elements")
    elif kind == "reduce_scatter":
        _expect(len(recv) == 1 and len(send) == n, f"reduce_scatter takes {n} inputs and recv=(x,)")
        count = recv[0].size
        _expect(all(s.size == count for s in send), f"reduce_scatter: every input must have {count} elements")
        results.append(recv[0])
        if algorithm == "ring":
            bufs[S.W] = np.concatenate(send) if n > 1 else send[0]
    elif kind == "all_to_all":
        _expect(len(send) == n and len(recv) == n, f"all_to_all takes {n} inputs and {n} outputs")
        _expect(
            send[me].size == recv[me].size, "all_to_all: what a rank sends itself must fit its own output"
        )
        splits = (tuple(s.size for s in send), tuple(r.size for r in recv))
    else:  # barrier
        bufs[S.Z] = np.empty(0, dtype=np.uint8)
    sched = _cached_schedule(
        kind, algorithm, n, me, root, count, itemsize, S.CHUNK_BYTES, S.RD_MAX_BYTES, splits
    )
    if kind == "reduce" and me != root:
        if any(r.reduce for st in sched.steps() for r in st.recvs):
            bufs[S.W] = send[0].copy()  # interior tree node: accumulate without touching x
        else:
            bufs[S.W] = send[0]
    return sched, bufs, results


@dataclass(slots=True)
class Prepared:
    """One rank's validated plan for one operation: what ``run_collective`` and the eager runner
    (``_eager``) execute.

    Attributes:
        sched: this rank's schedule. bufs: the schedule's buffer names mapped onto the arrays.
        averaged: arrays that hold a result to divide by the group size afterwards (AVG only).
        dtype_name: the canonical dtype. op: the reduce op. nbytes: bytes of one rank's vector.
    """

    sched: S.Schedule
    bufs: dict[S.BufRef, np.ndarray]
    averaged: list[np.ndarray]
    dtype_name: str
    op: ReduceOp
    group_size: int
    nbytes: int

    def finish(self) -> None:
        """What runs after the last message: AVG's division."""
        if self.averaged:
            with np.errstate(all="ignore"):
                for result in self.averaged:
                    finish_avg(result, self.group_size, self.dtype_name)


def prepare(spec: CollectiveSpec, meta: dict[str, Any]) -> Prepared:
    """Validate ``spec`` and plan it for this rank (no message moves yet).

    Args:
        spec: the operation (see CollectiveSpec). meta: its signature (reads "dtype" for bfloat16).
    Raises:
        ValueError: inconsistent spec (arrays, ranks, root, unknown algorithm for the kind).
        TypeError: a reduce op that means nothing for the dtype.
    """
    n = len(spec.ranks)
    if spec.kind == "all_reduce" and spec.algorithm is None:
        fast = _fast_all_reduce(spec, meta)
        if fast is not None:
            sched, bufs, dtype_name = fast
            x = bufs[S.W]
            averaged = [x] if spec.op is ReduceOp.AVG else []
            return Prepared(sched, bufs, averaged, dtype_name, spec.op, n, int(x.nbytes))
    if spec.kind not in ALGORITHMS:
        raise ValueError(f"unknown collective kind {spec.kind!r}; expected one of {KINDS}")
    if not 0 <= spec.me < n:
        raise ValueError(f"group rank {spec.me} out of range for a group of {n}")
    if not 0 <= spec.root < n:
        raise ValueError(f"root {spec.root} out of range for a group of {n} (roots are group ranks)")
    _check_flat(spec.send, f"{spec.kind} send")
    _check_flat(spec.recv, f"{spec.kind} recv")
    arrays = (*spec.recv, *spec.send)
    dtype_name = spec.dtype or _dtype_of(arrays, meta)
    reduces = spec.kind in ("all_reduce", "reduce", "reduce_scatter")
    if reduces:
        check_reduce_op(spec.op, dtype_name)
        if any(a.dtype != arrays[0].dtype for a in arrays):
            raise ValueError(f"{spec.kind}: every array must have the same dtype")
    nbytes = _nbytes(spec)
    algorithm = spec.algorithm or choose_algorithm(spec.kind, nbytes, n)
    if algorithm not in ALGORITHMS[spec.kind]:
        raise ValueError(
            f"algorithm {algorithm!r} is not available for {spec.kind}; choose one of {ALGORITHMS[spec.kind]}"
        )
    sched, bufs, results = _plan(spec, algorithm)
    averaged = results if reduces and spec.op is ReduceOp.AVG else []
    return Prepared(sched, bufs, averaged, dtype_name, spec.op, n, nbytes)


def context(
    prepared: Prepared, spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any]
) -> Context:
    """The per-message context of one prepared operation (shared with the eager runner)."""
    return Context(
        transport, tuple(tag), meta, spec.ranks, spec.me, prepared.bufs, prepared.op, prepared.dtype_name
    )


async def run_collective(spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any]) -> None:
    """Run one collective operation for this rank, in place on ``spec``'s arrays.

    Args:
        spec: the operation (see CollectiveSpec).
        transport: carries the messages; peers are addressed by global rank.
        tag: the operation's unique tag prefix; message k is tagged ``(*tag, k)``.
        meta: the operation's signature, sent with every message and compared on receipt.
    Raises:
        ValueError: inconsistent spec (arrays, ranks, root, unknown algorithm for the kind).
        TypeError: a reduce op that means nothing for the dtype.
        MismatchError: a peer's signature or message size differs from ours.
        PeerLostError: a peer involved in the operation is gone.
    """
    prepared = prepare(spec, meta)
    sched = prepared.sched
    ctx = context(prepared, spec, transport, tag, meta)
    if len(sched.lanes) == 1 and not sched.prologue and not sched.epilogue:
        await _run_lane(sched.lanes[0], sched.scratch[0], ctx)
    else:
        await execute(sched, ctx)
    prepared.finish()


_DTYPE_NAMES: dict[np.dtype[Any], str] = {}

# In-place all_reduce (the hot path of training loops) skips re-validating what it validated
# before: (group size, my rank, op, dtype, count, dtype hints) -> (schedule, dtype name). Every
# check of run_collective depends only on these, so a hit is as safe as the full path.
_FAST_PLANS: dict[tuple[Any, ...], tuple[S.Schedule, str]] = {}
_FAST_PLANS_MAX = 1024


def _fast_all_reduce(
    spec: CollectiveSpec, meta: dict[str, Any]
) -> tuple[S.Schedule, dict[S.BufRef, np.ndarray], str] | None:
    """(schedule, buffers, dtype name) for an in-place all_reduce seen before; else None after
    remembering it when it passes the full checks (which then run again, harmlessly)."""
    if len(spec.send) != 1 or len(spec.recv) != 1:
        return None
    x = spec.recv[0]
    if spec.send[0] is not x or type(x) is not np.ndarray or x.ndim != 1 or not x.flags.c_contiguous:
        return None
    n = len(spec.ranks)
    op = spec.op
    op_key = op._value_ if type(op) is ReduceOp else op
    key = (n, spec.me, op_key, x.dtype, x.size, spec.dtype, meta.get("dtype"))
    plan = _FAST_PLANS.get(key)
    if plan is None:
        if not 0 <= spec.me < n or not 0 <= spec.root < n:
            return None  # the full path raises the error
        dtype_name = spec.dtype or _dtype_of((x,), meta)
        try:
            check_reduce_op(op, dtype_name)
        except (TypeError, ValueError):
            return None
        algorithm = choose_algorithm("all_reduce", int(x.nbytes), n)
        sched = _cached_schedule(
            "all_reduce", algorithm, n, spec.me, 0, int(x.size), x.itemsize,
            S.CHUNK_BYTES, S.RD_MAX_BYTES, None,
        )
        if len(_FAST_PLANS) >= _FAST_PLANS_MAX:
            _FAST_PLANS.clear()
        plan = _FAST_PLANS[key] = (sched, dtype_name)
    sched, dtype_name = plan
    return sched, {("s", 0): x, ("r", 0): x, S.W: x}, dtype_name


def _dtype_of(arrays: Sequence[np.ndarray], meta: dict[str, Any]) -> str:
    """The arrays' dtype, except that uint16 arrays carry bfloat16 when the signature says so."""
    if not arrays:
        return "uint8"
    dtype = arrays[0].dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # numpy computes .name in Python; remember it
        name = _DTYPE_NAMES[dtype] = dtype.name
    if name == "uint16" and meta.get("dtype") == "bfloat16":
        return "bfloat16"
    return name


def _nbytes(spec: CollectiveSpec) -> int:
    if spec.kind in ("broadcast", "scatter", "reduce_scatter"):
        return int(spec.recv[0].nbytes) if spec.recv else 0
    if spec.send:
        return int(spec.send[0].nbytes)
    return 0
