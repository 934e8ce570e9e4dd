"""The running of a group's operations over its region of the members' arenas: the region taken
on every member, the queue of operations (generators that yield what they wait for), the waits
(spin, nap, sleep on the eventfd until the process's ShmWaker, client.data._shm_waker, resumes
the group), and the failure of the group when a member is lost, leaves or an operation is
stopped midway. An operation of one step started on an idle group runs as plain calls and, when
its peers keep pace, ends inside its call (``_run_step``); it joins the queue only if it has to
sleep.

Imports foundations (aiocoll._env, aiocoll._errors), client.data._shm, client.data._shm_layout,
client.data._shm_waker, client.data._waiting, client.data._operation and client.data._op_record
(Stoppable); never the public surface and never the operations themselves (client.data._shm_coll
builds on this).

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
import hashlib
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from aiocoll._env import env_float
from aiocoll._errors import DistError, PeerLostError

from ._op_record import Stoppable
from ._operation import HANDED_OFF, Finish
from ._shm import (
    ARENA_HEADER,
    STORES_IN_ORDER,
    ShmHost,
    current_cpu,
    fence,
    fence_enter,
    fence_leave,
    region_bytes,
)
from ._shm_layout import BASE, CPU, DATA, DONE, INP, LOST, OWNER, RED, SLEEP, OnWait, OpGen, Wait
from ._shm_waker import ShmWaker
from ._waiting import LATE_YIELD_S, PLAIN_SPIN_S, SpinBudget, host_contended, nap, oversubscribed, spin

__all__ = ["STORES_IN_ORDER", "ShmOp", "ShmScheduler", "ShmWaker"]

_RECHECK_S = 0.2  # a sleeping operation re-checks this often even without a wake-up
# Between the steps of a large operation the peers are a copy away: sleeping there hands the
# core to the scheduler and costs a wake-up latency per step (milliseconds on a busy machine).
_INNER_SPIN_S = 1e-3
# A wait between steps first spins this long without yielding or napping (peers on other cores):
# napping at once on a busy host cost a sleep and a wake-up per short wait (a 1 MiB all_gather of
# 2 ranks went from 59 to 290 us).
_STEP_PLAIN_S = 50e-6
_HANDOFFS = 8  # of a spin's yields, at most this many are not charged to its budget (_spin)
_NAP_FOR_S = 0.1  # after a late yield, waits between steps nap rather than yield for this long
_CONTENTION_EVERY_S = 50e-6  # a spin between steps re-reads the host's runnable count this often
_INLINE_S = 0.002  # at most this long of operations completing inside their calls between loop turns
_OFF_LOOP_NAP_S = 0.002  # a wait started off the loop's thread naps in place this long at most
# ... after spinning up to this long past the adaptive budget (with a core for every rank): a nap
# costs a wake-up, and the peer waits that long, fails its own spin and naps in turn, so naps
# come in runs (the async API's sleep goes through its loop first, a turn later, and seldom blocks)
_OFF_LOOP_SPIN_S = 300e-6


_clock = time.perf_counter

_CLOSED_ROW = memoryview(bytearray(DATA)).cast("q")  # a closed group's own row: no arena behind it


class ShmOp:
    __slots__ = ("finish", "gen", "group", "mark", "on_wait", "wait")

    def __init__(self, group: ShmScheduler, gen: OpGen, finish: Finish, on_wait: OnWait | None) -> None:
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


class ShmScheduler:
    """A group's region in every member's arena, and the running of the group's operations in it.

    Every member must create its group (which clears its own region) before any member starts
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
        self._waker = waker
        self._loop = asyncio.get_running_loop()
        base = self._base = ARENA_HEADER + region * host.region_bytes  # (in every member's mapping)
        mems = [host.mem if r == host.rank else host.peers[r].mem for r in self.ranks]
        self._raw = [memoryview(m)[base : base + DATA] for m in mems]
        self._ctl = [v.cast("q") for v in self._raw]
        self._data = [np.frombuffer(m, np.uint8, count=4 * chunk, offset=base + DATA) for m in mems]
        self._efds = [-1 if r == host.rank else host.peers[r].efd for r in self.ranks]
        # Take the region: counters at zero first, then our group's mark. A member reads a
        # peer's counters only next to the mark of this group (stale counters of an earlier
        # group in that region, or of a later one, are never taken for ours).
        self._owner = (
            int.from_bytes(hashlib.blake2b(gid.encode(), digest_size=8).digest(), "little") >> 1 or 1
        )
        self._raw[me][:] = bytes(DATA)
        self._ctl[me][BASE] = np.frombuffer(self._raw[me], np.uint8).ctypes.data
        fence()
        self._ctl[me][OWNER] = self._owner
        self.others = tuple(j for j in range(self.n) if j != me)
        # The rows the operations read and write on every step, found once (see close).
        self._mine = self._ctl[me]
        self._mine_raw = self._raw[me]
        self._peer_rows = tuple(self._ctl[j] for j in self.others)
        self._peer_wake = tuple((self._ctl[j], self._efds[j]) for j in self.others)
        self._peer_raw = tuple(self._raw[j] for j in self.others)
        self._peer_mems = tuple(mems[j] for j in self.others)  # (slices of these are copies)
        self.queue: deque[ShmOp] = deque()
        self.broken: BaseException | None = None
        # More ranks than cores: a waiting rank's spin holds a core a peer needs, so keep it short.
        shared = oversubscribed(ranks_on_host)
        self._oversubscribed = shared
        self._step_plain_s = PLAIN_SPIN_S if shared else _STEP_PLAIN_S
        if spin_s is None:
            spin_us = env_float("AIOCOLL_SHM_SPIN_US")
            spin_s = (spin_us if spin_us is not None else 20.0 if shared else 100.0) * 1e-6
        self._budget = SpinBudget(spin_s)
        self._inline_until: float | None = None  # (perf_counter) the inline time's end (_straight)
        self._inner = False  # inside a multi-step operation: its waits are short, spin longer
        self._timer: asyncio.TimerHandle | None = None
        self._gid = gid
        self.sleeps = 0
        self.naps = 0  # blocks on the eventfd inside a wait between steps (_nap)
        self.beside = 0  # waits that found the awaited peer queued on our core (_beside)
        self._nap_until = 0.0  # (perf_counter) waits between steps nap until then (_wait_step)
        self._beside_now = False  # the last wait found an awaited member on our CPU (_beside)
        self.completed = 0  # operations finished here (diagnostics: the bench names the path)

    def _publish(self, counter: int, t: int) -> bool:
        """Publish my ``counter`` at step ``t``, wake the peers that sleep, and say whether every
        other member's ``counter`` had reached ``t`` too (``_peers_at``: a step that waits for
        that next need not yield its wait)."""
        self._mine[counter] = t
        fence_enter()  # (fence: the counter is visible before we look at who sleeps)
        fence_leave()
        for row, efd in self._peer_wake:
            if row[SLEEP]:
                os.eventfd_write(efd, 1)
        return self._peers_at(counter, t)

    def _peers_at(self, counter: int, t: int) -> bool:
        """Whether every other member's ``counter`` has reached step ``t`` in this group: what
        every operation waits for, and what a step checks before it yields that wait (a wait
        met at once is not handed to the driver)."""
        owner = self._owner
        for row in self._peer_rows:
            if row[counter] < t or row[OWNER] != owner:
                return False
        return True

    def _ready(self, wait: Wait) -> bool:
        counter, t, members = wait
        if members is self.others:  # (what every operation waits for)
            return self._peers_at(counter, t)
        owner = self._owner
        ctl = self._ctl
        for j in members:
            row = ctl[j]
            if row[counter] < t or row[OWNER] != owner:
                return False
        return True

    def _check_of(self, wait: Wait) -> Callable[[], bool]:
        """``_ready(wait)`` as a function of nothing, for a spin to call at every check: with one
        other member, its two reads alone (a check's cost is how late a spin sees the peer)."""
        counter, t, members = wait
        if members is self.others and len(members) == 1:
            row, owner = self._peer_rows[0], self._owner
            return lambda: row[counter] >= t and row[OWNER] == owner
        ready = self._ready
        return lambda: ready(wait)

    def _submit(self, gen: OpGen, finish: Finish, on_wait: OnWait | None = None) -> ShmOp:
        op = ShmOp(self, gen, finish, on_wait)
        if self.broken is not None:
            finish(None, self.broken)
            return op
        if self.queue:
            self.queue.append(op)  # (it runs when those before it end)
            return op
        inline = self._straight()
        self.queue.append(op)
        if inline:
            self._run()
        else:
            self._loop.call_soon(self._run)
        return op

    def _straight(self) -> bool:
        """Whether an operation may run inside its call now (``_run``, or ``_run_step`` for one
        of one step): nothing queued before it, the group not failed, and the inline time not
        spent. A loop of awaited operations that all complete inside their calls would never
        give the event loop a turn (heartbeats, other tasks, signals): past _INLINE_S of them
        since the loop last turned, the next one starts from the loop instead."""
        if self.queue or self.broken is not None:
            return False
        until = self._inline_until
        if until is None:
            # the first operation run inside its call since the loop last turned
            self._inline_until = _clock() + _INLINE_S
            self._loop.call_soon(self._loop_turned)
            return True
        return _clock() <= until

    def _finished(self, finish: Finish, result: Any, exc: BaseException | None) -> None:
        """An operation ended here: counted, its failure the group's, its caller told."""
        self.completed += 1
        if exc is not None and self.broken is None:
            self.broken = exc
        finish(result, exc)

    def _run_step(self, gen: OpGen, t: int, finish: Finish, on_wait: OnWait | None) -> Stoppable:
        """Run an operation of one step, ``t``, as plain calls (the group idle: ``_straight``).
        ``gen`` is its generator, not begun: it yields what it waits for (its slot free, past
        the first SLOTS steps; every member's input) and has no result. When each wait is
        met at once or within the spin, it ends inside this call and there is nothing to stop;
        otherwise it goes on as a queued operation from the wait that was not met, which sleeps,
        times out, fails on a lost peer and is stopped as every queued one is.

        Driven here rather than through the queue (``_submit``, ``_run``, ``_advance``), whose
        bookkeeping costs more than the reads and writes of a small step."""
        try:
            for wait in gen:
                if not (self._ready(wait) or self._spin(wait) or self._nap_off_loop(wait)):
                    break
            else:
                self.completed += 1
                finish(None, None)
                return HANDED_OFF
        except Exception as exc:
            self._finished(finish, None, exc)
            return HANDED_OFF
        # The in-call waits are over: queued, it goes to sleep next, as ``_run`` would send it.
        op = ShmOp(self, gen, finish, on_wait)
        op.wait = wait
        # What stopping it puts back: my counters before step t. Every step before it had
        # published its input and been read here (the group is whole: nothing was abandoned),
        # and a step of one operation never publishes ``red``.
        op.mark = (t - 1, self._ctl[self.me][RED], t - 1)
        self.queue.append(op)
        if not self._sleep():
            self._run()
        return op

    def _loop_turned(self) -> None:
        self._inline_until = None

    def _advance(self, op: ShmOp) -> bool:
        """Run ``op`` until it waits for something not there yet (False) or ends (True)."""
        wait = op.wait
        gen = op.gen
        if op.mark is None:
            row = self._ctl[self.me]
            op.mark = (row[INP], row[RED], row[DONE])
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

    def _end(self, op: ShmOp, result: Any, exc: BaseException | None) -> None:
        self._inner = False
        if self.queue and self.queue[0] is op:
            self.queue.popleft()
        self._finished(op.finish, result, exc)

    def _run(self) -> None:
        queue = self.queue
        began = time.perf_counter()
        while queue:
            op = queue[0]
            if self._advance(op):
                if self.broken is not None:
                    self._fail_queued(self.broken)
                continue
            if time.perf_counter() - began > _INLINE_S and not self._off_loop():
                # a long operation whose peers keep pace never sleeps: give the event loop a
                # turn now and then (heartbeats, other tasks), then go on from there. (A blocking
                # caller driving it goes on: the loop's own thread is free to take its turn once
                # the operation waits or ends, where handing the rest over to it would cost that
                # thread's wake-up and the caller's.)
                self._loop.call_soon(self._run)
                return
            wait = op.wait
            assert wait is not None
            if not self._spin(wait) and not self._nap_off_loop(wait) and self._sleep():
                return

    def _spin(self, wait: Wait) -> bool:
        """Wait a bounded time for ``wait``: first a few microseconds of plain
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
        beside = self._beside_now = self._beside(wait)
        if self._inner:
            return self._wait_step(wait, beside)
        if beside:
            return False
        if self._oversubscribed:
            return spin(self._check_of(wait), self._budget, 0.0, _HANDOFFS)
        return spin(self._check_of(wait), self._budget, PLAIN_SPIN_S)

    def _nap_off_loop(self, wait: Wait) -> bool:
        """Started on a thread other than the loop's (a blocking caller that took the loop's
        turn, aiocoll/_sync_loop.py): nap on the eventfd in place for up to _OFF_LOOP_NAP_S
        before going to sleep in the loop. That thread would otherwise park until the loop
        thread, woken by the same eventfd, finished the operation and woke it in turn: two
        wake-ups where this costs one. Bounded, since the loop waits for the turn meanwhile.

        Before the nap, with a core for every rank and the awaited member not on ours, it spins
        (yielding at each check) up to _OFF_LOOP_SPIN_S beyond the adaptive budget: the calling
        thread has nothing else to do, and a nap's wake-up costs both ranks more than the spin."""
        waker = self._waker
        if not self._off_loop() or waker.sleeping:
            return False  # (groups sleeping in the loop: it must watch the eventfd meanwhile)
        if not (self._oversubscribed or self._beside_now):
            if spin(self._check_of(wait), SpinBudget(_OFF_LOOP_SPIN_S), PLAIN_SPIN_S):
                return True
        waker.unwatch()
        try:
            return self._nap(wait, time.perf_counter() + _OFF_LOOP_NAP_S)
        finally:
            # A peer that saw our sleeping flag may write the eventfd just after we woke: take
            # that late write here, or it wakes the loop thread, which then holds the turn and
            # has the next blocking call handed over to it. (No group sleeps in the loop now.)
            waker.drain()
            waker.watch()

    def _off_loop(self) -> bool:
        """Whether this thread is not the loop's (a blocking caller that took the loop's turn,
        aiocoll/_sync_loop.py, drives the operation). A loop without a thread id (uvloop) is
        never driven from another thread."""
        owner = getattr(self._loop, "_thread_id", None)
        return owner is not None and owner != threading.get_ident()

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
        ctl[self.me][CPU] = cpu
        if self._oversubscribed or cpu == 0:
            return False  # (more ranks than cores share cores anyway: waits yield instead)
        counter, t, members = wait
        for j in members:
            row = ctl[j]
            if row[CPU] == cpu and row[counter] < t:
                self.beside += 1
                # with no idle core to wake up on, a yield hands ours over sooner than a sleep
                return not host_contended()
        return False

    def _wait_step(self, wait: Wait, beside: bool = False) -> bool:
        """Wait up to _INNER_SPIN_S between the steps of a large operation, where the peers are
        a copy away. First spin without yielding for _STEP_PLAIN_S (a peer on another core is
        usually that close; a yield or a sleep would cost a wake-up), or only PLAIN_SPIN_S
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
        ctl[SLEEP] = 1
        fence()  # the flag is visible before we look once more
        woke_others = False
        try:
            met, woke_others, naps = nap(self._host.efd, lambda: self._ready(wait), stop)
            self.naps += naps
            return met
        finally:
            ctl[SLEEP] = 0
            if woke_others and self._waker.sleeping - {self}:
                # the wake-up we took may have been for another group sleeping in the loop
                self._loop.call_soon(self._waker.resume)

    def _sleep(self) -> bool:
        """Sleep on the eventfd unless what we wait for arrived meanwhile (then False)."""
        ctl = self._ctl[self.me]
        ctl[SLEEP] = 1
        fence()  # the flag is visible before we look once more
        op = self.queue[0]
        if op.wait is not None and self._ready(op.wait):
            ctl[SLEEP] = 0
            return False
        self.sleeps += 1
        if op.on_wait is not None and op.wait is not None:
            counter, t, members = op.wait
            op.on_wait(
                [
                    self.ranks[j]
                    for j in members
                    if self._ctl[j][counter] < t or self._ctl[j][OWNER] != self._owner
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
        self._ctl[self.me][SLEEP] = 0
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

    def _stop(self, op: ShmOp) -> None:
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

    def _complete_ready(self, until: ShmOp | None = None) -> None:
        """Run the queued operations (those ahead of ``until``) that what the peers published
        lets complete now, before the queue is failed: what a peer that left or was lost
        published stays readable (our mapping keeps its memory), so an operation it finished
        its part of completes here too, as a message it sent before going is still received."""
        queue = self.queue
        while queue and queue[0] is not until and self.broken is None and self._ctl:
            if not self._advance(queue[0]):
                return

    def _abandon(self, op: ShmOp) -> None:
        """Take back what we published for an operation we gave up on (a deadline, a peer gone):
        it must not complete it for a late peer, which then fails as we did. What we published
        for the operations before it stays: a peer still finishing one of those completes it."""
        mark = op.mark
        if self._ctl and mark is not None:
            row = self._ctl[self.me]
            row[INP], row[RED], row[DONE] = mark

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
                self._ctl[self.me][LOST] = rank + 1
        self.fail(PeerLostError(rank, reason, left=left))

    def _lost_first_by(self, j: int) -> int | None:
        """The rank that member ``j`` recorded it lost (in its row, before it failed its
        operations and closed), when it recorded one other than this process."""
        row = self._ctl[j]
        first = row[LOST] - 1 if row[OWNER] == self._owner else -1
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
        self._data.clear()
        self._ctl.clear()
        self._mine = _CLOSED_ROW  # (the arena's views all go: its mapping can then be closed)
        self._mine_raw = _CLOSED_ROW
        self._peer_rows = self._peer_wake = self._peer_raw = self._peer_mems = ()
        for v in self._raw:
            v.release()
        self._raw.clear()
