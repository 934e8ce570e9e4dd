"""Planning one collective: the operation as the engine describes it (CollectiveSpec), the
choice of algorithm, validation, and this rank's schedule bound to the operation's arrays.

Imports only foundations (_buffers, _reduce, _types, _schedule); never asyncio, numpy,
client/ or the public surface. ``prepare`` is the one planning path for every kind and size; the
step driver (``_driver``) runs what it returns.

Plans are cached per signature: everything validation and the schedule depend on (kind, group
size, rank, root, op, algorithm override, dtype hints, and each array's dtype, size and layout as
``Buffers.signature`` reports it) is the key, so a hit is exactly as safe as planning again; only
what depends on the arrays' identity (the buffer map, an out-of-place input's copy) is redone.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .._buffers import NUMPY, Buffers
from .._reduce import check_reduce_op
from .._types import ReduceOp
from . import _schedule as S

__all__ = [
    "ALGORITHMS",
    "KINDS",
    "CollectiveSpec",
    "Prepared",
    "choose_algorithm",
    "prepare",
]

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


@dataclass(slots=True)  # not frozen: a frozen dataclass takes ~0.85 us to build, this ~0.25
class CollectiveSpec:
    """One collective operation as this rank sees it (built per call, never changed after).

    Attributes:
        kind: one of KINDS.
        ranks: global ranks of the group; position = group rank.
        me: my group rank (index into ``ranks``).
        send, recv: flat arrays of ``buffers`` (contiguous 1-D numpy arrays by default); per kind:
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
        buffers: the memory the arrays live in (host numpy unless told otherwise).
    """

    kind: str
    ranks: tuple[int, ...]
    me: int
    send: tuple[Any, ...]
    recv: tuple[Any, ...]
    root: int = 0
    op: ReduceOp = ReduceOp.SUM
    algorithm: str | None = None
    dtype: str | None = None
    buffers: Buffers = NUMPY


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
        # measured side by side it beat the ring at 4 ranks from 1 MiB to 64 MiB and tied at 2.
        # Above 4 ranks, and for non powers of two (extra ranks fold in and send twice), the
        # ring's even load wins.
        power_of_two = world_size & (world_size - 1) == 0
        return "rhd" if power_of_two and world_size <= 4 else "ring"
    if kind in ("broadcast", "reduce"):
        return "tree"
    if kind in ("all_gather", "reduce_scatter"):
        # Direct moves the same bytes per rank as the ring in a single round; the ring only pays
        # off when many peers would otherwise all send large blocks at one receiver at once.
        return "ring" if world_size > 4 and nbytes * world_size >= 4 * SMALL_BYTES else "direct"
    return ALGORITHMS[kind][0]


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


def _dtype_of(arrays: Sequence[Any], meta: dict[str, Any]) -> str:
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


_DTYPE_NAMES: dict[Any, str] = {}


@dataclass(frozen=True, slots=True)
class _Plan:
    """What validation found for one signature (see the module docstring)."""

    sched: S.Schedule
    algorithm: str
    dtype_name: str
    nbytes: int
    averages: bool  # AVG: the results are divided by the group size at the end
    accumulates: bool  # reduce at a non-root rank that combines into a copy of its input
    itemsize: int  # bytes per element of the arrays (of the reduced ones, where a kind reduces)
    first_recv_bytes: tuple[int, ...]  # per lane: its first step's largest receive, in bytes


@dataclass(slots=True)
class Prepared:
    """One rank's validated plan for one operation, bound to its arrays: what the driver runs.

    Attributes:
        sched: this rank's schedule. bufs: the schedule's buffer names mapped onto the arrays.
        averaged: arrays that hold a result to divide by the group size afterwards (AVG only).
        dtype_name: the canonical dtype. op: the reduce op. nbytes: bytes of one rank's vector.
        buffers: the memory's implementation (scratch, views, copies, reductions).
        itemsize: bytes per element (of the reduced arrays, where the kind reduces).
        first_recv_bytes: per lane, the largest receive of its first step, in bytes (planned
            once per signature: the driver decides from it whether to post receives early).
    """

    sched: S.Schedule
    bufs: dict[S.BufRef, Any]
    averaged: list[Any]
    dtype_name: str
    op: ReduceOp
    group_size: int
    nbytes: int
    buffers: Buffers
    itemsize: int
    first_recv_bytes: tuple[int, ...]

    def finish(self) -> None:
        """What runs after the last message: AVG's division."""
        for result in self.averaged:
            self.buffers.finish_avg(result, self.group_size, self.dtype_name)


_PLANS: dict[tuple[Any, ...], _Plan] = {}
_PLANS_MAX = 1024


def prepare(spec: CollectiveSpec, meta: dict[str, Any]) -> Prepared:
    """Validate ``spec`` and plan it for this rank (no message moves yet).

    Args:
        spec: the operation (see CollectiveSpec). meta: its signature (reads "dtype" for bfloat16).
    Raises:
        ValueError: inconsistent spec (arrays, ranks, root, unknown algorithm for the kind).
        TypeError: a reduce op that means nothing for the dtype.
    """
    key = _signature(spec, meta)
    plan = _PLANS.get(key) if key is not None else None
    if plan is None:
        plan = _validate(spec, meta)
        if key is not None:
            if len(_PLANS) >= _PLANS_MAX:
                _PLANS.clear()
            _PLANS[key] = plan
    bufs, results = _bind(spec, plan)
    return Prepared(
        plan.sched,
        bufs,
        results if plan.averages else [],
        plan.dtype_name,
        spec.op,
        len(spec.ranks),
        plan.nbytes,
        spec.buffers,
        plan.itemsize,
        plan.first_recv_bytes,
    )


def _signature(spec: CollectiveSpec, meta: dict[str, Any]) -> tuple[Any, ...] | None:
    """The cache key of ``spec``'s plan; None when it must be planned from scratch."""
    op = spec.op
    if type(op) is not ReduceOp:
        return None
    buffers = spec.buffers
    send = buffers.signature(spec.send)
    in_place = len(spec.send) == 1 and len(spec.recv) == 1 and spec.send[0] is spec.recv[0]
    recv = send if in_place else buffers.signature(spec.recv)
    if send is None or recv is None:
        return None
    return (
        spec.kind,
        len(spec.ranks),
        spec.me,
        spec.root,
        op._value_,
        spec.algorithm,
        spec.dtype,
        meta.get("dtype"),
        send,
        recv,
        buffers,
        # Module settings a test may change (chunking, the halving-doubling size limit):
        S.CHUNK_BYTES,
        S.RD_MAX_BYTES,
    )


def _validate(spec: CollectiveSpec, meta: dict[str, Any]) -> _Plan:
    n = len(spec.ranks)
    if spec.kind not in ALGORITHMS:
        raise ValueError(f"unknown collective kind {spec.kind!r}; expected one of {KINDS}")
    if not 0 <= spec.me < n:
        raise ValueError(f"group rank {spec.me} out of range for a group of {n}")
    if not 0 <= spec.root < n:
        raise ValueError(f"root {spec.root} out of range for a group of {n} (roots are group ranks)")
    spec.buffers.check_flat(spec.send, f"{spec.kind} send")
    spec.buffers.check_flat(spec.recv, f"{spec.kind} recv")
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
    count, splits = _shape(spec)
    itemsize = spec.buffers.itemsize(arrays[0]) if arrays else 1
    sched = _cached_schedule(
        spec.kind, algorithm, n, spec.me, spec.root, count, itemsize, S.CHUNK_BYTES, S.RD_MAX_BYTES, splits
    )
    accumulates = (
        spec.kind == "reduce"
        and spec.me != spec.root
        and any(r.reduce for st in sched.steps() for r in st.recvs)
    )
    averages = reduces and spec.op is ReduceOp.AVG
    first_recv_bytes = tuple(_first_recv_bytes(spec, lane, itemsize) for lane in sched.lanes)
    return _Plan(sched, algorithm, dtype_name, nbytes, averages, accumulates, itemsize, first_recv_bytes)


def _first_recv_bytes(spec: CollectiveSpec, lane: Sequence[S.Step], itemsize: int) -> int:
    """Bytes of the largest receive of ``lane``'s first step. Receives land in the arrays (whose
    dtypes agree where a kind reduces, and which the signature pins), in the working copy (the
    arrays' dtype) or in a barrier's empty byte buffer."""
    largest = 0
    for r in lane[0].recvs if lane else ():
        kind, i = r.buf
        if kind == "s":
            size = spec.buffers.itemsize(spec.send[i])
        elif kind == "r":
            size = spec.buffers.itemsize(spec.recv[i])
        else:
            size = 1 if r.buf == S.Z else itemsize
        largest = max(largest, (r.stop - r.start) * size)
    return largest


def _shape(spec: CollectiveSpec) -> tuple[int, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """Check the arrays' number and sizes for the kind; (elements per block, all_to_all splits).

    Raises:
        ValueError: naming what does not fit.
    """
    n, me, root, kind = len(spec.ranks), spec.me, spec.root, spec.kind
    send, recv = spec.send, spec.recv
    size = spec.buffers.size
    if kind in ("all_reduce", "reduce"):
        _expect(len(send) == 1 and len(recv) == 1, f"{kind} takes send=(x,) and recv=(x,)")
        _expect(size(send[0]) == size(recv[0]), f"{kind}: send and recv sizes differ")
        return size(recv[0]), None
    if kind == "broadcast":
        _expect(len(recv) == 1, "broadcast takes recv=(x,)")
        return size(recv[0]), None
    if kind in ("all_gather", "gather"):
        _expect(len(send) == 1, f"{kind} takes send=(x,)")
        count = size(send[0])
        if kind == "all_gather" or me == root:
            _expect(len(recv) == n, f"{kind} needs {n} output arrays here, got {len(recv)}")
            _expect(all(size(r) == count for r in recv), f"{kind}: every output must have {count} elements")
        return count, None
    if kind == "scatter":
        _expect(len(recv) == 1, "scatter takes recv=(x,)")
        count = size(recv[0])
        if me == root:
            _expect(len(send) == n, f"scatter needs {n} input arrays at the root, got {len(send)}")
            _expect(all(size(s) == count for s in send), f"scatter: every input must have {count} elements")
        return count, None
    if kind == "reduce_scatter":
        _expect(len(recv) == 1 and len(send) == n, f"reduce_scatter takes {n} inputs and recv=(x,)")
        count = size(recv[0])
        _expect(
            all(size(s) == count for s in send), f"reduce_scatter: every input must have {count} elements"
        )
        return count, None
    if kind == "all_to_all":
        _expect(len(send) == n and len(recv) == n, f"all_to_all takes {n} inputs and {n} outputs")
        _expect(
            size(send[me]) == size(recv[me]), "all_to_all: what a rank sends itself must fit its own output"
        )
        return 0, (tuple(size(s) for s in send), tuple(size(r) for r in recv))
    return 0, None  # barrier


def _bind(spec: CollectiveSpec, plan: _Plan) -> tuple[dict[S.BufRef, Any], list[Any]]:
    """Map the schedule's buffer names onto this call's arrays (buffer map, arrays holding a
    reduced result); copies an out-of-place input where the result is computed in place."""
    kind, send, recv, buffers = spec.kind, spec.send, spec.recv, spec.buffers
    bufs: dict[S.BufRef, Any] = {}
    for i, a in enumerate(send):
        bufs[("s", i)] = a
    for i, a in enumerate(recv):
        bufs[("r", i)] = a
    results: list[Any] = []
    if kind == "all_reduce" or (kind == "reduce" and spec.me == spec.root):
        if send[0] is not recv[0]:
            buffers.copy(recv[0], send[0])
        bufs[S.W] = recv[0]
        results.append(recv[0])
    elif kind == "reduce":
        # An interior tree node accumulates into a copy, leaving its input untouched.
        bufs[S.W] = _copy_of(buffers, send[0]) if plan.accumulates else send[0]
    elif kind == "broadcast":
        bufs[S.W] = recv[0]
    elif kind == "reduce_scatter":
        results.append(recv[0])
        if plan.algorithm == "ring":
            bufs[S.W] = _concatenated(buffers, send) if len(send) > 1 else send[0]
    elif kind == "barrier":
        bufs[S.Z] = buffers.nothing()
    return bufs, results


def _concatenated(buffers: Buffers, arrays: Sequence[Any]) -> Any:
    """One new array holding ``arrays`` one after another (the ring reduce_scatter's working
    copy of its inputs)."""
    out = buffers.scratch(arrays[0], sum(buffers.size(a) for a in arrays))
    at = 0
    for a in arrays:
        size = buffers.size(a)
        buffers.copy(buffers.view(out, at, at + size), a)
        at += size
    return out


def _copy_of(buffers: Buffers, array: Any) -> Any:
    out = buffers.scratch(array, buffers.size(array))
    buffers.copy(out, array)
    return out
