"""What one small collective costs each rank: wall and CPU time per operation, and (on rank 0)
where the interpreter spends it. A developer's tool for the per-operation path (api -> engine ->
shared memory or links); docs/PERFORMANCE.md quotes it.

Run it under the launcher, one world per invocation (under the bench lock on a shared machine):

    aiocoll run --nproc-per-node 2 scripts/op_cost.py                 # us/op wall and CPU per rank
    aiocoll run --nproc-per-node 2 scripts/op_cost.py --count         # + opcodes and calls per op
    aiocoll run --nproc-per-node 2 scripts/op_cost.py --profile tottime
    aiocoll run --nproc-per-node 2 scripts/op_cost.py --events        # + yields, wake-ups, loop turns
    aiocoll run --nproc-per-node 2 scripts/op_cost.py --recorder      # the flight recorder, on vs off
                                                                      # (whole operations, and its own lines)
    aiocoll run --nproc-per-node 2 scripts/op_cost.py --op sendrecv   # ping-pong: us one way, and
                                                                      # with --count per round trip

``--count`` traces rank 0 (sys.settrace with opcode events, sys.setprofile for C calls) and
leaves out the waits (ShmGroup's spin, sleep and naps: how long a peer takes is not work), so
its numbers do not move with the load on the machine the way times do: they say how much Python
one operation runs. ``--profile`` is cProfile of rank 0 (it slows that rank several times).
``--events`` counts, per operation on every rank, the waits' system calls (sched_yield, the
eventfd writes that wake a sleeping peer, naps on the eventfd) and the times the arena slept in
the event loop and was woken there.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from types import FrameType
from typing import Any

import numpy as np
from aiocoll.client.data._operation import HANDED_OFF

import aiocoll
from aiocoll.cli._bench_worker import pingpong  # the bench's own ping-pong

# the arena's waits, and the links' (a receive's straight spin, the loop's polling turns, a
# sender's spin for ring room and its sleep)
WAITS = {"_spin", "_sleep", "_wait_step", "_nap", "_beside", "_loop_turned", "spin", "_poll_turn", "nap"}


class Counter:
    """Opcodes, Python calls and C calls run on this thread while ``on``, waits left out."""

    def __init__(self) -> None:
        self.on = False
        self.opcodes = 0
        self.calls = 0
        self.c_calls = 0
        self.by_function: dict[str, list[int]] = {}  # "file:function" -> [opcodes, calls]
        self._waiting: FrameType | None = None  # the wait frame being skipped

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.opcodes += 1
            self._entry(frame)[0] += 1
        elif event == "return" and self._waiting is frame:
            self._waiting = None
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        if not self.on or self._waiting is not None:
            return None
        if frame.f_code.co_name in WAITS:
            self._waiting = frame  # traced for its return only
            frame.f_trace_opcodes = False
            return self._local
        self.calls += 1
        self._entry(frame)[1] += 1
        frame.f_trace_opcodes = True
        return self._local

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.on and self._waiting is None and event == "c_call":
            self.c_calls += 1

    def _entry(self, frame: FrameType) -> list[int]:
        key = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
        entry = self.by_function.get(key)
        if entry is None:
            entry = self.by_function[key] = [0, 0]
        return entry

    def start(self) -> None:
        sys.settrace(self._global)
        sys.setprofile(self._profile)
        self.on = True

    def stop(self) -> None:
        self.on = False
        sys.settrace(None)
        sys.setprofile(None)

    def report(self, ops: int, top: int) -> str:
        lines = [
            f"per operation: {self.opcodes / ops:.0f} opcodes, {self.calls / ops:.1f} Python calls, "
            f"{self.c_calls / ops:.1f} C calls (waits left out)"
        ]
        by_file: dict[str, int] = {}
        for key, (opcodes, _) in self.by_function.items():
            name = key.split(":")[0]
            by_file[name] = by_file.get(name, 0) + opcodes
        ranked = sorted(by_file.items(), key=lambda kv: -kv[1])
        lines.append("  opcodes by file: " + ", ".join(f"{f} {n / ops:.0f}" for f, n in ranked))
        for key, (opcodes, calls) in sorted(self.by_function.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {opcodes / ops:7.1f} opcodes {calls / ops:5.2f} calls  {key}")
        return "\n".join(lines)


class Events:
    """Counts what the waits cost in system calls and loop turns while ``on`` (see --events)."""

    def __init__(self) -> None:
        self.counts = {"sched_yield": 0, "eventfd_write": 0, "select": 0}
        self.on = False
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str, key: str) -> None:
        real = getattr(owner, name)
        counts = self.counts

        def counted(*a: Any, **k: Any) -> Any:
            counts[key] += 1
            return real(*a, **k)

        self._saved.append((owner, name, real))
        setattr(owner, name, counted)

    def start(self) -> None:
        import select

        self._wrap(os, "sched_yield", "sched_yield")
        self._wrap(os, "eventfd_write", "eventfd_write")
        self._wrap(select, "select", "select")
        self.on = True

    def stop(self) -> None:
        self.on = False
        for owner, name, real in self._saved:
            setattr(owner, name, real)

    def report(self, ops: int) -> str:
        return ", ".join(f"{v / ops:.2f} {k}" for k, v in self.counts.items()) + " per operation"


async def recorder_ab(pg: Any, x: np.ndarray, blocks: int, ops: int) -> None:
    """Alternate blocks of ``ops`` operations with the recorder's call sites on and off."""
    engine = pg._rt.engine
    sites = engine._sites  # the call sites the recorder takes (None: it is off)
    if sites is None:
        raise SystemExit("op_cost.py --recorder: the recorder is off (AIOCOLL_FLIGHT_RECORDER=0)")
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for block in range(2 * blocks):
        on = block % 4 in (0, 3)  # on, off, off, on: neither goes first more often
        engine._sites = sites if on else None
        await pg.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(ops):
            await pg.all_reduce(x)
        times[on].append(((time.perf_counter() - t0) / ops * 1e6, (time.process_time() - c0) / ops * 1e6))
    engine._sites = sites

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    for name, pick in (("medians", median), ("minima", min)):
        on_wall, off_wall = pick([w for w, _ in times[True]]), pick([w for w, _ in times[False]])
        on_cpu, off_cpu = pick([c for _, c in times[True]]), pick([c for _, c in times[False]])
        print(
            f"rank {pg.rank}: recorder on {on_wall:.2f} us/op wall, {on_cpu:.2f} CPU; "
            f"off {off_wall:.2f} wall, {off_cpu:.2f} CPU; "
            f"on/off {on_wall / off_wall:.4f} wall, {on_cpu / off_cpu:.4f} CPU "
            f"({name} of {blocks} blocks of {ops} each way)",
            flush=True,
        )
    # The recorder's own lines, timed without the rest of the operation (whose waits for the other
    # rank vary by more than the recorder costs): Engine.submit_eager of an all_reduce that
    # completes inside its starter, on a group of this rank alone, with the call sites taken and
    # not, in alternating blocks.
    group = engine.group(f"op-cost-{pg.rank}", (engine.rank,))
    signature = {"kind": "all_reduce", "dtype": "float32", "count": 1, "op": "sum"}
    calls = 20000
    opens: dict[bool, list[float]] = {True: [], False: []}
    for block in range(2 * blocks):
        on = block % 4 in (0, 3)
        engine._sites = sites if on else None
        t0 = time.perf_counter()
        for _ in range(calls):
            engine.submit_eager(
                group, "all_reduce", _at_once, timeout=None, signature=signature, retire=False
            )
        opens[on].append((time.perf_counter() - t0) / calls * 1e9)
    engine._sites = sites
    on_ns, off_ns = min(opens[True]), min(opens[False])
    op_ns = min(w for w, _ in times[False]) * 1e3
    print(
        f"rank {pg.rank}: Engine.submit_eager {on_ns:.0f} ns with call sites, {off_ns:.0f} ns without: "
        f"{on_ns - off_ns:.0f} ns, {(on_ns - off_ns) / op_ns:.2%} of this run's 4-byte all_reduce "
        f"({op_ns / 1e3:.2f} us, minima of {blocks} blocks each way)",
        flush=True,
    )


def _at_once(tag: Any, transport: Any, finish: Any) -> Any:
    """The starter of an operation that completes inside it, having done nothing."""
    finish(None, None)
    return HANDED_OFF


async def main(args: argparse.Namespace) -> None:
    async with await aiocoll.init_process_group() as pg:
        x = np.zeros(args.count_elements, dtype=np.float32)
        step = pingpong(pg, x, pg.rank) if args.op == "sendrecv" else (lambda: pg.all_reduce(x))
        for _ in range(args.warmup):
            await step()
        await pg.barrier()
        if args.recorder:
            await recorder_ab(pg, x, args.blocks, args.ops // (2 * args.blocks))
            await pg.barrier()
            return
        shm = pg._providers.arena
        sleeps = shm.sleeps if shm is not None else 0
        woken = shm._waker.wakeups if shm is not None else 0
        lead = pg.rank == 0
        profile = cProfile.Profile() if lead and args.profile else None
        counter = Counter() if lead and args.count else None
        events = Events() if args.events else None
        ops = args.trace_ops if args.count else args.ops  # the same on every rank
        t0, c0 = time.perf_counter(), time.process_time()
        if profile is not None:
            profile.enable()
        if counter is not None:
            counter.start()
        if events is not None:
            events.start()
        for _ in range(ops):
            await step()
        if counter is not None:
            counter.stop()
        if events is not None:
            events.stop()
        if profile is not None:
            profile.disable()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        slept = (shm.sleeps - sleeps) * 1000 / ops if shm is not None else 0.0
        path = "shm" if shm is not None else "links"
        if args.op == "sendrecv":
            print(
                f"rank {pg.rank}: {wall / ops / 2 * 1e6:.1f} us one way wall, {cpu / ops * 1e6:.1f} us CPU "
                f"per round trip ({ops} ping-pongs of {x.nbytes} B)",
                flush=True,
            )
        else:
            print(
                f"rank {pg.rank}: {wall / ops * 1e6:.1f} us/op wall, {cpu / ops * 1e6:.1f} us/op CPU "
                f"({ops} all_reduces of {x.nbytes} B over {path}, {slept:.1f} sleeps per 1000)",
                flush=True,
            )
        if counter is not None:
            print(counter.report(ops, args.top), flush=True)
        if events is not None:
            woke = (shm._waker.wakeups - woken) / ops if shm is not None else 0.0
            print(f"rank {pg.rank}: {events.report(ops)}; {woke:.2f} loop wake-ups", flush=True)
        if profile is not None:
            pstats.Stats(profile).sort_stats(args.profile).print_stats(args.top)
        await pg.barrier()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add = parser.add_argument
    add("--ops", type=int, default=20000, help="timed operations (default 20000)")
    add("--warmup", type=int, default=500, help="untimed operations first (default 500)")
    add("--elements", dest="count_elements", type=int, default=1, help="float32 elements (default 1)")
    add("--op", choices=("all_reduce", "sendrecv"), default="all_reduce", help="default all_reduce")
    add("--count", action="store_true", help="count opcodes and calls per operation on rank 0")
    add("--trace-ops", type=int, default=300, help="operations timed and traced with --count (default 300)")
    add("--events", action="store_true", help="count yields, wake-ups and loop turns per operation")
    add("--profile", metavar="SORT", help="cProfile rank 0, sorted by SORT (tottime, cumulative)")
    add("--recorder", action="store_true", help="time the flight recorder on vs off, alternately")
    add("--blocks", type=int, default=20, help="blocks each way with --recorder (default 20)")
    add("--top", type=int, default=40, help="lines of --count and --profile detail (default 40)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    aiocoll.run(main(parse()))
