"""Collectives that read each other's memory, for groups whose members all share one host.

Imports foundations (aiocoll._errors, aiocoll._reduce, aiocoll._types) and client.data._shm; never
the public surface. The arenas and their exchange are client.data._shm's; this module holds what
runs over them: one region per group in every member's arena, the operations as generators
that yield what they wait for, and the driver that waits (spin, then sleep on the eventfd).
Which region a group takes, and the arena as a provider of the group's table, are
client.data._shm_arena's.

A group's region in each member's arena (cache lines apart, so writers do not share them):

    0     sleeping   1 while the owner sleeps on its eventfd (publishers then wake it)
    64    inp        last step whose input (and signature) the owner has written
    128   red        last step whose share the owner has reduced (in place, in its slot)
    192   done       last step whose data the owner has finished reading (its slots are free)
    256   cpu        1 + the CPU the owner ran on when it last began to wait (0: unknown)
    768   group      which group owns the region now (a hash of its id): a region is reused by
                     later groups, and counters are trusted only next to the right owner
    832   lost       1 + the rank whose loss failed the owner's group
    1024  sig[2]     per slot: the operation's seq and signature (kind, root, dtype, count, op)
    4096  data       two slots of ``2 * chunk`` bytes (step t uses slot t % 2)

Every operation is a sequence of steps, numbered alike on every member (the group runs its
operations in call order). A step: wait until every member finished reading the slot two steps
back (``done``), write my part into my slot, publish ``inp``; wait for everyone's ``inp``; read
the others' slots directly; publish ``done``. Large payloads run as many steps as their slots
need, the next step's input written while the peers still read the current one. The first step
of every operation compares every member's signature with ours before any data is read: a
mismatch raises MismatchError on every member.

all_reduce: with two members, and in one step with up to _WHOLE_RANKS members (or up to
_WHOLE_MAX bytes), every member reduces all of the step from every slot straight into its own
buffer (one wait per step). Otherwise each step is a reduce-scatter then an all-gather: I
reduce share ``me`` of the step from every slot into that share of my own slot (no one else
reads it there), publish ``red``, and everyone copies every share from its owner's slot (each
rank reads about two bytes per byte instead of n). Reductions go through aiocoll._reduce (the
one set of kernels), folded in rank order (a rank-order left fold, as numpy's reference does);
a share has one owner, so every member gets the same bits.

Large broadcast and all_gather (_BCAST/_GATHER_DIRECT_CHUNKS chunks per rank): one step in which every
reader copies straight from the writer's own buffer (client.data._vm_read), where a probe at the
group's first step found that every member can read every other's memory.

Waiting: for a small operation, the owner spins for a bounded time (yielding the CPU at every
check, so a waiting rank does not starve the one it waits for when they share a core), then
sets ``sleeping``, re-checks, and returns to the event loop, which watches the eventfd; a
publisher writes to the eventfd of every peer that sleeps. Between the steps of a large
operation it spins without yielding while the host has a core for every runnable task; when
it does not, it yields at each check (a peer rank may be queued on our core), or, once a yield
came back late (busy processes beside the job), naps on the eventfd in place (``_wait_step``). The
flag write and the check (and the counter write and the flag read) are separated by a full
memory barrier (``_shm.fence``), so a wake-up cannot be lost; a slow timer re-checks anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

import numpy as np

import aiocoll._signature as _signature
from aiocoll._env import env_float, env_text
from aiocoll._errors import DistError, MismatchError, PeerLostError
from aiocoll._reduce import combine, finish_avg, reduce_into
from aiocoll._types import ReduceOp

from ._operation import Finish
from ._shm import ARENA_HEADER, REGION_CONTROL, ShmHost, current_cpu, fence, region_bytes
from ._vm_read import vm_read, vm_read_available
from ._waiting import LATE_YIELD_S, SpinBudget, host_contended, nap, oversubscribed, spin

__all__ = ["ShmGroup", "ShmWaker", "region_bytes"]

log = logging.getLogger("aiocoll.client.shm")

# counters, as indexes into the region's int64 view
_SLEEP, _INP, _RED, _DONE, _CPU = 0, 8, 16, 24, 32
_SIG = 1024  # bytes (the counters above are int64 indexes)
_OWNER = 96  # (byte 768)
_LOST = 104  # (byte 832) 1 + the rank whose loss failed this member's group, 0 while none
_BASE = 112  # (byte 896) where this region sits in the owner's address space (the probe reads it)
_DIRECT = 113  # (byte 904) 1: the owner can read every member's memory directly, 2: it cannot
_BUF = 120  # (byte 960) per slot: address and size of the owner's buffer, for direct reads
_SIG_BYTES = _signature.PACKED_BYTES
_DATA = REGION_CONTROL
_SLOTS = 2  # steps in flight: the region's data holds this many slots (signatures: one each)
_RECHECK_S = 0.2  # a sleeping operation re-checks this often even without a wake-up
_PLAIN_SPIN_S = 10e-6  # of a spin, checks without yielding the CPU first
# Between the steps of a large operation the peers are a copy away: sleeping there hands the
# core to the scheduler and costs a wake-up latency per step (milliseconds on a busy machine).
_INNER_SPIN_S = 1e-3
# An all_reduce that fits one slot is reduced whole by every rank (one wait) with up to this many
# ranks, or up to _WHOLE_MAX bytes; else each rank reduces a share (two waits per step, but each
# rank reads about 2 bytes per byte instead of n). With 4 ranks on 2 cores, 1 MiB took less CPU
# whole (200-560 us per op vs 320-510 us in shares: the extra wait costs more than the reads).
_WHOLE_RANKS = 4
_WHOLE_MAX = 64 * 1024
_FOLD_BLOCK = 256 * 1024  # bytes of the temporary that folds a share into its own input in place
# A wait between steps first spins this long without yielding or napping (peers on other cores):
# napping at once on a busy host cost a sleep and a wake-up per short wait (a 1 MiB all_gather of
# 2 ranks went from 59 to 290 us).
_STEP_PLAIN_S = 50e-6
_HANDOFFS = 8  # of a spin's yields, at most this many are not charged to its budget (_spin)
_NAP_FOR_S = 0.1  # after a late yield, waits between steps nap rather than yield for this long
_CONTENTION_EVERY_S = 50e-6  # a spin between steps re-reads the host's runnable count this often
# all_gathers of at least _GATHER_DIRECT_CHUNKS chunks per rank (8 MiB by default), broadcasts of
# at least _BCAST_DIRECT_CHUNKS (32 MiB), copy straight from the writer's buffer (one copy per
# byte, not two through the slots) where the kernel lets members read each other's memory.
# process_vm_readv ran at 10-12 GB/s here up to 8 MiB (it pins the peer's pages) against 20-55
# GB/s for a copy within the caches, 16.6 GB/s at 32 MiB against 18.6 for a copy. An all_gather
# rank makes both of the slots' copies itself, so one read wins from about 8 MiB; a broadcast's
# two copies run on two cores at once (the root's and the reader's), so only where copies are
# bound by memory anyway, and the root must then wait for its readers.
_GATHER_DIRECT_CHUNKS = 8
_BCAST_DIRECT_CHUNKS = 32
DIRECT_ENV = "AIOCOLL_SHM_DIRECT"  # "0": never read peers' memory directly (always the slots)
_INLINE_S = 0.002  # at most this long of operations completing inside their calls between loop turns


Wait = tuple[int, int, tuple[int, ...]]  # (counter, step, members): wait until all reach it
OpGen = Generator[Wait, None, Any]
OnWait = Callable[[list[int]], None]


def _rounds_of(b: np.ndarray, step: int) -> Callable[[int], Callable[[np.ndarray], None]]:
    """The filler of a pipeline that writes ``b`` (bytes) ``step`` bytes a round: ``filler(r)``
    copies round ``r``'s bytes into the front of a slot."""

    def filler(r: int) -> Callable[[np.ndarray], None]:
        part = b[r * step : (r + 1) * step]
        return lambda slot: np.copyto(slot[: part.size], part)

    return filler


class _ShmOp:
    __slots__ = ("finish", "gen", "group", "mark", "on_wait", "wait")

    def __init__(self, group: ShmGroup, gen: OpGen, finish: Finish, on_wait: OnWait | None) -> None:
        self.group = group
        self.gen = gen
        self.finish = finish
        self.on_wait = on_wait  # told whom the operation waits for when it goes to sleep
        self.wait: Wait | None = None
        # my counters (inp, red, done) when it began: what stopping it midway puts back
        self.mark: tuple[int, int, int] | None = None

    def stop(self) -> None:
        """The engine failed this operation (deadline, closing): the group is out of step."""
        self.group._stop(self)


class ShmWaker:
    """Watches this process's eventfd and resumes the groups sleeping on it."""

    def __init__(self, host: ShmHost) -> None:
        self._efd = host.efd
        self._loop = asyncio.get_running_loop()
        self.sleeping: set[ShmGroup] = set()
        self._loop.add_reader(self._efd, self._on_wake)
        self.wakeups = 0

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._efd)
        self.wakeups += 1
        self.resume()

    def resume(self) -> None:
        for group in list(self.sleeping):
            group._wake()

    def close(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._efd)


class ShmGroup:
    """One process group's collectives over the members' arenas.

    Every member must create its ShmGroup (which clears its own region) before any member starts
    an operation in it; the group's creation is itself collective, which orders that.

    Args:
        host: this process's ShmHost, connected to every other member.
        waker: the host's ShmWaker. region: the group's region index (the same on every member).
        ranks: members' global ranks, by group rank. me: my group rank.
        chunk: bytes per step (the same on every member). ranks_on_host: processes on this host
            that may spin at once (decides whether waiting yields the CPU).
        spin_s: how long to spin before sleeping.
    """

    def __init__(
        self,
        host: ShmHost,
        waker: ShmWaker,
        region: int,
        ranks: Sequence[int] | range,
        me: int,
        *,
        chunk: int,
        ranks_on_host: int,
        gid: str = "",
        spin_s: float | None = None,
    ) -> None:
        if not 0 <= region < host.regions or region_bytes(chunk) != host.region_bytes:
            raise ValueError(f"region {region} of {chunk}-byte chunks does not fit this host's arena")
        if region in host.regions_used:
            raise ValueError(f"region {region} is in use by another group")
        host.regions_used.add(region)
        self._host = host
        self.region = region
        self.ranks = tuple(ranks)
        self.n = len(self.ranks)
        self.me = me
        self.chunk = chunk
        self._slots = _SLOTS
        self._slot = 4 * chunk // self._slots  # bytes of one step's slot
        self._waker = waker
        self._loop = asyncio.get_running_loop()
        base = ARENA_HEADER + region * host.region_bytes
        mems = [host.mem if r == host.rank else host.peers[r].mem for r in self.ranks]
        self._raw = [memoryview(m)[base : base + _DATA] for m in mems]
        self._ctl = [v.cast("q") for v in self._raw]
        self._data = [np.frombuffer(m, np.uint8, count=4 * chunk, offset=base + _DATA) for m in mems]
        self._efds = [-1 if r == host.rank else host.peers[r].efd for r in self.ranks]
        # Take the region: counters at zero first, then our group's mark. A member reads a
        # peer's counters only next to the mark of this group (stale counters of an earlier
        # group in that region, or of a later one, are never taken for ours).
        self._owner = (
            int.from_bytes(hashlib.blake2b(gid.encode(), digest_size=8).digest(), "little") >> 1 or 1
        )
        self._raw[me][:] = bytes(_DATA)
        self._ctl[me][_BASE] = np.frombuffer(self._raw[me], np.uint8).ctypes.data
        fence()
        self._ctl[me][_OWNER] = self._owner
        self._pids = [os.getpid() if r == host.rank else host.peers[r].pid for r in self.ranks]
        self._direct: bool | None = None  # every member reads every other's memory (once known)
        self.others = tuple(j for j in range(self.n) if j != me)
        self.step = 0
        self.queue: deque[_ShmOp] = deque()
        self.broken: BaseException | None = None
        # More ranks than cores: a waiting rank's spin holds a core a peer needs, so keep it short.
        shared = oversubscribed(ranks_on_host)
        self._oversubscribed = shared
        self._step_plain_s = _PLAIN_SPIN_S if shared else _STEP_PLAIN_S
        if spin_s is None:
            spin_us = env_float("AIOCOLL_SHM_SPIN_US")
            spin_s = (spin_us if spin_us is not None else 20.0 if shared else 100.0) * 1e-6
        self._budget = SpinBudget(spin_s)
        self._inline_since: float | None = None
        self._inner = False  # inside a multi-step operation: its waits are short, spin longer
        self._timer: asyncio.TimerHandle | None = None
        self._gid = gid
        self.sleeps = 0
        self.naps = 0  # blocks on the eventfd inside a wait between steps (_nap)
        self.beside = 0  # waits that found the awaited peer queued on our core (_beside)
        self._nap_until = 0.0  # (perf_counter) waits between steps nap until then (_wait_step)
        self.direct_steps = 0  # steps that read the peers' buffers directly (_direct_step)
        self.completed = 0  # operations finished here (diagnostics: the bench names the path)
        self._view_cache: dict[tuple[int, int, np.dtype[Any]], tuple[np.ndarray, list[np.ndarray]]] = {}
        self._fold_tmp: np.ndarray | None = None

    # -- operations ------------------------------------------------------------------------
    def all_reduce(
        self,
        x: np.ndarray,
        op: ReduceOp,
        dtype_name: str,
        sig: bytes,
        finish: Finish,
        on_wait: OnWait | None = None,
    ) -> _ShmOp:
        """Reduce ``x`` (1-D, contiguous) in place across the group."""
        return self._submit(self._all_reduce(x, op, dtype_name, sig), finish, on_wait)

    def broadcast(
        self, x: np.ndarray, root: int, sig: bytes, finish: Finish, on_wait: OnWait | None = None
    ) -> _ShmOp:
        return self._submit(self._broadcast(x.view(np.uint8), root, sig), finish, on_wait)

    def all_gather(
        self,
        outs: Sequence[np.ndarray],
        x: np.ndarray,
        sig: bytes,
        finish: Finish,
        on_wait: OnWait | None = None,
    ) -> _ShmOp:
        gen = self._all_gather([o.view(np.uint8) for o in outs], x.view(np.uint8), sig)
        return self._submit(gen, finish, on_wait)

    def reduce_scatter(
        self,
        out: np.ndarray,
        ins: Sequence[np.ndarray],
        op: ReduceOp,
        dtype_name: str,
        sig: bytes,
        finish: Finish,
        on_wait: OnWait | None = None,
    ) -> _ShmOp:
        return self._submit(self._reduce_scatter(out, list(ins), op, dtype_name, sig), finish, on_wait)

    def barrier(self, sig: bytes, finish: Finish, on_wait: OnWait | None = None) -> _ShmOp:
        return self._submit(self._barrier(sig), finish, on_wait)

    @staticmethod
    def signature(seq: int, meta: dict[str, Any]) -> bytes:
        """What every member publishes with an operation: its seq and its signature, packed
        (aiocoll._signature.pack)."""
        return _signature.pack(seq, meta)

    # -- the steps -------------------------------------------------------------------------
    def _announce(self, t: int, sig: bytes | None, fill: Callable[[np.ndarray], None] | None) -> OpGen:
        """Write my part of step ``t`` once my slot is free, then publish it."""
        if t > self._slots:
            yield (_DONE, t - self._slots, self.others)
        s = t % self._slots
        if fill is not None:
            fill(self._data[self.me][s * self._slot : (s + 1) * self._slot])
        if sig is not None:
            self._write_sig(s, sig)
        self._publish(_INP, t)

    def _write_sig(self, slot: int, sig: bytes) -> None:
        o = _SIG + slot * _SIG_BYTES
        self._raw[self.me][o : o + len(sig)] = sig

    def _views(self, base: int, nbytes: int, dtype: np.dtype[Any]) -> tuple[np.ndarray, list[np.ndarray]]:
        """(``nbytes`` at ``base`` of my data as bytes, every member's as ``dtype``): made once per
        size (a training loop repeats a few sizes; slicing and viewing cost more than a small
        reduction)."""
        key = (base, nbytes, dtype)
        got = self._view_cache.get(key)
        if got is None:
            views = [d[base : base + nbytes].view(dtype) for d in self._data]
            if len(self._view_cache) >= 64:
                self._view_cache.clear()
            got = self._view_cache[key] = (self._data[self.me][base : base + nbytes], views)
        return got

    def _steps(self, count: int) -> int:
        t0 = self.step + 1
        self.step += count
        return t0

    def _all_reduce(self, x: np.ndarray, op: ReduceOp, dtype_name: str, sig: bytes) -> OpGen:
        b = x.view(np.uint8)
        isz = x.itemsize
        per = self._slot // isz  # elements per step
        total = x.size
        rounds = max(1, -(-total // per))
        n = self.n
        if rounds == 1 and (n <= _WHOLE_RANKS or b.size <= _WHOLE_MAX):
            # one shot: everyone writes everything, everyone reduces everything
            t0 = self._steps(1)
            if t0 > self._slots:
                yield (_DONE, t0 - self._slots, self.others)
            base = (t0 % self._slots) * self._slot
            mine, views = self._views(base, b.size, x.dtype)
            np.copyto(mine, b)
            self._write_sig(t0 % self._slots, sig)
            self._publish(_INP, t0)
            yield (_INP, t0, self.others)
            self._check(t0, sig)
            self._fold(x, views, op, dtype_name)
            self._publish(_DONE, t0)
            return None
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
            yield (_INP, t, self.others)
            if r == 0:
                self._check(t, sig)
            a, z = base + cuts[me], base + cuts[me + 1]
            self._fold_share([d[a:z].view(x.dtype) for d in self._data], op, dtype_name)
            self._publish(_RED, t)
            if r + 1 < rounds:
                yield from self._announce(t + 1, None, filler(r + 1))
            yield (_RED, t, self.others)
            out = b[lo * isz : hi * isz]
            for j, d in enumerate(self._data):
                np.copyto(out[cuts[j] : cuts[j + 1]], d[base + cuts[j] : base + cuts[j + 1]])
            self._publish(_DONE, t)
        return None

    def _reduce_whole(
        self, x: np.ndarray, b: np.ndarray, per: int, op: ReduceOp, dtype_name: str
    ) -> tuple[Callable[[int], Callable[[np.ndarray], None]], Callable[[int, int], None]]:
        """(filler, consume) of an all_reduce where every member reduces all of every step."""
        isz, total = x.itemsize, x.size

        def consume(r: int, base: int) -> None:
            lo, hi = r * per, min(total, (r + 1) * per)
            _, views = self._views(base, (hi - lo) * isz, x.dtype)
            self._fold(x[lo:hi], views, op, dtype_name)

        return _rounds_of(b, per * isz), consume

    def _pipeline(
        self,
        rounds: int,
        sig: bytes,
        filler: Callable[[int], Callable[[np.ndarray], None] | None],
        consume: Callable[[int, int], None],
    ) -> OpGen:
        """Steps where everyone writes, then reads the others' slots: ``filler(r)`` writes my
        part of round ``r`` into my slot; ``consume(r, base)`` reads round ``r``'s slots (at
        offset ``base`` of every member's data) once all are written. Round r+1 is written
        before round r is read, so a fast rank runs a step ahead."""
        t0 = self._steps(rounds)
        self._inner = rounds > 1
        yield from self._announce(t0, sig, filler(0))
        for r in range(rounds):
            t = t0 + r
            yield (_INP, t, self.others)
            if r == 0:
                self._check(t, sig)
            if r + 1 < rounds:
                yield from self._announce(t + 1, None, filler(r + 1))
            consume(r, (t % self._slots) * self._slot)
            self._publish(_DONE, t)
        return None

    def _broadcast(self, b: np.ndarray, root: int, sig: bytes) -> OpGen:
        chunk, total = self._slot, b.size
        if (yield from self._go_direct(total, _BCAST_DIRECT_CHUNKS)):
            return (yield from self._direct_step(b, sig, [(root, b)] if self.me != root else []))
        is_root = self.me == root
        root_filler = _rounds_of(b, chunk)

        def filler(r: int) -> Callable[[np.ndarray], None] | None:
            return root_filler(r) if is_root else None

        def consume(r: int, base: int) -> None:
            if not is_root:
                lo, hi = r * chunk, min(total, (r + 1) * chunk)
                np.copyto(b[lo:hi], self._data[root][base : base + hi - lo])

        return (yield from self._pipeline(max(1, -(-total // chunk)), sig, filler, consume))

    def _all_gather(self, outs: list[np.ndarray], b: np.ndarray, sig: bytes) -> OpGen:
        chunk, total, me = self._slot, b.size, self.me
        if (yield from self._go_direct(total, _GATHER_DIRECT_CHUNKS)):
            return (yield from self._direct_step(b, sig, list(enumerate(outs))))

        filler = _rounds_of(b, chunk)

        def consume(r: int, base: int) -> None:
            lo, hi = r * chunk, min(total, (r + 1) * chunk)
            for j, d in enumerate(self._data):
                np.copyto(outs[j][lo:hi], b[lo:hi] if j == me else d[base : base + hi - lo])

        return (yield from self._pipeline(max(1, -(-total // chunk)), sig, filler, consume))

    def _reduce_scatter(
        self, out: np.ndarray, ins: list[np.ndarray], op: ReduceOp, dtype_name: str, sig: bytes
    ) -> OpGen:
        n, isz, total = self.n, out.itemsize, out.size
        per = max(1, self._slot // (n * isz))  # elements of each part per step
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

        return self._pipeline(max(1, -(-total // per)), sig, filler, consume)

    # -- single copy: readers copy straight from the writer's buffer -----------------------
    def _go_direct(self, nbytes: int, chunks: int) -> Generator[Wait, None, bool]:
        """Whether this operation reads the peers' buffers directly (client.data._vm_read), decided
        alike on every member: for payloads of at least ``chunks`` chunks, once every member's
        probe verdict (written at the group's first step, before its ``done`` of that step)
        says it can read every other member; until then, and where any member cannot (a
        container's seccomp filter, no ptrace access), through the slots. The payload size is
        the same on every member unless the signatures differ, which the first step reports
        before anything is read either way."""
        t0 = self.step + 1
        if nbytes < chunks * self.chunk or t0 <= _SLOTS or self._direct is False:
            return False
        if self._direct is None:
            yield (_DONE, t0 - _SLOTS, self.others)  # (the slot path's first wait too)
            verdicts = [self._ctl[j][_DIRECT] for j in range(self.n)]
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
                vm_read(self._pids[j], probe.ctypes.data, self._ctl[j][_BASE] + 8 * _OWNER, 8)
            except OSError as exc:
                log.debug(
                    "rank %d: direct reads from rank %d refused (%s)", self.ranks[self.me], self.ranks[j], exc
                )
                ok = False
                break
            ok = int(probe[0]) == self._owner
        self._ctl[self.me][_DIRECT] = 1 if ok else 2

    def _direct_step(self, mine: np.ndarray, sig: bytes, reads: list[tuple[int, np.ndarray]]) -> OpGen:
        """One step: publish where ``mine`` is, once the signatures match read member j's
        buffer into ``out`` for every (j, out) of ``reads`` (mine copied for j = me), then wait
        until every member has read mine (the caller may change it once the operation ends)."""
        t = self._steps(1)
        s = t % _SLOTS
        self._inner = True
        self.direct_steps += 1
        src = mine if mine.flags.c_contiguous else np.ascontiguousarray(mine)
        ctl = self._ctl[self.me]
        ctl[_BUF + 2 * s] = src.ctypes.data
        ctl[_BUF + 2 * s + 1] = src.nbytes
        self._write_sig(s, sig)
        self._publish(_INP, t)
        yield (_INP, t, self.others)
        self._check(t, sig)
        for j, out in reads:
            if j == self.me:
                np.copyto(out, mine)
                continue
            dst = out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)
            addr, nbytes = self._ctl[j][_BUF + 2 * s], self._ctl[j][_BUF + 2 * s + 1]
            if nbytes != dst.nbytes:  # (the signatures matched: sizes agree)
                raise DistError(f"rank {self.ranks[j]} published {nbytes} bytes, expected {dst.nbytes}")
            try:
                vm_read(self._pids[j], dst.ctypes.data, addr, nbytes)
            except OSError as exc:
                self._publish(_DONE, t)
                # Gone, or it gave the operation up on losing another member and went on (its
                # buffer freed, its process ended): then that member is the news.
                first = self._lost_first_by(j)
                if first is not None:
                    why = f"rank {self.ranks[j]} lost it first (its memory could not be read: {exc})"
                    raise PeerLostError(first, why) from exc
                raise PeerLostError(self.ranks[j], f"its memory could not be read ({exc})") from exc
            if dst is not out:
                np.copyto(out, dst)
        self._publish(_DONE, t)
        yield (_DONE, t, self.others)
        return None

    def _barrier(self, sig: bytes) -> OpGen:
        t = self._steps(1)
        yield from self._announce(t, sig, None)
        yield (_INP, t, self.others)
        self._check(t, sig)
        self._publish(_DONE, t)
        return None

    # Overflow gives inf and invalid operations nan, as in torch and the driver's Buffers: no
    # floating-point warnings (errstate wraps each fold once, not a ``with`` per kernel call).
    @np.errstate(all="ignore")
    def _fold(
        self, dst: np.ndarray, srcs: list[np.ndarray], op: ReduceOp, dtype_name: str, *, copy: bool = False
    ) -> None:
        """dst = srcs[0] op srcs[1] op ... in rank order (AVG divided at the end). ``dst`` holds
        my own input already unless ``copy``."""
        n, me = self.n, self.me
        if n == 1:
            if copy:
                np.copyto(dst, srcs[0])
        elif copy or me > 1:
            combine(op, dst, srcs[0], srcs[1], dtype_name)
            for j in range(2, n):
                reduce_into(op, dst, srcs[j], dtype_name)
        else:
            if me == 1:  # dst holds srcs[1]: dst = srcs[0] op dst
                reduce_into(op, dst, srcs[0], dtype_name, src_first=True)
            for j in range(2 if me == 1 else 1, n):
                reduce_into(op, dst, srcs[j], dtype_name)
        self._average(dst, op, dtype_name)

    @np.errstate(all="ignore")
    def _fold_share(self, srcs: list[np.ndarray], op: ReduceOp, dtype_name: str) -> None:
        """srcs[me] = srcs[0] op srcs[1] op ... in rank order, in place (my share of a step, in
        my own slot). Ranks 0 and 1 fold straight into it; a higher rank's own input is needed
        after the first combination, so it folds block by block through a small temporary."""
        me = self.me
        dst = srcs[me]
        if me <= 1:
            self._fold(dst, srcs, op, dtype_name)
            return
        if self._fold_tmp is None:
            self._fold_tmp = np.empty(_FOLD_BLOCK, np.uint8)
        step = _FOLD_BLOCK // dst.itemsize
        tmp_all = self._fold_tmp.view(dst.dtype)
        for lo in range(0, dst.size, step):
            hi = min(dst.size, lo + step)
            tmp = tmp_all[: hi - lo]
            combine(op, tmp, srcs[0][lo:hi], srcs[1][lo:hi], dtype_name)
            for j in range(2, self.n):
                reduce_into(op, tmp, srcs[j][lo:hi], dtype_name)
            np.copyto(dst[lo:hi], tmp)
        self._average(dst, op, dtype_name)

    def _average(self, dst: np.ndarray, op: ReduceOp, dtype_name: str) -> None:
        if op is ReduceOp.AVG:
            finish_avg(dst, self.n, dtype_name)

    # -- signatures ------------------------------------------------------------------------
    def _check(self, t: int, sig: bytes) -> None:
        if t == 1:
            self._probe_direct()
        o = _SIG + (t % self._slots) * _SIG_BYTES
        end = o + len(sig)
        for j in self.others:
            if self._raw[j][o:end] != sig:
                self._publish(_DONE, t)  # let the others read on to their own verdict
                raise self._mismatch(o, sig)

    def _mismatch(self, o: int, mine: bytes) -> MismatchError:
        """Every member's call at this point (we hold all their signatures), in the one wording
        of a mismatch (aiocoll._signature)."""
        mine_meta = _signature.unpack(mine)
        metas = {
            self.ranks[j]: _signature.unpack(bytes(self._raw[j][o : o + _SIG_BYTES])) for j in self.others
        }
        metas[self.ranks[self.me]] = mine_meta
        return _signature.mismatch(self._gid, int(mine_meta["seq"]), metas, mine_meta)

    # -- the driver ------------------------------------------------------------------------
    def _publish(self, counter: int, t: int) -> None:
        self._ctl[self.me][counter] = t
        fence()  # the counter is visible before we look at who sleeps
        ctl, efds = self._ctl, self._efds
        for j in self.others:
            if ctl[j][_SLEEP]:
                os.eventfd_write(efds[j], 1)

    def _ready(self, wait: Wait) -> bool:
        counter, t, members = wait
        ctl, owner = self._ctl, self._owner
        for j in members:
            c = ctl[j]
            if c[counter] < t or c[_OWNER] != owner:
                return False
        return True

    def _submit(self, gen: OpGen, finish: Finish, on_wait: OnWait | None = None) -> _ShmOp:
        op = _ShmOp(self, gen, finish, on_wait)
        if self.broken is not None:
            finish(None, self.broken)
            return op
        self.queue.append(op)
        if len(self.queue) == 1:
            now = time.perf_counter()
            if self._inline_since is None:
                # the first operation run inside its call since the loop last turned
                self._inline_since = now
                self._loop.call_soon(self._loop_turned)
            elif now - self._inline_since > _INLINE_S:
                # A loop of awaited operations that all complete inside their calls would never
                # give the event loop a turn (heartbeats, other tasks, signals): now and then
                # the next one starts from the loop instead.
                self._loop.call_soon(self._run)
                return op
            self._run()
        return op

    def _loop_turned(self) -> None:
        self._inline_since = None

    def _advance(self, op: _ShmOp) -> bool:
        """Run ``op`` until it waits for something not there yet (False) or ends (True)."""
        wait = op.wait
        gen = op.gen
        if op.mark is None:
            row = self._ctl[self.me]
            op.mark = (row[_INP], row[_RED], row[_DONE])
        while True:
            if wait is not None and not self._ready(wait):
                op.wait = wait
                return False
            try:
                wait = gen.send(None)
            except StopIteration as done:
                self._end(op, done.value, None)
                return True
            except Exception as exc:
                self._end(op, None, exc)
                return True

    def _end(self, op: _ShmOp, result: Any, exc: BaseException | None) -> None:
        self._inner = False
        if self.queue and self.queue[0] is op:
            self.queue.popleft()
        self.completed += 1
        if exc is not None and self.broken is None:
            self.broken = exc
        op.finish(result, exc)

    def _run(self) -> None:
        queue = self.queue
        began = time.perf_counter()
        while queue:
            op = queue[0]
            if self._advance(op):
                if self.broken is not None:
                    self._fail_queued(self.broken)
                continue
            if time.perf_counter() - began > _INLINE_S:
                # a long operation whose peers keep pace never sleeps: give the event loop a
                # turn now and then (heartbeats, other tasks), then go on from there
                self._loop.call_soon(self._run)
                return
            if not self._spin(op) and self._sleep():
                return

    def _spin(self, op: _ShmOp) -> bool:
        """Wait a bounded time for ``op``'s condition: first a few microseconds of plain
        checks (a peer on another core answers within them), then checks that each yield the
        CPU first (the rank we wait for may be queued on our core, behind us or other work on
        the machine, and only a yield lets it run; a yield can also hand the core to someone
        else's process for a while, hence not from the start). The budget adapts: it halves
        after a spin that ended in sleep (the peer is slow: spinning only costs) and doubles
        back after one that succeeded. Between the steps of a large operation the waits are
        _wait_step's.

        With more ranks than cores, most of the ranks we wait for are off the CPU and only a
        yield lets them on: no plain checks, and a yield that handed the core to another task
        for a moment (a peer rank's turn, between _HANDOFF_S and _LATE_YIELD_S) is not charged
        to the budget, up to _HANDOFFS times: the peers got on with it, and sleeping now would
        cost a wake-up per operation. A longer yield (other work's time slice) is charged."""
        wait = op.wait
        assert wait is not None
        beside = self._beside(wait)
        if self._inner:
            return self._wait_step(wait, beside)
        if beside:
            return False
        ready = self._ready
        if self._oversubscribed:
            return spin(lambda: ready(wait), self._budget, 0.0, _HANDOFFS)
        return spin(lambda: ready(wait), self._budget, _PLAIN_SPIN_S)

    def _beside(self, wait: Wait) -> bool:
        """Whether a member we wait for last ran on the CPU we run on now (and publish ours).

        With a core for every rank, a rank that shares one with the peer it waits for holds
        that peer off the CPU while it spins: the scheduler puts a woken task beside its waker
        when the other core is briefly busy, and moves a task that is always running (spinning
        ranks look cache-hot) only after several balancing rounds, milliseconds later. Sleeping
        instead lets the peer run at once, and its wake-up lands us on the idle core. Where
        every core is busy (other work beside the job), there is no idle core to land on, and
        the usual waits (which yield) hand the core over sooner than a sleep and a wake-up."""
        cpu = current_cpu() + 1
        ctl = self._ctl
        ctl[self.me][_CPU] = cpu
        if self._oversubscribed or cpu == 0:
            return False  # (more ranks than cores share cores anyway: waits yield instead)
        counter, t, members = wait
        for j in members:
            row = ctl[j]
            if row[_CPU] == cpu and row[counter] < t:
                self.beside += 1
                # with no idle core to wake up on, a yield hands ours over sooner than a sleep
                return not host_contended()
        return False

    def _wait_step(self, wait: Wait, beside: bool = False) -> bool:
        """Wait up to _INNER_SPIN_S between the steps of a large operation, where the peers are
        a copy away. First spin without yielding for _STEP_PLAIN_S (a peer on another core is
        usually that close; a yield or a sleep would cost a wake-up), or only _PLAIN_SPIN_S
        with more ranks than cores (the peer may be queued on ours). Then, while every runnable
        task on the host has a core (the kernel's count in /proc/loadavg), go on spinning, as
        MPI does. When tasks queue for the cores, yield the core at each check, which
        hands it straight to a peer rank queued on it (more ranks than cores) -- unless a yield
        came back late (other work held the core for a time slice: busy processes beside the
        job), after which, for a while, nap on the eventfd instead: the publisher's write wakes
        us at once, and a woken sleeper gets the core back ahead of busy processes, where a
        yielding spinner would queue behind them."""
        ready = self._ready
        clock = time.perf_counter
        start = clock()
        stop = start + _INNER_SPIN_S
        if beside:
            return self._nap(wait, stop)
        plain = start + self._step_plain_s
        while True:
            while clock() < plain:
                if ready(wait):
                    return True
            now = clock()
            if now > stop:
                return False
            if not host_contended():
                plain = now + _CONTENTION_EVERY_S
                continue
            if now < self._nap_until:
                return self._nap(wait, stop)
            os.sched_yield()
            back = clock()
            if back - now > LATE_YIELD_S:
                self._nap_until = back + _NAP_FOR_S
            if ready(wait):
                return True
            plain = back

    def _nap(self, wait: Wait, stop: float) -> bool:
        """Block on the eventfd (our sleeping flag up, so publishers write it) until ``wait``
        is met or the clock reaches ``stop``; the event loop is not involved."""
        ctl = self._ctl[self.me]
        ctl[_SLEEP] = 1
        fence()  # the flag is visible before we look once more
        woke_others = False
        try:
            met, woke_others, naps = nap(self._host.efd, lambda: self._ready(wait), stop)
            self.naps += naps
            return met
        finally:
            ctl[_SLEEP] = 0
            if woke_others and self._waker.sleeping - {self}:
                # the wake-up we took may have been for another group sleeping in the loop
                self._loop.call_soon(self._waker.resume)

    def _sleep(self) -> bool:
        """Sleep on the eventfd unless what we wait for arrived meanwhile (then False)."""
        ctl = self._ctl[self.me]
        ctl[_SLEEP] = 1
        fence()  # the flag is visible before we look once more
        op = self.queue[0]
        if op.wait is not None and self._ready(op.wait):
            ctl[_SLEEP] = 0
            return False
        self.sleeps += 1
        if op.on_wait is not None and op.wait is not None:
            counter, t, members = op.wait
            op.on_wait(
                [
                    self.ranks[j]
                    for j in members
                    if self._ctl[j][counter] < t or self._ctl[j][_OWNER] != self._owner
                ]
            )
        self._waker.sleeping.add(self)
        if self._timer is None:
            self._timer = self._loop.call_later(_RECHECK_S, self._recheck)
        return True

    def _recheck(self) -> None:
        self._timer = None
        if self in self._waker.sleeping:
            self._wake()

    def _wake(self) -> None:
        self._waker.sleeping.discard(self)
        self._ctl[self.me][_SLEEP] = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.queue:
            self._run()

    def _fail_queued(self, exc: BaseException) -> None:
        while self.queue:
            op = self.queue.popleft()
            op.gen.close()
            op.finish(None, exc)

    def _stop(self, op: _ShmOp) -> None:
        if op in self.queue:
            self._complete_ready(until=op)
        if op in self.queue:
            head = self.queue[0]  # the one started (only the first runs): it and all after fail
            self.queue.remove(op)
            op.gen.close()
            if self.broken is None:
                self.broken = DistError(
                    "an operation of this group was stopped midway; the group is out of step"
                )
            self._abandon(head)
            self._fail_queued(self.broken)

    def _complete_ready(self, until: _ShmOp | None = None) -> None:
        """Run the queued operations (those ahead of ``until``) that what the peers published
        lets complete now, before the queue is failed: what a peer that left or was lost
        published stays readable (our mapping keeps its memory), so an operation it finished
        its part of completes here too, as a message it sent before going is still received."""
        queue = self.queue
        while queue and queue[0] is not until and self.broken is None and self._ctl:
            if not self._advance(queue[0]):
                return

    def _abandon(self, op: _ShmOp) -> None:
        """Take back what we published for an operation we gave up on (a deadline, a peer gone):
        it must not complete it for a late peer, which then fails as we did. What we published
        for the operations before it stays: a peer still finishing one of those completes it."""
        mark = op.mark
        if self._ctl and mark is not None:
            row = self._ctl[self.me]
            row[_INP], row[_RED], row[_DONE] = mark

    def fail(self, exc: BaseException) -> None:
        """Fail every queued operation (a member was lost); the group stays failed."""
        if self.broken is None:
            self.broken = exc
        self._waker.sleeping.discard(self)
        self._fail_queued(exc)

    def peer_lost(self, rank: int, reason: str, *, left: bool = False) -> None:
        """Fail the group naming the rank that was lost first. A survivor that failed on a
        loss and then closed is seen closing too, and possibly before the dead rank (the
        kernel gives no order between two sockets, and a loaded machine delays one reader more
        than another), so before closing each member records in its row whom it lost, and a
        member that sees a peer go reads that record and names the rank the peer lost."""
        if rank not in self.ranks:
            return
        self._complete_ready()
        if self._ctl:
            first = self._lost_first_by(self.ranks.index(rank))
            if first is not None:
                reason = f"rank {rank} lost it first, then left too ({reason})"
                rank, left = first, False
            if self.broken is None:
                self._ctl[self.me][_LOST] = rank + 1
        self.fail(PeerLostError(rank, reason, left=left))

    def _lost_first_by(self, j: int) -> int | None:
        """The rank that member ``j`` recorded it lost (in its row, before it failed its
        operations and closed), when it recorded one other than this process."""
        row = self._ctl[j]
        first = row[_LOST] - 1 if row[_OWNER] == self._owner else -1
        return first if first in self.ranks and first != self.ranks[self.me] else None

    def peer_lost_handler(self, rank: int, exc: BaseException) -> None:
        """The transport's lost-peer handler (a peer lost, or gone in order)."""
        if isinstance(exc, PeerLostError):
            self.peer_lost(rank, exc.reason, left=exc.left)
        else:
            self.peer_lost(rank, str(exc))

    def close(self) -> None:
        """Fail what is queued and give the region back (the next group to take it marks it as
        its own). Twice is fine."""
        self.fail(DistError("the process group was closed"))
        if self._timer is not None:
            self._timer.cancel()
        if not self._raw:
            return
        # The counters stay as they are: a peer may still be finishing our last operation.
        self._host.regions_used.discard(self.region)
        self._view_cache.clear()
        self._data.clear()
        self._ctl.clear()
        for v in self._raw:
            v.release()
        self._raw.clear()
