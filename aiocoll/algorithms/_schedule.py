"""Collective algorithms as pure schedules: functions of (world size, my rank, sizes) -> steps.

Imports nothing from aiocoll and nothing asynchronous: a schedule is data, so every algorithm can
be checked without an event loop (every send has a matching receive, ring moves each chunk n-1
times, ...). ``_driver`` (the one step driver) applies any schedule over a Transport.

Vocabulary. Peers are *group* ranks. Buffers are named, per operation, by a BufRef:
``("w", 0)`` the working vector (all_reduce/broadcast/reduce data, reduce_scatter's
concatenated input), ``("s", i)`` the i-th send array, ``("r", i)`` the i-th receive array,
``("z", 0)`` an empty buffer (barrier). Ranges are element offsets into those 1-D arrays.

A Schedule is a tuple of *lanes*; each lane is a sequence of Steps run one after the other, and
lanes run concurrently (pipelining: chunk k+1 travels while chunk k is being reduced). A Step
does all of its sends and receives concurrently (so two ranks that
send to each other never deadlock), then applies its reducing receives in the listed order. A
message sent by step ``id`` on one rank is received by the step with the same ``id`` on the
other: ids are agreed by construction, and one rank sends at most one message per id to a peer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

__all__ = [
    "CHUNK_BYTES",
    "MAX_LANES",
    "RD_MAX_BYTES",
    "BufRef",
    "Copy",
    "Recv",
    "Schedule",
    "Send",
    "Step",
    "dissemination_barrier_schedule",
    "direct_all_gather_schedule",
    "direct_all_to_all_schedule",
    "direct_broadcast_schedule",
    "direct_gather_schedule",
    "direct_reduce_schedule",
    "direct_reduce_scatter_schedule",
    "direct_scatter_schedule",
    "pipelined",
    "rhd_all_reduce_schedule",
    "ring_all_gather_schedule",
    "ring_all_reduce_schedule",
    "ring_reduce_scatter_schedule",
    "split_bounds",
    "tree_all_reduce_schedule",
    "tree_broadcast_schedule",
    "tree_reduce_schedule",
]

BufRef = tuple[str, int]
W: BufRef = ("w", 0)
Z: BufRef = ("z", 0)

CHUNK_BYTES = 16 * 1024 * 1024
"""Target payload of one pipelined message. Large: over TCP from Python each message and each
extra lane in flight costs CPU (wakeups, partial sends, early arrivals copied), and on a host
whose cores the ranks share CPU is what limits bandwidth. Measured with 4 ranks on 2 cores, a
16 MiB all_reduce took ~24 ms CPU per rank with 256 KiB chunks and ~13-15 ms with whole blocks
(2 ranks: ~14.5 ms -> ~7.5 ms); the reduction (numpy, tens of GB/s) needs no overlap to hide."""
MAX_LANES = 4
"""Pipelined chunks in flight per operation; bounds the unexpected bytes a peer may buffer for
one operation to about MAX_LANES * CHUNK_BYTES per link."""
RD_MAX_BYTES = 16 * 1024
"""Up to this many bytes, "rhd" all_reduce uses plain recursive doubling (log2 p rounds of the
whole vector), which beats halving-doubling's 2 log2 p rounds while latency dominates."""


@dataclass(frozen=True, slots=True)
class Send:
    """Send elements [start, stop) of ``buf`` to group rank ``peer``."""

    peer: int
    buf: BufRef
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive from ``peer`` into elements [start, stop) of ``buf``; with ``reduce`` combine the
    received values into them (via scratch) instead of overwriting. ``first``: the received
    values are the left operand (``buf = received op buf``), so that ranks which both compute a
    combination compute it in the same order and agree bit for bit."""

    peer: int
    buf: BufRef
    start: int
    stop: int
    reduce: bool = False
    first: bool = False


@dataclass(frozen=True, slots=True)
class Copy:
    """Local copy of ``count`` elements from ``src`` at ``src_start`` to ``dst`` at ``dst_start``."""

    src: BufRef
    src_start: int
    dst: BufRef
    dst_start: int
    count: int


@dataclass(frozen=True, slots=True)
class Step:
    id: int
    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()


@dataclass(frozen=True, slots=True)
class Schedule:
    """Lanes of steps (see the module docstring).

    Attributes:
        lanes: run concurrently; the steps of one lane in order.
        span: every rank's step ids are < span (ids are per-operation message tags).
        prologue: local copies done before any lane starts. epilogue: after every lane ended.
    """

    lanes: tuple[tuple[Step, ...], ...]
    span: int
    prologue: tuple[Copy, ...] = ()
    epilogue: tuple[Copy, ...] = ()
    scratch: tuple[tuple[int, BufRef | None], ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Per lane: elements of scratch its largest step needs for reducing receives, and the
        # buffer whose dtype the scratch takes. Computed once, as schedules are cached.
        needs = []
        for lane in self.lanes:
            need = max((sum(r.stop - r.start for r in st.recvs if r.reduce) for st in lane), default=0)
            ref = next((r.buf for st in lane for r in st.recvs if r.reduce), None)
            needs.append((need, ref))
        object.__setattr__(self, "scratch", tuple(needs))

    def steps(self) -> list[Step]:
        return [step for lane in self.lanes for step in lane]


def split_bounds(count: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` near-equal contiguous pieces of ``count`` elements."""
    return [i * count // parts for i in range(parts + 1)]


def _log2_ceil(n: int) -> int:
    return max(0, (n - 1).bit_length())


def _single(steps: Sequence[Step], span: int) -> Schedule:
    return Schedule((tuple(steps),) if steps else (), span)


# --------------------------------------------------------------------------------------------
# Pipelining: run a base schedule once per chunk of the data, chunks spread over lanes.


def _shift(step: Step, offset: int, id_base: int) -> Step:
    return Step(
        id=step.id + id_base,
        sends=tuple(replace(s, start=s.start + offset, stop=s.stop + offset) for s in step.sends),
        recvs=tuple(replace(r, start=r.start + offset, stop=r.stop + offset) for r in step.recvs),
    )


def pipelined(
    base: Callable[[int], Schedule],
    count: int,
    chunk: int,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """Cut ``count`` elements into chunks of about ``chunk`` and run ``base`` on each.

    Args:
        base: schedule for ``m`` elements at offset 0 (single lane; its ``span`` must not depend
            on ``m``); ranges are shifted to each chunk's offset.
        count: elements in total. chunk: target elements per chunk (>= 1).
        max_lanes: chunks in flight; chunk i goes to lane i % lanes.
    """
    chunks = max(1, -(-count // max(1, chunk)))
    if chunks == 1:
        return base(count)
    bounds = split_bounds(count, chunks)
    lanes_n = min(max_lanes, chunks)
    lanes: list[list[Step]] = [[] for _ in range(lanes_n)]
    span = 0
    for c in range(chunks):
        sub = base(bounds[c + 1] - bounds[c])
        span = sub.span
        for step in sub.steps():
            lanes[c % lanes_n].append(_shift(step, bounds[c], c * sub.span))
    return Schedule(tuple(tuple(lane) for lane in lanes if lane), span * chunks)


def _chunk_elems(itemsize: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, itemsize))


# --------------------------------------------------------------------------------------------
# Ring: reduce-scatter then all-gather around me -> me+1, over n blocks.
# Blocks are (buffer, start, length); a pipelined chunk [c0, c1) is taken inside every block.


Block = tuple[BufRef, int, int]


def _ring_steps(
    n: int,
    me: int,
    blocks: Sequence[Block],
    c0: int,
    c1: int,
    *,
    reduce_phase: bool,
    gather_phase: bool,
    id_base: int = 0,
) -> list[Step]:
    nxt, prv = (me + 1) % n, (me - 1) % n

    def rng(b: int) -> tuple[BufRef, int, int]:
        buf, start, length = blocks[b]
        lo, hi = min(c0, length), min(c1, length)
        return buf, start + lo, start + hi

    steps: list[Step] = []
    if reduce_phase:
        # After step k rank me holds the partial sum of block (me-k-2) over k+2 ranks; after n-1
        # steps it holds block me reduced over all n.
        for k in range(n - 1):
            sbuf, s0, s1 = rng((me - k - 1) % n)
            rbuf, r0, r1 = rng((me - k - 2) % n)
            steps.append(
                Step(id_base + k, (Send(nxt, sbuf, s0, s1),), (Recv(prv, rbuf, r0, r1, reduce=True),))
            )
    if gather_phase:
        base = id_base + (n - 1)
        for k in range(n - 1):
            sbuf, s0, s1 = rng((me - k) % n)
            rbuf, r0, r1 = rng((me - k - 1) % n)
            steps.append(Step(base + k, (Send(nxt, sbuf, s0, s1),), (Recv(prv, rbuf, r0, r1),)))
    return steps


def ring_all_reduce_schedule(
    n: int,
    me: int,
    count: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """Ring all_reduce of ``W`` in place: reduce-scatter then all-gather, pipelined.

    Each rank sends 2(n-1)/n of the data, the bandwidth optimum. The vector is cut into chunks
    of about ``n * chunk_bytes`` bytes so each message carries about ``chunk_bytes``.
    """
    span = 2 * (n - 1)
    if n == 1:
        return Schedule((), 0)

    def base(m: int) -> Schedule:
        bounds = split_bounds(m, n)
        blocks = [(W, bounds[b], bounds[b + 1] - bounds[b]) for b in range(n)]
        length = max(bl[2] for bl in blocks)
        return _single(_ring_steps(n, me, blocks, 0, length, reduce_phase=True, gather_phase=True), span)

    return pipelined(base, count, n * _chunk_elems(itemsize, chunk_bytes), max_lanes)


def _blockwise_pipelined(
    blocks: Sequence[Block],
    make: Callable[[int, int, int], list[Step]],
    span: int,
    chunk: int,
    max_lanes: int,
) -> Schedule:
    """Pipeline a blockwise schedule: chunk [c0, c1) of every block per chunk."""
    length = max((b[2] for b in blocks), default=0)
    chunks = max(1, -(-length // max(1, chunk)))
    bounds = split_bounds(length, chunks)
    lanes_n = min(max_lanes, chunks)
    lanes: list[list[Step]] = [[] for _ in range(lanes_n)]
    for c in range(chunks):
        lanes[c % lanes_n].extend(make(bounds[c], bounds[c + 1], c * span))
    return Schedule(tuple(tuple(lane) for lane in lanes if lane), span * chunks)


def ring_all_gather_schedule(
    n: int,
    me: int,
    count: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """Ring all_gather: copy ``S0`` into ``R[me]``, then pass blocks around the ring (n-1 steps)."""
    prologue = (Copy(("s", 0), 0, ("r", me), 0, count),)
    if n == 1:
        return Schedule((), 0, prologue)
    blocks = [(("r", b), 0, count) for b in range(n)]
    sched = _blockwise_pipelined(
        blocks,
        # _ring_steps numbers the gather phase from id_base + n - 1; shift it back to id_base.
        lambda c0, c1, base: _ring_steps(
            n, me, blocks, c0, c1, reduce_phase=False, gather_phase=True, id_base=base - (n - 1)
        ),
        n - 1,
        _chunk_elems(itemsize, chunk_bytes),
        max_lanes,
    )
    return replace(sched, prologue=prologue)


def ring_reduce_scatter_schedule(
    n: int,
    me: int,
    count: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """Ring reduce_scatter over ``W`` = the n inputs concatenated (n * count elements).

    After the ring, block ``me`` of W is reduced over all ranks; the epilogue copies it to R[0].
    """
    epilogue = (Copy(W, me * count, ("r", 0), 0, count),)
    if n == 1:
        return Schedule((), 0, (), epilogue)
    blocks = [(W, b * count, count) for b in range(n)]
    sched = _blockwise_pipelined(
        blocks,
        lambda c0, c1, base: _ring_steps(
            n, me, blocks, c0, c1, reduce_phase=True, gather_phase=False, id_base=base
        ),
        n - 1,
        _chunk_elems(itemsize, chunk_bytes),
        max_lanes,
    )
    return replace(sched, epilogue=epilogue)


# --------------------------------------------------------------------------------------------
# Recursive doubling / halving-doubling (Rabenseifner) with the usual fold for n != 2^k.


def rhd_all_reduce_schedule(
    n: int, me: int, count: int, *, itemsize: int = 4, rd_max_bytes: int = RD_MAX_BYTES
) -> Schedule:
    """All_reduce of ``W`` in place by recursive doubling (small) or halving-doubling (larger).

    With p the largest power of two <= n and r = n - p: ranks 2i and 2i+1 (i < r) first fold
    (the even rank sends its vector to the odd one, which reduces it and stands in for both);
    the p remaining ranks run the power-of-two algorithm; at the end the odd ranks send the
    result back. Recursive doubling exchanges the whole vector log2 p times; halving-doubling
    reduce-scatters by recursive halving and all-gathers by recursive doubling (2 log2 p rounds
    moving 2(p-1)/p of the vector), used when the vector is above ``rd_max_bytes``.
    """
    if n == 1:
        return Schedule((), 0)
    p = 1 << (n.bit_length() - 1)
    r = n - p
    logp = p.bit_length() - 1
    halving = count * itemsize > rd_max_bytes and count >= p
    span = 2 + (2 * logp if halving else logp)
    steps: list[Step] = []
    if me < 2 * r and me % 2 == 0:
        # Folded out: hand the vector to the odd neighbour, get the result back at the end.
        return _single(
            [Step(0, sends=(Send(me + 1, W, 0, count),)), Step(span - 1, recvs=(Recv(me + 1, W, 0, count),))],
            span,
        )
    if me < 2 * r:
        steps.append(Step(0, recvs=(Recv(me - 1, W, 0, count, reduce=True, first=True),)))
        nr = me // 2
    else:
        nr = me - r

    def real(v: int) -> int:
        return 2 * v + 1 if v < r else v + r

    if not halving:
        for i in range(logp):
            peer = real(nr ^ (1 << i))
            # The half with the bit set puts the other half's values first: rank order on both.
            first = bool(nr & (1 << i))
            steps.append(
                Step(1 + i, (Send(peer, W, 0, count),), (Recv(peer, W, 0, count, reduce=True, first=first),))
            )
    else:
        bounds = split_bounds(count, p)
        lo, hi = 0, p  # the blocks this rank is still responsible for
        history: list[tuple[int, int, int, int]] = []
        for i in range(logp):
            mask = p >> (i + 1)
            peer = real(nr ^ mask)
            mid = (lo + hi) // 2
            if nr & mask:
                keep, give = (mid, hi), (lo, mid)
            else:
                keep, give = (lo, mid), (mid, hi)
            steps.append(
                Step(
                    1 + i,
                    (Send(peer, W, bounds[give[0]], bounds[give[1]]),),
                    (Recv(peer, W, bounds[keep[0]], bounds[keep[1]], reduce=True),),
                )
            )
            history.append((*keep, *give))
            lo, hi = keep
        for j, (k0, k1, g0, g1) in enumerate(reversed(history)):
            mask = p >> (logp - j)
            peer = real(nr ^ mask)
            steps.append(
                Step(
                    1 + logp + j,
                    (Send(peer, W, bounds[k0], bounds[k1]),),
                    (Recv(peer, W, bounds[g0], bounds[g1]),),
                )
            )
    if me < 2 * r:
        steps.append(Step(span - 1, sends=(Send(me - 1, W, 0, count),)))
    return _single(steps, span)


# --------------------------------------------------------------------------------------------
# Binomial trees rooted at ``root`` (relative rank v = (me - root) mod n).


def _tree_broadcast_steps(n: int, me: int, root: int, count: int, id_base: int = 0) -> list[Step]:
    v = (me - root) % n
    steps: list[Step] = []
    for i in range(_log2_ceil(n)):
        mask = 1 << i
        if v < mask and v + mask < n:
            steps.append(Step(id_base + i, sends=(Send((v + mask + root) % n, W, 0, count),)))
        elif mask <= v < 2 * mask:
            steps.append(Step(id_base + i, recvs=(Recv((v - mask + root) % n, W, 0, count),)))
    return steps


def _tree_reduce_steps(n: int, me: int, root: int, count: int, id_base: int = 0) -> list[Step]:
    v = (me - root) % n
    steps: list[Step] = []
    for i in range(_log2_ceil(n)):
        mask = 1 << i
        if v & mask:
            steps.append(Step(id_base + i, sends=(Send((v - mask + root) % n, W, 0, count),)))
            break
        if v + mask < n:
            steps.append(Step(id_base + i, recvs=(Recv((v + mask + root) % n, W, 0, count, reduce=True),)))
    return steps


def _pipelined_tree(
    steps_of: Callable[[int, int, int, int], list[Step]],
    n: int,
    me: int,
    root: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    max_lanes: int,
) -> Schedule:
    """A binomial-tree pattern (``steps_of(n, me, root, chunk_count)``) pipelined over chunks."""
    span = _log2_ceil(n)
    chunk = _chunk_elems(itemsize, chunk_bytes)
    return pipelined(lambda m: _single(steps_of(n, me, root, m), span), count, chunk, max_lanes)


def tree_broadcast_schedule(
    n: int,
    me: int,
    root: int,
    count: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """Binomial-tree broadcast of ``W`` from ``root`` (ceil(log2 n) rounds), pipelined in chunks."""
    return _pipelined_tree(_tree_broadcast_steps, n, me, root, count, itemsize, chunk_bytes, max_lanes)


def tree_reduce_schedule(
    n: int,
    me: int,
    root: int,
    count: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """Binomial-tree reduce of ``W`` to ``root``: each rank reduces its children, then sends up."""
    return _pipelined_tree(_tree_reduce_steps, n, me, root, count, itemsize, chunk_bytes, max_lanes)


def tree_all_reduce_schedule(
    n: int,
    me: int,
    count: int,
    *,
    itemsize: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """All_reduce as a binomial reduce to rank 0 followed by a binomial broadcast from it."""
    half = _log2_ceil(n)

    def base(m: int) -> Schedule:
        return _single(
            _tree_reduce_steps(n, me, 0, m) + _tree_broadcast_steps(n, me, 0, m, id_base=half), 2 * half
        )

    return pipelined(base, count, _chunk_elems(itemsize, chunk_bytes), max_lanes)


# --------------------------------------------------------------------------------------------
# Direct exchanges: one step, everyone talks to everyone it needs to.


def _others(n: int, me: int) -> list[int]:
    """Peers in the order me+1, me+2, ... so that ranks start on different peers."""
    return [(me + k) % n for k in range(1, n)]


def direct_broadcast_schedule(n: int, me: int, root: int, count: int) -> Schedule:
    if me == root:
        others = _others(n, me)
        return _single([Step(0, sends=tuple(Send(p, W, 0, count) for p in others))] if others else [], 1)
    return _single([Step(0, recvs=(Recv(root, W, 0, count),))], 1)


def direct_reduce_schedule(n: int, me: int, root: int, count: int) -> Schedule:
    """Every rank sends to the root, which reduces in rank order after its own values."""
    if me == root:
        peers = sorted(_others(n, me))
        return _single(
            [Step(0, recvs=tuple(Recv(p, W, 0, count, reduce=True) for p in peers))] if peers else [], 1
        )
    return _single([Step(0, sends=(Send(root, W, 0, count),))], 1)


def direct_all_gather_schedule(n: int, me: int, count: int) -> Schedule:
    others = _others(n, me)
    step = Step(
        0,
        sends=tuple(Send(p, ("s", 0), 0, count) for p in others),
        recvs=tuple(Recv(p, ("r", p), 0, count) for p in others),
    )
    return Schedule(((step,),) if others else (), 1, (Copy(("s", 0), 0, ("r", me), 0, count),))


def direct_gather_schedule(n: int, me: int, root: int, count: int) -> Schedule:
    if me == root:
        others = _others(n, me)
        step = Step(0, recvs=tuple(Recv(p, ("r", p), 0, count) for p in others))
        return Schedule(((step,),) if others else (), 1, (Copy(("s", 0), 0, ("r", me), 0, count),))
    return _single([Step(0, sends=(Send(root, ("s", 0), 0, count),))], 1)


def direct_scatter_schedule(n: int, me: int, root: int, count: int) -> Schedule:
    if me == root:
        others = _others(n, me)
        step = Step(0, sends=tuple(Send(p, ("s", p), 0, count) for p in others))
        return Schedule(((step,),) if others else (), 1, (Copy(("s", me), 0, ("r", 0), 0, count),))
    return _single([Step(0, recvs=(Recv(root, ("r", 0), 0, count),))], 1)


def direct_reduce_scatter_schedule(n: int, me: int, count: int) -> Schedule:
    """Each rank sends input j to rank j and reduces what it receives into R[0] (own input first)."""
    others = _others(n, me)
    step = Step(
        0,
        sends=tuple(Send(p, ("s", p), 0, count) for p in others),
        recvs=tuple(Recv(p, ("r", 0), 0, count, reduce=True) for p in sorted(others)),
    )
    return Schedule(((step,),) if others else (), 1, (Copy(("s", me), 0, ("r", 0), 0, count),))


def direct_all_to_all_schedule(
    n: int, me: int, send_counts: Sequence[int], recv_counts: Sequence[int]
) -> Schedule:
    """S[j] goes to rank j, R[j] comes from rank j; sizes may differ per peer."""
    others = _others(n, me)
    step = Step(
        0,
        sends=tuple(Send(p, ("s", p), 0, send_counts[p]) for p in others),
        recvs=tuple(Recv(p, ("r", p), 0, recv_counts[p]) for p in others),
    )
    return Schedule(((step,),) if others else (), 1, (Copy(("s", me), 0, ("r", me), 0, send_counts[me]),))


def dissemination_barrier_schedule(n: int, me: int) -> Schedule:
    """Barrier in ceil(log2 n) rounds: in round i send to me+2^i, hear from me-2^i (empty messages).

    After the last round every rank has heard, directly or through others, from every rank.
    """
    steps = [
        Step(i, (Send((me + (1 << i)) % n, Z, 0, 0),), (Recv((me - (1 << i)) % n, Z, 0, 0),))
        for i in range(_log2_ceil(n))
    ]
    return _single(steps, _log2_ceil(n))
