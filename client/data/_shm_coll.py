"""Collectives that read each other's memory, for groups whose members all share one host: the
operations over a group's region of the members' arenas, as generators that yield what they wait
for, with their direct-read path, their reductions and the signature check of their first step.

Imports foundations (aiocoll._errors, aiocoll._reduce, aiocoll._signature, aiocoll._types,
aiocoll._env) and client.data's _shm_layout, _shm_sched (the region and the running of the
operations, which ShmGroup builds on), _vm_read and _waiting (whether members share cores);
never the public surface. Which region a group takes, and the arena as a provider of the
group's table, are client.data._shm_arena's.

The steps of an operation are client.data._shm_layout's. Large payloads run as many steps as
their slots need, the next step's input written while the peers still read the current one. The
first step of every operation compares every member's signature with ours before any data is
read: a mismatch raises MismatchError on every member.

all_reduce: with two members, and in one step with up to _WHOLE_RANKS members (or up to
_WHOLE_MAX bytes), every member reduces all of the step from every slot straight into its own
buffer (one wait per step). Otherwise each step is a reduce-scatter then an all-gather: I
reduce share ``me`` of the step from every slot into that share of my own slot (no one else
reads it there), publish ``red``, and everyone copies every share from its owner's slot (each
rank reads about two bytes per byte instead of n). Reductions go through aiocoll._reduce (the
one set of kernels), folded in rank order (a rank-order left fold, as numpy's reference does);
a share has one owner, so every member gets the same bits.

An all_reduce, broadcast, all_gather or barrier that fits one step, started while the group is
idle, is run by ShmScheduler._run_step (the same generator, driven as plain calls).

Large broadcast and all_gather (from _BCAST_DIRECT_CHUNKS and _GATHER_DIRECT_CHUNKS or
_GATHER_DIRECT_CHUNKS_OWN_CORE chunks per rank): one step in which every reader copies straight
from the writer's own buffer (client.data._vm_read), where a probe at the group's first step
found that every member can read every other's memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

import aiocoll._signature as _signature
from aiocoll._env import env_text
from aiocoll._errors import DistError, MismatchError, PeerLostError
from aiocoll._reduce import Kernel, finish_avg, kernel, quiet, restore
from aiocoll._types import ReduceOp

from ._op_record import Stoppable
from ._operation import Finish
from ._shm_layout import BASE, BUF, DIRECT, DONE, INP, OWNER, RED, SIG, SIG_BYTES, SLOTS, OnWait, OpGen, Wait
from ._shm_sched import STORES_IN_ORDER, ShmScheduler
from ._vm_read import DIRECT_ENV, vm_read, vm_read_available, vm_read_split
from ._waiting import oversubscribed

__all__ = ["ShmGroup"]

log = logging.getLogger("aiocoll.client.shm")

# An all_reduce that fits one slot is reduced whole by every rank (one wait) with up to this many
# ranks, or up to _WHOLE_MAX bytes; else each rank reduces a share (two waits per step, but each
# rank reads about 2 bytes per byte instead of n). With 4 ranks on 2 cores, 1 MiB took less CPU
# whole (200-560 us per op vs 320-510 us in shares: the extra wait costs more than the reads).
_WHOLE_RANKS = 4
_WHOLE_MAX = 64 * 1024
_FOLD_BLOCK = 256 * 1024  # bytes of the temporary that folds a share into its own input in place
# all_gathers of at least _GATHER_DIRECT_CHUNKS chunks per rank (8 MiB by default), broadcasts of
# at least _BCAST_DIRECT_CHUNKS (32 MiB), copy straight from the writer's buffer (one copy per
# byte, not two through the slots) where the kernel lets members read each other's memory.
# process_vm_readv is slower per byte than a copy within the caches (it pins the peer's pages),
# and a direct step ends with a wait for every reader of my buffer, where the slots let a rank
# go on. An all_gather rank makes both of the slots' copies itself, and its two copies' traffic
# crosses cores (a slot is written on one core and read on the other): where every member has a
# core of its own, one read wins from _GATHER_DIRECT_CHUNKS_OWN_CORE chunks per rank (2 MiB by
# default); where members share cores (and below that, where the kernel happens to put both
# ranks on one core), the wait for a reader that is off the CPU costs more than the copy saved,
# and the read wins only from about 8 MiB. A broadcast's two copies run on two cores at once
# (the root's and the reader's), so only where copies are bound by memory anyway, and the root
# must then wait for its readers.
_GATHER_DIRECT_CHUNKS = 8
_GATHER_DIRECT_CHUNKS_OWN_CORE = 2
_BCAST_DIRECT_CHUNKS = 32


# a closed group's signature rows (_write_sig): no arena behind them
_CLOSED_SIGS = tuple(memoryview(bytearray(SIG_BYTES)) for _ in range(SLOTS))


def _rounds_of(b: np.ndarray, step: int) -> Callable[[int], Callable[[np.ndarray], None]]:
    """The filler of a pipeline that writes ``b`` (bytes) ``step`` bytes a round: ``filler(r)``
    copies round ``r``'s bytes into the front of a slot."""

    def filler(r: int) -> Callable[[np.ndarray], None]:
        part = b[r * step : (r + 1) * step]
        return lambda slot: np.copyto(slot[: part.size], part)

    return filler


class ShmGroup(ShmScheduler):
    """One process group's collectives over the members' arenas (the region and the running of
    the operations are ShmScheduler's; its arguments are the same)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        host = self._host
        self._slots = SLOTS
        self._slot = 4 * self.chunk // self._slots  # bytes of one step's slot
        self._pids = [os.getpid() if r == host.rank else host.peers[r].pid for r in self.ranks]
        self._direct: bool | None = None  # every member reads every other's memory (once known)
        self.step = 0
        self.direct_steps = 0  # steps that read the peers' buffers directly (_direct_step)
        self._view_cache: dict[tuple[int, int, np.dtype[Any]], list[np.ndarray]] = {}
        self._fold_tmp: np.ndarray | None = None
        # the last (op, dtype name) _fold reduced, and its kernel (aiocoll._reduce.kernel)
        self._fold_op: ReduceOp | None = None
        self._fold_dtype = ""
        self._fold_kernel: Kernel = np.add
        self._slot_free = 0  # a step whose slot every member is known to have read (_check)
        # an all_reduce of at most this many bytes runs in one step (_reduce_at_once)
        self._at_once_max = self._slot if self.n <= _WHOLE_RANKS else min(self._slot, _WHOLE_MAX)
        self._fold_more = range(2, self.n)  # the members _fold combines after the first two
        # _fold's order for my own input in place: ranks 0 and 1 fold the rest into it
        self._fold_rest = range(2 if self.me == 1 else 1, self.n)
        # the least bytes per rank that an all_gather, a broadcast reads directly (_go_direct):
        # alike on every member (the group's size, the host's cores)
        gather = _GATHER_DIRECT_CHUNKS if oversubscribed(self.n) else _GATHER_DIRECT_CHUNKS_OWN_CORE
        self._gather_direct = self.chunk * gather
        self._bcast_direct = self.chunk * _BCAST_DIRECT_CHUNKS
        # Each slot's signature: where it is in my row (a view of it there, which _write_sig
        # fills), and where in each peer's arena mapping (_check compares a slice of the
        # mapping, a copy, with ours: one compare of bytes, where comparing a view of them goes
        # element by element).
        self._sig_at = tuple(SIG + s * SIG_BYTES for s in range(SLOTS))
        self._sig_rows = tuple(self._mine_raw[o : o + SIG_BYTES] for o in self._sig_at)
        self._peer_sig_at = tuple(self._base + o for o in self._sig_at)

    # -- operations ------------------------------------------------------------------------
    def all_reduce(
        self,
        x: np.ndarray,
        op: ReduceOp,
        dtype_name: str,
        sig: bytes,
        finish: Finish,
        on_wait: OnWait | None = None,
    ) -> Stoppable:
        """Reduce ``x`` (1-D, contiguous) in place across the group."""
        if x.nbytes <= self._at_once_max and self._straight():
            self.step = t = self.step + 1
            return self._run_step(self._reduce_at_once(x, op, dtype_name, sig, t), t, finish, on_wait)
        return self._submit(self._all_reduce(x, op, dtype_name, sig), finish, on_wait)

    def broadcast(
        self, x: np.ndarray, root: int, sig: bytes, finish: Finish, on_wait: OnWait | None = None
    ) -> Stoppable:
        b = x.view(np.uint8)
        return self._start(b.size <= self._slot, lambda t: self._broadcast(b, root, sig, t), finish, on_wait)

    def all_gather(
        self,
        outs: Sequence[np.ndarray],
        x: np.ndarray,
        sig: bytes,
        finish: Finish,
        on_wait: OnWait | None = None,
    ) -> Stoppable:
        b = x.view(np.uint8)
        outs_b = [o.view(np.uint8) for o in outs]
        # (one step through the slots, unless it may read directly: _all_gather decides that)
        one_step = b.size <= self._slot and (b.size < self._gather_direct or self._direct is False)
        return self._start(one_step, lambda t: self._all_gather(outs_b, b, sig, t), finish, on_wait)

    def reduce_scatter(
        self,
        out: np.ndarray,
        ins: Sequence[np.ndarray],
        op: ReduceOp,
        dtype_name: str,
        sig: bytes,
        finish: Finish,
        on_wait: OnWait | None = None,
    ) -> Stoppable:
        one_step = out.size <= self._scatter_per(out)
        return self._start(
            one_step, lambda t: self._reduce_scatter(out, ins, op, dtype_name, sig, t), finish, on_wait
        )

    def barrier(self, sig: bytes, finish: Finish, on_wait: OnWait | None = None) -> Stoppable:
        return self._start(True, lambda t: self._barrier(sig, t), finish, on_wait)

    def _start(
        self, one_step: bool, make: Callable[[int], OpGen], finish: Finish, on_wait: OnWait | None
    ) -> Stoppable:
        """Run the operation whose generator ``make(t)`` gives: one of a single step, on an idle
        group (``_straight``), as plain calls in step ``t``; any other through the queue
        (``make(0)``: it takes its steps when it begins). all_reduce decides for itself, since
        its queued generator is another one."""
        if one_step and self._straight():
            t = self._steps(1)
            return self._run_step(make(t), t, finish, on_wait)
        return self._submit(make(0), finish, on_wait)

    @staticmethod
    def signature(seq: int, meta: dict[str, Any]) -> bytes:
        """What every member publishes with an operation: its seq and its signature, packed
        (aiocoll._signature.pack)."""
        return _signature.pack(seq, meta)

    # -- the steps -------------------------------------------------------------------------
    def _announce(self, t: int, sig: bytes | None, fill: Callable[[np.ndarray], None] | None) -> OpGen:
        """Write my part of step ``t`` once my slot is free, then publish it."""
        if t != self._slot_free and t > self._slots:
            yield (DONE, t - self._slots, self.others)
        s = t % self._slots
        if fill is not None:
            fill(self._data[self.me][s * self._slot : (s + 1) * self._slot])
        if sig is not None:
            self._write_sig(s, sig)
        self._publish(INP, t)

    def _write_sig(self, slot: int, sig: bytes) -> None:
        self._sig_rows[slot][: len(sig)] = sig

    def _views(self, base: int, nbytes: int, dtype: np.dtype[Any]) -> list[np.ndarray]:
        """``nbytes`` at ``base`` of every member's data as ``dtype``: made once per size (a
        training loop repeats a few sizes; slicing and viewing cost more than a small
        reduction)."""
        key = (base, nbytes, dtype)
        got = self._view_cache.get(key)
        if got is None:
            if len(self._view_cache) >= 64:
                self._view_cache.clear()
            got = self._view_cache[key] = [d[base : base + nbytes].view(dtype) for d in self._data]
        return got

    def _steps(self, count: int) -> int:
        t0 = self.step + 1
        self.step += count
        return t0

    def _all_reduce(self, x: np.ndarray, op: ReduceOp, dtype_name: str, sig: bytes) -> OpGen:
        if x.nbytes <= self._at_once_max:
            return (yield from self._reduce_at_once(x, op, dtype_name, sig, self._steps(1)))
        b = x.view(np.uint8)
        isz = x.itemsize
        per = self._slot // isz  # elements per step
        total = x.size
        rounds = max(1, -(-total // per))
        n = self.n
        if n <= 2:
            # Every rank reduces every byte of each step straight into its own buffer: one wait
            # per step. Two ranks read as much as in a reduce-scatter and write less (no shares
            # to publish and copy out); with more ranks this reads n times what it writes.
            whole = self._reduce_whole(x, b, per, op, dtype_name)
            return (yield from self._pipeline(rounds, sig, *whole))
        t0 = self._steps(rounds)
        me = self.me

        filler = _rounds_of(b, per * isz)

        # Reduce-scatter then all-gather in each step: I reduce share ``me`` of the step from
        # every member's slot into that share of my own slot (no one else reads it there),
        # then everyone copies every share out of its owner's slot.
        self._inner = True
        yield from self._announce(t0, sig, filler(0))
        for r in range(rounds):
            t = t0 + r
            lo, hi = r * per, min(total, (r + 1) * per)
            length = hi - lo
            cuts = [length * j // n * isz for j in range(n + 1)]
            base = (t % self._slots) * self._slot
            yield (INP, t, self.others)
            if r == 0:
                self._check(t, sig)
            a, z = base + cuts[me], base + cuts[me + 1]
            self._fold_share([d[a:z].view(x.dtype) for d in self._data], op, dtype_name)
            self._publish(RED, t)
            if r + 1 < rounds:
                yield from self._announce(t + 1, None, filler(r + 1))
            yield (RED, t, self.others)
            out = b[lo * isz : hi * isz]
            for j, d in enumerate(self._data):
                np.copyto(out[cuts[j] : cuts[j + 1]], d[base + cuts[j] : base + cuts[j + 1]])
            self._publish(DONE, t)
        return None

    def _reduce_at_once(self, x: np.ndarray, op: ReduceOp, dtype_name: str, sig: bytes, t: int) -> OpGen:
        """An all_reduce in one step, step ``t``: everyone writes everything, everyone reduces
        everything."""
        s = t % SLOTS
        if t != self._slot_free and t > SLOTS:  # (in a loop of them, t is the slot known free)
            yield (DONE, t - SLOTS, self.others)
        views = self._views(s * self._slot, x.nbytes, x.dtype)
        views[self.me][...] = x
        self._write_sig(s, sig)
        if not self._publish(INP, t):
            yield (INP, t, self.others)
        self._check(t, sig)
        self._fold(x, views, op, dtype_name)
        # ``done`` of t, the only step of its operation: no member waits for it before it has
        # seen our ``inp`` of a later step (each waits for ``done`` of a step only for a slot
        # two steps on, or for the step of its own direct read, never of one slot-sized step,
        # so only once it finished the step between, which took our ``inp`` of it). That later
        # ``inp`` is published after this store, with the fence and the wake-up, so where stores
        # are seen in the order they were made (x86) this one needs neither. (A mismatch
        # publishes ``done`` in full: the others may wait for it before they fail.)
        if STORES_IN_ORDER:
            self._mine[DONE] = t
        else:
            self._publish(DONE, t)
        return None

    def _reduce_whole(
        self, x: np.ndarray, b: np.ndarray, per: int, op: ReduceOp, dtype_name: str
    ) -> tuple[Callable[[int], Callable[[np.ndarray], None]], Callable[[int, int], None]]:
        """(filler, consume) of an all_reduce where every member reduces all of every step."""
        isz, total = x.itemsize, x.size

        def consume(r: int, base: int) -> None:
            lo, hi = r * per, min(total, (r + 1) * per)
            views = self._views(base, (hi - lo) * isz, x.dtype)
            self._fold(x[lo:hi], views, op, dtype_name)

        return _rounds_of(b, per * isz), consume

    def _pipeline(
        self,
        rounds: int,
        sig: bytes,
        filler: Callable[[int], Callable[[np.ndarray], None] | None],
        consume: Callable[[int, int], None],
        t0: int = 0,
    ) -> OpGen:
        """Steps where everyone writes, then reads the others' slots: ``filler(r)`` writes my
        part of round ``r`` into my slot; ``consume(r, base)`` reads round ``r``'s slots (at
        offset ``base`` of every member's data) once all are written. Round r+1 is written
        before round r is read, so a fast rank runs a step ahead. ``t0``: the first step, when
        the caller took it (one round run as plain calls, ShmScheduler._run_step)."""
        if not t0:
            t0 = self._steps(rounds)
        self._inner = rounds > 1
        yield from self._announce(t0, sig, filler(0))
        for r in range(rounds):
            t = t0 + r
            yield (INP, t, self.others)
            if r == 0:
                self._check(t, sig)
            if r + 1 < rounds:
                yield from self._announce(t + 1, None, filler(r + 1))
            consume(r, (t % self._slots) * self._slot)
            self._publish(DONE, t)
        return None

    def _broadcast(self, b: np.ndarray, root: int, sig: bytes, t0: int = 0) -> OpGen:
        chunk, total = self._slot, b.size
        if not t0 and (yield from self._go_direct(total, self._bcast_direct)):
            reads = [(root, b)] if self.me != root else []
            return (yield from self._direct_step(b, sig, reads, self.n - 1))
        is_root = self.me == root
        root_filler = _rounds_of(b, chunk)

        def filler(r: int) -> Callable[[np.ndarray], None] | None:
            return root_filler(r) if is_root else None

        def consume(r: int, base: int) -> None:
            if not is_root:
                lo, hi = r * chunk, min(total, (r + 1) * chunk)
                np.copyto(b[lo:hi], self._data[root][base : base + hi - lo])

        return (yield from self._pipeline(max(1, -(-total // chunk)), sig, filler, consume, t0))

    def _all_gather(self, outs: list[np.ndarray], b: np.ndarray, sig: bytes, t0: int = 0) -> OpGen:
        chunk, total, me = self._slot, b.size, self.me
        if not t0 and (yield from self._go_direct(total, self._gather_direct)):
            return (yield from self._direct_step(b, sig, list(enumerate(outs)), self.n))

        filler = _rounds_of(b, chunk)

        def consume(r: int, base: int) -> None:
            lo, hi = r * chunk, min(total, (r + 1) * chunk)
            for j, d in enumerate(self._data):
                np.copyto(outs[j][lo:hi], b[lo:hi] if j == me else d[base : base + hi - lo])

        return (yield from self._pipeline(max(1, -(-total // chunk)), sig, filler, consume, t0))

    def _reduce_scatter(
        self,
        out: np.ndarray,
        ins: Sequence[np.ndarray],
        op: ReduceOp,
        dtype_name: str,
        sig: bytes,
        t0: int = 0,
    ) -> OpGen:
        isz, total = out.itemsize, out.size
        per = self._scatter_per(out)
        ins_b = [a.view(np.uint8) for a in ins]

        def filler(r: int) -> Callable[[np.ndarray], None]:
            lo, hi = r * per * isz, min(total, (r + 1) * per) * isz

            def fill(slot: np.ndarray) -> None:
                for j, a in enumerate(ins_b):
                    np.copyto(slot[j * per * isz : j * per * isz + hi - lo], a[lo:hi])

            return fill

        def consume(r: int, base: int) -> None:
            lo, hi = r * per, min(total, (r + 1) * per)
            a = base + self.me * per * isz
            srcs = [d[a : a + (hi - lo) * isz].view(out.dtype) for d in self._data]
            self._fold(out[lo:hi], srcs, op, dtype_name, copy=True)

        return self._pipeline(max(1, -(-total // per)), sig, filler, consume, t0)

    def _scatter_per(self, out: np.ndarray) -> int:
        """A reduce_scatter's elements of each part per step (into ``out``)."""
        return max(1, self._slot // (self.n * out.itemsize))

    # -- single copy: readers copy straight from the writer's buffer -----------------------
    def _go_direct(self, nbytes: int, least: int) -> Generator[Wait, None, bool]:
        """Whether this operation reads the peers' buffers directly (client.data._vm_read), decided
        alike on every member: for payloads of at least ``least`` bytes, once every member's
        probe verdict (written at the group's first step, before its ``done`` of that step)
        says it can read every other member; until then, and where any member cannot (a
        container's seccomp filter, no ptrace access), through the slots. The payload size is
        the same on every member unless the signatures differ, which the first step reports
        before anything is read either way."""
        t0 = self.step + 1
        if nbytes < least or t0 <= SLOTS or self._direct is False:
            return False
        if self._direct is None:
            yield (DONE, t0 - SLOTS, self.others)  # (the slot path's first wait too)
            verdicts = [self._ctl[j][DIRECT] for j in range(self.n)]
            self._direct = all(v == 1 for v in verdicts)
        return self._direct

    def _probe_direct(self) -> None:
        """At the group's first step (every member's region is set up): can I read every
        member's memory directly? Read each one's ``group`` mark through the kernel and compare
        it with the mark seen in shared memory (a wrong process, e.g. a pid of another pid
        namespace, fails this), then publish the verdict."""
        ok = env_text(DIRECT_ENV) != "0" and vm_read_available()
        probe = np.zeros(1, np.int64)
        for j in self.others if ok else ():
            try:
                vm_read(self._pids[j], probe.ctypes.data, self._ctl[j][BASE] + 8 * OWNER, 8)
            except OSError as exc:
                log.debug(
                    "rank %d: direct reads from rank %d refused (%s)", self.ranks[self.me], self.ranks[j], exc
                )
                ok = False
                break
            ok = int(probe[0]) == self._owner
        self._ctl[self.me][DIRECT] = 1 if ok else 2

    def _direct_step(
        self, mine: np.ndarray, sig: bytes, reads: list[tuple[int, np.ndarray]], readers: int
    ) -> OpGen:
        """One step: publish where ``mine`` is, once the signatures match read member j's
        buffer into ``out`` for every (j, out) of ``reads`` (mine copied for j = me), then wait
        until every member has read mine (the caller may change it once the operation ends).
        ``readers`` members read at the same time: where the cores allow, each read is split
        between two threads (client.data._vm_read.vm_read_split)."""
        t = self._steps(1)
        s = t % SLOTS
        self._inner = True
        self.direct_steps += 1
        src = mine if mine.flags.c_contiguous else np.ascontiguousarray(mine)
        ctl = self._ctl[self.me]
        ctl[BUF + 2 * s] = src.ctypes.data
        ctl[BUF + 2 * s + 1] = src.nbytes
        self._write_sig(s, sig)
        self._publish(INP, t)
        yield (INP, t, self.others)
        self._check(t, sig)
        for j, out in reads:
            if j == self.me:
                np.copyto(out, mine)
                continue
            dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
            addr, nbytes = self._ctl[j][BUF + 2 * s], self._ctl[j][BUF + 2 * s + 1]
            if nbytes != dst.nbytes:  # (the signatures matched: sizes agree)
                raise DistError(f"rank {self.ranks[j]} published {nbytes} bytes, expected {dst.nbytes}")
            try:
                vm_read_split(self._pids[j], dst.ctypes.data, addr, nbytes, readers)
            except OSError as exc:
                self._publish(DONE, t)
                # Gone, or it gave the operation up on losing another member and went on (its
                # buffer freed, its process ended): then that member is the news.
                first = self._lost_first_by(j)
                if first is not None:
                    why = f"rank {self.ranks[j]} lost it first (its memory could not be read: {exc})"
                    raise PeerLostError(first, why) from exc
                raise PeerLostError(self.ranks[j], f"its memory could not be read ({exc})") from exc
            if dst is not out:
                np.copyto(out, dst)
        self._publish(DONE, t)
        yield (DONE, t, self.others)
        return None

    def _barrier(self, sig: bytes, t: int = 0) -> OpGen:
        if not t:
            t = self._steps(1)
        yield from self._announce(t, sig, None)
        yield (INP, t, self.others)
        self._check(t, sig)
        self._publish(DONE, t)
        return None

    def _fold(
        self, dst: np.ndarray, srcs: list[np.ndarray], op: ReduceOp, dtype_name: str, *, copy: bool = False
    ) -> None:
        """dst = srcs[0] op srcs[1] op ... in rank order (AVG divided at the end). ``dst`` holds
        my own input already unless ``copy``. Overflow gives inf and invalid operations nan, as
        in torch and the driver's Buffers: no floating-point warnings (aiocoll._reduce.quiet)."""
        # (k(a, b, out=dst): dst = a op b) A training loop reduces one op and dtype over and
        # over: the kernel of the last pair is kept here, where finding it (a call of kernel,
        # its key and table) costs about as much as the fold of a small message.
        if op is self._fold_op and dtype_name == self._fold_dtype:
            k = self._fold_kernel
        else:
            k = kernel(op, dtype_name)  # (raises for a meaningless pair: then nothing is kept)
            self._fold_op, self._fold_dtype, self._fold_kernel = op, dtype_name, k
        token = quiet()
        try:
            # In place (my input is dst: one stream less to read), except for one element, where
            # numpy's in-place kernel costs twice the one into another array: then my input is
            # read from srcs[me], as for a rank past 1 (dst's first value is needed after the
            # first combination) or a copy.
            if dst.size == 1 or copy or self.me > 1:
                if self.n == 1:
                    np.copyto(dst, srcs[0])
                else:
                    k(srcs[0], srcs[1], out=dst)
                    for j in self._fold_more:
                        k(dst, srcs[j], out=dst)
            else:
                if self.me == 1:  # dst holds srcs[1]: dst = srcs[0] op dst
                    k(srcs[0], dst, out=dst)
                for j in self._fold_rest:
                    k(dst, srcs[j], out=dst)
            if op is ReduceOp.AVG:
                finish_avg(dst, self.n, dtype_name)
        finally:
            restore(token)

    def _fold_share(self, srcs: list[np.ndarray], op: ReduceOp, dtype_name: str) -> None:
        """srcs[me] = srcs[0] op srcs[1] op ... in rank order, in place (my share of a step, in
        my own slot). Ranks 0 and 1 fold straight into it; a higher rank's own input is needed
        after the first combination, so it folds block by block through a small temporary."""
        me = self.me
        dst = srcs[me]
        if me <= 1:
            self._fold(dst, srcs, op, dtype_name)
            return
        token = quiet()
        try:
            self._fold_blocks(dst, srcs, op, dtype_name)
        finally:
            restore(token)

    def _fold_blocks(self, dst: np.ndarray, srcs: list[np.ndarray], op: ReduceOp, dtype_name: str) -> None:
        """_fold_share's fold of a higher rank's share, block by block through a temporary."""
        if self._fold_tmp is None:
            self._fold_tmp = np.empty(_FOLD_BLOCK, np.uint8)
        k = kernel(op, dtype_name)
        step = _FOLD_BLOCK // dst.itemsize
        tmp_all = self._fold_tmp.view(dst.dtype)
        for lo in range(0, dst.size, step):
            hi = min(dst.size, lo + step)
            tmp = tmp_all[: hi - lo]
            k(srcs[0][lo:hi], srcs[1][lo:hi], out=tmp)
            for j in range(2, self.n):
                k(tmp, srcs[j][lo:hi], out=tmp)
            np.copyto(dst[lo:hi], tmp)
        if op is ReduceOp.AVG:
            finish_avg(dst, self.n, dtype_name)

    # -- signatures ------------------------------------------------------------------------
    def _check(self, t: int, sig: bytes) -> None:
        """Compare every member's signature of the operation whose first step is ``t`` with
        ours, once every member's ``inp`` of ``t`` is seen."""
        # Every member wrote the operation's first step, so had ended every operation before it
        # (each publishes ``done`` of all its steps before it ends): step t + 1's slot, that of
        # an earlier step, is free, and its writer need not wait for it (_announce).
        self._slot_free = t + 1
        if t == 1:
            self._probe_direct()
        o = self._peer_sig_at[t % SLOTS]
        end = o + len(sig)
        for mem in self._peer_mems:
            if mem[o:end] != sig:
                self._publish(DONE, t)  # let the others read on to their own verdict
                raise self._mismatch(self._sig_at[t % SLOTS], sig)

    def _mismatch(self, o: int, mine: bytes) -> MismatchError:
        """Every member's call at this point (we hold all their signatures), in the one wording
        of a mismatch (aiocoll._signature)."""
        mine_meta = _signature.unpack(mine)
        metas = {
            self.ranks[j]: _signature.unpack(bytes(self._raw[j][o : o + SIG_BYTES])) for j in self.others
        }
        metas[self.ranks[self.me]] = mine_meta
        return _signature.mismatch(self._gid, int(mine_meta["seq"]), metas, mine_meta)

    def close(self) -> None:
        """Fail what is queued and give the region back (the next group to take it marks it as
        its own). Twice is fine."""
        self._view_cache.clear()
        if self._sig_rows is not _CLOSED_SIGS:  # (views of the arena: its mapping closes once they go)
            for v in self._sig_rows:
                v.release()
            self._sig_rows = _CLOSED_SIGS
        super().close()
