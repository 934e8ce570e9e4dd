"""The coordinator's quorum with many replicas: time per quorum and the coordinator's CPU for it.

A developer's tool (docs/FAULT_TOLERANCE.md, "What it costs", quotes it); run it under the bench
lock on a shared machine:

    flock /tmp/aiocoll-bench.lock python scripts/quorum_scale.py --replicas 1000 --steps 30

Simulated replicas, as ``aiocoll bench --op rendezvous --simulated`` simulates hosts: a few
processes (``--procs``, forked from one that imported only aiocoll's client, at nice +10 below
the coordinator, on the event loop ``aiocoll.run`` gives a Manager: uvloop when installed)
each run their share of the replicas, each replica on its own coordinator connection (made and
authenticated by a ``CoordinatorSession``), asking for a quorum at each step with the request
``aiocoll.ft.Manager`` sends (the same fields), with no training between two steps: each step
is only its quorum. A replica is driven from its connection's callbacks (its reply read, its
next ask written), not through the session's request machinery (a coroutine and a future per
ask): that client-side work is each replica's own host's on a cluster, and here it would share
the coordinator's CPUs. After the first quorum (which waits for its join window) it reports,
over ``--steps`` steps:

- ``latency``: per step, from the last replica's ask to the last replica's reply (the quorum's
  own time: what the slowest replica's ``start_step`` waits beyond the others), median and worst;
- ``period``: the wall time per step of the whole loop, the simulated replicas' own work included;
- ``coordinator CPU``: the coordinator process's CPU time (user + system) per quorum;
- ``simulated replicas' CPU``: the simulating processes' CPU time per step, all together (on a
  cluster each replica's share of it runs on its own host; here it shares the machine's CPUs
  with the coordinator, and bounds the latency from below on a machine with few of them).

``--state-machine`` runs the same asks through the coordinator's state machine alone, in this
process (no sockets, no event loop: the unit tests' way), and reports its CPU time per quorum:
the quorum's own decisions and encoded replies, without reading and writing the messages.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NICE = 10


def _cpu_of(pids: list[int]) -> tuple[float, float]:
    """The CPU time of processes ``pids``, together: user, system."""
    from aiocoll.cli._bench_servers import process_cpu_times

    times = [process_cpu_times(pid) for pid in pids]
    if any(t is None for t in times):
        raise SystemExit(f"quorum_scale: /proc does not give the CPU time of processes {pids}")
    return sum(t[0] for t in times if t), sum(t[1] for t in times if t)


class _Sim:
    """One simulating process's replicas: the marks of each step, and when all are answered."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int, steps: int) -> None:
        self.count = count
        self.steps = steps
        self.marks = [[0.0, 0.0] for _ in range(steps + 1)]  # per step: the last ask, the last reply
        self.first: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.counted = 0
        self.finished = 0

    def answered(self, r: _SimReplica) -> None:
        if r.step == 1:
            self.counted += 1
            if self.counted == self.count and not self.first.done():
                self.first.set_result(None)
        elif r.step <= self.steps:
            r.ask()
        else:
            self.finished += 1
            if self.finished == self.count and not self.done.done():
                self.done.set_result(None)

    def fail(self, exc: BaseException) -> None:
        for fut in (self.first, self.done):
            if not fut.done():
                fut.set_exception(exc)


class _SimReplica(asyncio.Protocol):
    """One simulated replica on its own coordinator connection, driven from the connection's
    callbacks: it sends a Manager's quorum request and, once answered, the next step's."""

    def __init__(self, name: str, transport: asyncio.Transport, sim: _Sim, total: int, join: float) -> None:
        import msgpack

        from aiocoll.protocol import CONTROL_READ_SIZE, FrameDecoder, pack_prefix

        self.name, self.transport, self.sim = name, transport, sim
        self.total, self.join = total, join
        self.uid = secrets.token_hex(8)
        self.host = f"sim-{name}"
        self.step = 0
        self.known = 0
        self.ids = 0
        self.asked = 0.0
        # (grows for the first quorum's reply, which lists every member)
        self.decoder = FrameDecoder(
            max_header=1 << 20, max_payload=0, read_size=CONTROL_READ_SIZE, lists=True
        )
        self.pack = msgpack.Packer(use_bin_type=True).pack
        self.prefix = pack_prefix

    def ask(self) -> None:
        self.ids += 1
        step = self.step
        head = self.pack(
            {
                "replica": self.name,
                "uid": self.uid,
                "step": step,
                "ask": step + 1,
                "host": self.host,
                "min_replicas": self.total,
                "join_timeout": self.join,
                "renew": False,
                "known": self.known,  # the quorum whose group it holds, as a Manager says
                "op": "quorum",
                "timeout": 120.0,
                "id": self.ids,
            }
        )
        self.asked = time.monotonic()
        self.transport.write(self.prefix(len(head), 0) + head)

    def data_received(self, data: bytes) -> None:
        got = time.monotonic()
        try:
            for reply, _ in self.decoder.feed_messages(data):
                step = self.step
                if not (
                    reply.get("ok") is True
                    and reply["id"] == self.ids
                    and reply["max_step"] == step
                    and len(reply.get("members", ())) in (0, self.total)
                ):
                    raise RuntimeError(f"replica {self.name} at step {step} got {reply!r}")
                self.known = reply["quorum_id"]
                mark = self.sim.marks[step]
                mark[0] = max(mark[0], self.asked)
                mark[1] = max(mark[1], got)
                self.step = step + 1
                self.sim.answered(self)
        except Exception as exc:
            self.sim.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.step <= self.sim.steps:
            self.sim.fail(
                ConnectionError(f"replica {self.name} lost its connection at step {self.step}: {exc}")
            )


def _simulate(
    names: list[str], port: int, token: str, steps: int, total: int, join: float, out: Any, barrier: Any
) -> None:
    os.nice(NICE)
    from aiocoll.client.control.session import CoordinatorSession

    async def main() -> None:
        loop = asyncio.get_running_loop()
        sim = _Sim(loop, len(names), steps)
        sessions = await asyncio.gather(
            *(
                CoordinatorSession.connect(
                    "127.0.0.1", port, token=token, job="quorum-scale", role="store", timeout=120.0
                )
                for _ in names
            )
        )
        try:
            replicas = []
            for name, session in zip(names, sessions, strict=True):
                # The session made the connection and its handshake; the replica takes it over.
                link = session._keeper.link
                assert link is not None and link._transport is not None
                r = _SimReplica(name, link._transport, sim, total, join)
                link._transport.set_protocol(r)
                replicas.append(r)
            for r in replicas:
                r.ask()
            await asyncio.wait_for(
                asyncio.shield(sim.first), 300
            )  # the first quorum waits for its join window
            await loop.run_in_executor(None, barrier.wait, 300)  # the parent reads the CPU
            await loop.run_in_executor(None, barrier.wait, 300)
            for r in replicas:  # every process's replicas start step 1 together
                r.ask()
            await asyncio.wait_for(asyncio.shield(sim.done), 600)
        finally:
            for session in sessions:
                session.abort()
        out.put(("marks", sim.marks))

    from aiocoll import run

    try:
        run(main())
    except BaseException as exc:
        out.put(("error", f"{type(exc).__name__}: {exc}"))
        barrier.abort()


def _state_machine(replicas: int, steps: int) -> None:
    """The asks of ``replicas`` replicas for ``steps`` quorums through a CoordinatorState alone."""
    from aiocoll.server import CoordinatorState

    now = [1000.0]
    state = CoordinatorState(clock=lambda: now[0], heartbeat_timeout=10.0)
    names = [f"r{i:05d}" for i in range(replicas)]
    for conn in range(1, replicas + 1):
        state.connect(conn, "quorum-scale", "store", peer=f"127.0.0.1:{conn}")
    known = [0] * replicas
    asks = [0]

    def quorum(step: int) -> None:
        for i, name in enumerate(names):
            asks[0] += 1
            request = {
                "op": "quorum",
                "id": asks[0],
                "replica": name,
                "uid": f"u{i}",
                "step": step,
                "ask": step + 1,
                "host": f"sim-{name}",
                "min_replicas": replicas,
                "join_timeout": 2.0,
                "renew": False,
                "known": known[i],
                "timeout": 120.0,
            }
            state.requests(i + 1, ((request, b""),))
        if step == 0:  # the first quorum waits for its join window
            now[0] += 3.0
            state.tick()
        replies = state.outbox
        assert len(replies) == replicas, len(replies)
        if step < 2:
            for conn, header, _ in replies:
                known[conn - 1] = header.decode()["quorum_id"]
        state.outbox = []

    for step in range(2):
        quorum(step)
    began = time.process_time()
    for step in range(2, steps + 2):
        quorum(step)
    per = (time.process_time() - began) / steps
    load = os.getloadavg()[0]
    print(f"quorum_scale --state-machine: {replicas} replicas, {steps} quorums; load {load:.1f}")
    print(f"  state machine CPU per quorum: {per * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--procs", type=int, default=4, help="simulating processes (default 4)")
    parser.add_argument("--join", type=float, default=2.0, help="the join window of the first quorum")
    parser.add_argument(
        "--state-dir",
        default=None,
        help="run the coordinator durable in this directory (each quorum's record is on disk before "
        "its replies go out)",
    )
    parser.add_argument(
        "--state-machine",
        action="store_true",
        help="the coordinator's state machine alone, in this process: its CPU per quorum",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.state_machine:
        _state_machine(args.replicas, args.steps)
        return
    from aiocoll.cli._bench_servers import quiet_logs, raise_fd_limit, start_coordinator

    raise_fd_limit()
    quiet_logs(False)
    import aiocoll.client.control.session  # noqa: F401  (imported once, shared by every fork)

    token = secrets.token_hex(16)
    coordinator = start_coordinator(token, state_dir=args.state_dir)
    try:
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        barrier = ctx.Barrier(args.procs + 1)
        names = [f"r{i:05d}" for i in range(args.replicas)]
        share = [names[p :: args.procs] for p in range(args.procs)]
        procs = [
            ctx.Process(
                target=_simulate,
                args=(mine, coordinator.port, token, args.steps, args.replicas, args.join, out, barrier),
                daemon=True,
            )
            for mine in share
        ]
        for p in procs:
            p.start()
        # the coordinator's CPU from the end of the first quorum to the end of the last
        barrier.wait(600)
        coordinator_pid, sim_pids = int(coordinator.process.pid or 0), [int(p.pid or 0) for p in procs]
        cpu_start, sim_start = _cpu_of([coordinator_pid]), _cpu_of(sim_pids)
        barrier.wait(60)
        results: list[Any] = []
        while len(results) < len(procs):
            kind, value = out.get(timeout=600)
            if kind == "error":
                raise SystemExit(f"quorum_scale: a simulating process failed: {value}")
            results.append(value)
        cpu_end, sim_end = _cpu_of([coordinator_pid]), _cpu_of(sim_pids)
        for p in procs:
            p.join(30)
    finally:
        coordinator.stop()
    marks = [[max(r[s][0] for r in results), max(r[s][1] for r in results)] for s in range(args.steps + 1)]
    latency = [marks[s][1] - marks[s][0] for s in range(1, args.steps + 1)]
    period = (marks[-1][1] - marks[0][1]) / args.steps
    load = os.getloadavg()[0]
    print(
        f"quorum_scale: {args.replicas} simulated replicas over {args.procs} processes (nice +{NICE}), "
        f"{args.steps} steps after the first quorum; load {load:.1f} on {os.cpu_count()} CPUs"
        + (f"; durable in {args.state_dir}" if args.state_dir else "")
    )
    print(
        f"  latency (last ask -> last reply): median {statistics.median(latency) * 1e3:.1f} ms, "
        f"worst {max(latency) * 1e3:.1f} ms"
    )
    print(f"  period per step (simulated replicas' work included): {period * 1e3:.1f} ms")
    for what, start, end in (
        ("coordinator CPU per quorum", cpu_start, cpu_end),
        ("simulated replicas' CPU per step, all processes", sim_start, sim_end),
    ):
        user, system = ((end[i] - start[i]) / args.steps * 1e3 for i in (0, 1))
        print(f"  {what}: {user + system:.1f} ms (user {user:.1f} + system {system:.1f})")


if __name__ == "__main__":
    main()
