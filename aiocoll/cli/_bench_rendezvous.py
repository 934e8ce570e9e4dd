"""`aiocoll bench --op rendezvous`: the coordinator's rendezvous against torch's TCPStore, and
the simulated-hosts mode (100,000 ranks, probing the coordinator's answers meanwhile).

Rendezvous: N processes are started and made ready (imports done, nothing connected), then
released at one instant; the time reported is from that instant until the last process knows
every member's address. aiocoll's processes connect a worker session and ``join``; torch's
processes follow the store-based pattern of c10d (a counter every process increments), made
equivalent: each connects a TCPStore client, sets its address under ``addr/RANK``, adds 1 to a
counter, the one that brings it to N sets ``complete``, everyone waits for ``complete`` and then
reads all N addresses with one multi_get. Both end with the same knowledge: the member table.

Processes for each implementation are forked from a launcher process that has imported only that
implementation (aiocoll's never import torch), so start-up costs stay outside the measurement
and 256 processes fit in memory. Imports only the standard library at module level.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import statistics
import sys
import time
import traceback
from typing import Any

from ._bench_common import (
    bench_meta,
    parse_int_list,
    print_table,
    resolve_loop,
    run_loop,
    utc_now,
    write_json,
)
from ._bench_servers import (
    process_cpu_seconds,
    quiet_logs,
    raise_fd_limit,
    start_coordinator,
    start_tcpstore,
)
from ._bench_store import StoreBenchError, need_torch

__all__ = ["run_rendezvous"]


# --------------------------------------------------------------------------------------------
# rendezvous: a launcher per implementation forks the participants


def _aiocoll_participant(
    ranks: list[int],
    world_size: int,
    port: int,
    token: str,
    job: str,
    timeout: float,
    loop_kind: str,
    warm: bool,
    go: Any,
    release: Any,
    results: Any,
    per_host: int = 1,
) -> None:
    from aiocoll.client.control.session import CoordinatorSession

    async def connect(rank: int) -> Any:
        return await CoordinatorSession.connect(
            "127.0.0.1", port, token=token, job=job, role="worker", timeout=timeout
        )

    async def join(rank: int, session: Any) -> Any:
        if session is None:
            session = await connect(rank)
        # the advertised peer address is never dialled in this benchmark; only the table matters
        await session.join(rank, world_size, [("127.0.0.1", 20000 + rank % 40000)], "bench-host", timeout)
        return session

    async def join_host(host_ranks: list[int], session: Any) -> Any:
        # A host's ranks over one connection, as a node agent carries them: its ranks and
        # sessions come back; the addresses of the ring neighbours are read as a table slice.
        if session is None:
            session = await connect(host_ranks[0])
        addrs = [[("127.0.0.1", 20000 + r % 40000)] for r in host_ranks]
        await session.join_host(host_ranks, world_size, addrs, f"bench-host-{host_ranks[0]}", timeout)
        first, end = max(0, host_ranks[0] - 1), min(world_size, host_ranks[-1] + 2)
        await session.table_rows(first, end)
        return session

    async def main() -> None:
        loop = asyncio.get_running_loop()
        hosts = [ranks[i : i + per_host] for i in range(0, len(ranks), per_host)]
        early: list[Any] = [None] * len(hosts)
        if warm:
            early = list(await asyncio.gather(*(connect(host[0]) for host in hosts)))
        # Sessions stay up until every process is done, as a real job's would: a thread waits for
        # the release meanwhile, started before the clock. Started after its join, it was the
        # harness's cost inside the measured time (a thread and an executor in each process while
        # the others were still joining), which torch's participants, blocking, do not pay.
        released = loop.run_in_executor(None, release.wait, timeout)
        results.put(("ready", os.getpid()))
        # Blocking on purpose, as torch's participants do: a thread hop here would be the
        # harness's cost, not aiocoll's. Nothing needs the loop before joining (no heartbeats).
        go.wait()
        began = os.times()
        if per_host == 1:
            sessions = await asyncio.gather(*(join(h[0], s) for h, s in zip(hosts, early, strict=True)))
        else:
            sessions = await asyncio.gather(*(join_host(h, s) for h, s in zip(hosts, early, strict=True)))
        ended = os.times()
        cpu = ended.user - began.user + ended.system - began.system
        results.put(("done", time.monotonic(), cpu))
        await released
        await asyncio.gather(*(session.aclose() for session in sessions), return_exceptions=True)

    try:
        run_loop(main(), loop_kind)
    except BaseException as exc:
        results.put(
            (
                "error",
                f"aiocoll ranks {ranks[0]}..{ranks[-1]}: {type(exc).__name__}: {exc}",
                traceback.format_exc(),
            )
        )


def _tcpstore_participant(
    ranks: list[int],
    world_size: int,
    port: int,
    prefix: str,
    timeout: float,
    warm: bool,
    go: Any,
    release: Any,
    results: Any,
) -> None:
    try:
        import datetime

        from torch.distributed import TCPStore

        if len(ranks) != 1:
            raise ValueError("the TCPStore rendezvous runs one rank per process")
        rank = ranks[0]

        def connect() -> Any:
            return TCPStore(
                "127.0.0.1",
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout),
            )

        store = connect() if warm else None
        results.put(("ready", os.getpid()))
        go.wait()
        if store is None:
            store = connect()
        store.set(f"{prefix}/addr/{rank}", f"127.0.0.1:{20000 + rank % 40000}@bench-host")
        if store.add(f"{prefix}/count", 1) == world_size:
            store.set(f"{prefix}/complete", "1")
        store.wait([f"{prefix}/complete"])
        table = store.multi_get([f"{prefix}/addr/{r}" for r in range(world_size)])
        if len(table) != world_size:
            raise RuntimeError(f"TCPStore rendezvous read {len(table)} addresses, expected {world_size}")
        results.put(("done", time.monotonic()))
        release.wait(timeout)
        del store
    except BaseException as exc:
        results.put(
            ("error", f"TCPStore rank {ranks[0]}: {type(exc).__name__}: {exc}", traceback.format_exc())
        )


def _collect(
    results: Any, expected: int, timeout: float, children: list[Any], errors: list[str]
) -> list[tuple[Any, ...]]:
    """Gather ``expected`` messages from the participants, each without its kind; an error, a
    dead child or the timeout stops it."""
    import queue

    values: list[tuple[Any, ...]] = []
    deadline = time.monotonic() + timeout
    while len(values) < expected:
        try:
            kind, value, *rest = results.get(timeout=1.0)
        except queue.Empty:
            dead = [c for c in children if c.exitcode not in (None, 0)]
            if dead:
                errors.append(f"a participant exited with code {dead[0].exitcode} (out of memory or killed?)")
                return values
            if time.monotonic() > deadline:
                errors.append(
                    f"{expected - len(values)} of {expected} participants did not answer "
                    f"within {timeout:.0f} s"
                )
                return values
            continue
        if kind == "error":
            errors.append(value)
            return values
        values.append((value, *rest))
    return values


@dataclasses.dataclass(frozen=True)
class RendezvousRun:
    """One timed rendezvous: ``procs`` processes of ``impl`` sharing ``ranks`` ranks, ``per_host``
    of them over each connection, at CPU priority ``nice`` (0: as the coordinator's)."""

    impl: str
    procs: int
    ranks: int
    port: int
    token: str
    timeout: float
    loop_kind: str
    verbose: bool
    warm: bool
    per_host: int = 1
    nice: int = 0
    coordinator_pid: int | None = None


@dataclasses.dataclass(frozen=True)
class RendezvousTime:
    """One timed rendezvous's wall time, and the CPU time spent in it (from the release until
    the last participant held its table) by the coordinator and by all participants together,
    where known (aiocoll's participants and a coordinator whose /proc is readable)."""

    seconds: float
    coordinator_cpu: float | None = None
    participants_cpu: float | None = None


def _rendezvous_launcher(conn: multiprocessing.connection.Connection, run: RendezvousRun, job: str) -> None:
    """Import one implementation, fork the participants, release them at once, report the time."""
    impl, procs, ranks, port, token, timeout = (
        run.impl,
        run.procs,
        run.ranks,
        run.port,
        run.token,
        run.timeout,
    )
    verbose, loop_kind, warm, per_host = run.verbose, run.loop_kind, run.warm, run.per_host
    if run.nice:
        os.nice(run.nice)  # the participants inherit it
    raise_fd_limit()
    quiet_logs(verbose)  # inherited by every forked participant
    if not verbose:
        # torch's C++ warnings (one per client that retried its connect) would bury the table
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        if impl == "aiocoll":
            import aiocoll.client.control.session  # noqa: F401  (imported once, shared by every fork)

            target: Any = _aiocoll_participant
        else:
            import torch.distributed  # noqa: F401

            target = _tcpstore_participant
        ctx = multiprocessing.get_context("fork")
        go, release, results = ctx.Event(), ctx.Event(), ctx.Queue()
        world_size = ranks  # the ranks of all processes, split as evenly as they go
        children = []
        for p in range(procs):
            mine = list(range(p * world_size // procs, (p + 1) * world_size // procs))
            if impl == "aiocoll":
                args: tuple[Any, ...] = (mine, world_size, port, token, job, timeout, loop_kind, warm)
                extra: tuple[Any, ...] = (per_host,)
            else:
                args = (mine, world_size, port, job, timeout, warm)
                extra = ()
            child = ctx.Process(target=target, args=(*args, go, release, results, *extra), daemon=True)
            child.start()
            children.append(child)
        errors: list[str] = []
        _collect(results, procs, timeout, children, errors)
        if errors:
            conn.send(("error", errors[0]))
        else:
            conn.send(("ready",))
            conn.recv()
            cpu_before = process_cpu_seconds(run.coordinator_pid)
            begin = time.monotonic()
            go.set()
            done = _collect(results, procs, timeout, children, errors)
            cpu_after = process_cpu_seconds(run.coordinator_pid)
            last = max([begin, *(d[0] for d in done)])
            if errors:
                conn.send(("error", errors[0]))
            else:
                coordinator_cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
                spent = [d[1] for d in done if len(d) > 1]
                participants_cpu = sum(spent) if len(spent) == len(done) else None
                conn.send(("time", RendezvousTime(last - begin, coordinator_cpu, participants_cpu)))
        release.set()
        go.set()
        deadline = time.monotonic() + 30
        for child in children:
            child.join(max(0.1, deadline - time.monotonic()))
        for child in children:
            if child.is_alive():
                child.kill()
                child.join(2)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{impl} launcher: {type(exc).__name__}: {exc}"))


def _measure_rendezvous(run: RendezvousRun) -> RendezvousTime:
    impl, ranks, timeout = run.impl, run.ranks, run.timeout
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    job = f"rdzv-{secrets.token_hex(4)}"
    launcher = ctx.Process(
        target=_rendezvous_launcher,
        args=(child_conn, run, job),
        name=f"{impl}-rendezvous-launcher",
        daemon=False,  # it forks the participants, which daemonic processes may not do
    )
    launcher.start()
    child_conn.close()
    try:
        for stage in ("ready", "time"):
            if not parent_conn.poll(timeout + 30):
                raise StoreBenchError(f"{impl} rendezvous of {ranks}: no {stage} within {timeout:.0f} s")
            try:
                message = parent_conn.recv()
            except EOFError:
                raise StoreBenchError(
                    f"{impl} rendezvous launcher exited (code {launcher.exitcode})"
                ) from None
            if message[0] == "error":
                raise StoreBenchError(f"{impl} rendezvous of {ranks} failed: {message[1]}")
            if stage == "ready":
                parent_conn.send("go")
        result: RendezvousTime = message[1]
        return result
    finally:
        launcher.join(60)
        if launcher.is_alive():
            launcher.kill()
            launcher.join(5)


# The CPU priority of simulated hosts, below the coordinator's and the probe's.
SIMULATED_NICE = 10


def listen_overflows() -> int | None:
    """This machine's count of connections its listen queues dropped (TcpExt ListenOverflows),
    or None where the kernel does not say."""
    try:
        with open("/proc/net/netstat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            fields = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            count = fields.get("ListenOverflows")
            return int(count) if count is not None else None
    return None


def somaxconn() -> str:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _difference(after: int | None, before: int | None) -> int | None:
    return None if after is None or before is None else after - before


# File descriptors a coordinator keeps for itself (listeners, files, HTTP); the rest are connections.
_COORDINATOR_DESCRIPTORS = 96


def _check_descriptors(ranks: int, per_host: int, procs: int) -> None:
    """Refuse up front a simulation this machine's open-file limit cannot hold: one connection
    per host to the one coordinator process, and each simulating process holds its hosts'.

    Raises:
        StoreBenchError: naming the numbers and what to change.
    """
    import resource

    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if limit == resource.RLIM_INFINITY:
        return
    hosts = math.ceil(ranks / per_host)
    if hosts + _COORDINATOR_DESCRIPTORS > limit:
        fit = (limit - _COORDINATOR_DESCRIPTORS) * per_host
        raise StoreBenchError(
            f"--simulated {ranks} with --ranks-per-host {per_host} needs {hosts} connections to the "
            f"coordinator, and this machine lets a process hold {limit} open files (the hard limit): "
            f"use --ranks-per-host {math.ceil(ranks / (limit - _COORDINATOR_DESCRIPTORS))} or more, or at "
            f"most --simulated {fit}"
        )
    if math.ceil(hosts / procs) + 64 > limit:
        raise StoreBenchError(
            f"{math.ceil(hosts / procs)} connections per simulating process exceed the open-file limit "
            f"{limit}: raise --sim-procs"
        )


class _Probe:
    """Asks the coordinator for /healthz, /metrics and a status view in turn while a rendezvous
    runs, keeping the slowest answer of each, and samples its resident memory."""

    def __init__(self, coordinator: Any, token: str) -> None:
        import threading

        self._coordinator = coordinator
        self._token = token
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-probe", daemon=True)
        self.worst: dict[str, float] = {"/healthz": 0.0, "/metrics": 0.0, "status": 0.0}
        self.rss_peak: int | None = None

    def __enter__(self) -> _Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import urllib.request

        from aiocoll.client.control.session import CoordinatorSession

        async def status() -> None:
            session = await CoordinatorSession.connect(
                "127.0.0.1", self._coordinator.port, token=self._token, role="admin", timeout=30
            )
            try:
                await session.status()
            finally:
                await session.aclose()

        base = f"http://127.0.0.1:{self._coordinator.http_port}"
        while not self._stop.wait(0.25):
            for name in self.worst:
                began = time.monotonic()
                try:
                    if name == "status":
                        asyncio.run(status())
                    else:
                        with urllib.request.urlopen(base + name, timeout=30) as response:
                            response.read()
                except Exception:  # an answer that never came counts as the whole wait
                    pass
                self.worst[name] = max(self.worst[name], time.monotonic() - began)
            rss = self._coordinator.rss_bytes()
            if rss is not None:
                self.rss_peak = max(rss, self.rss_peak or 0)


def run_rendezvous(args: argparse.Namespace) -> int:
    """Rendezvous time for N processes (and TCPStore's equivalent), plus the simulated-clients mode.

    Raises:
        StoreBenchError: for bad arguments, a missing torch, or a rendezvous that failed or hung.
    """
    need_torch(args)
    proc_counts = parse_int_list(args.procs, name="--procs") if args.procs else []
    with_tcp = args.vs == "tcpstore"
    loop_kind = resolve_loop(args.loop)
    token = secrets.token_hex(16)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    servers: list[Any] = []
    if args.simulated:
        _check_descriptors(args.simulated, args.ranks_per_host, args.sim_procs)
    try:
        coordinator = start_coordinator(token, verbose=args.verbose, http=bool(args.simulated))
        servers.append(coordinator)
        tcp = None
        if with_tcp and proc_counts:
            tcp = start_tcpstore()
            servers.append(tcp)
        step = 0
        for count in proc_counts:
            for warm in (False, True):
                samples: dict[str, list[float]] = {"aiocoll": []}
                if tcp is not None:
                    samples["tcpstore"] = []
                for _ in range(args.rounds):
                    order = list(samples) if step % 2 == 0 else list(samples)[::-1]
                    step += 1
                    for impl in order:
                        port = coordinator.port if impl == "aiocoll" else tcp.port  # type: ignore[union-attr]
                        samples[impl].append(
                            _measure_rendezvous(
                                RendezvousRun(
                                    impl,
                                    count,
                                    count,
                                    port,
                                    token,
                                    args.timeout,
                                    loop_kind,
                                    args.verbose,
                                    warm,
                                )
                            ).seconds
                        )
                row: dict[str, Any] = {
                    "mode": "warm" if warm else "cold",
                    "processes": count,
                    "clients": count,
                }
                for impl, values in samples.items():
                    row[impl] = statistics.median(values)
                    row[f"{impl}_rounds"] = values
                if tcp is not None:
                    row["ratio"] = row["aiocoll"] / row["tcpstore"]
                rows.append(row)
                if not args.quiet:
                    sys.stderr.write(f"[bench rendezvous] {count} processes ({row['mode']}) done\n")
        if args.simulated:
            procs = args.sim_procs
            per_host = args.ranks_per_host
            ranks = args.simulated  # in all: each process takes an equal share
            values, probes, memory, cpu_coordinator, cpu_hosts = [], [], [], [], []
            overflows_before = listen_overflows()
            for _ in range(args.rounds):
                rss_before = coordinator.rss_bytes()
                with _Probe(coordinator, token) as probe:
                    measured = _measure_rendezvous(
                        RendezvousRun(
                            "aiocoll",
                            procs,
                            ranks,
                            coordinator.port,
                            token,
                            args.timeout,
                            loop_kind,
                            args.verbose,
                            warm=False,
                            per_host=per_host,
                            nice=SIMULATED_NICE,
                            coordinator_pid=coordinator.process.pid,
                        )
                    )
                values.append(measured.seconds)
                if measured.coordinator_cpu is not None:
                    cpu_coordinator.append(measured.coordinator_cpu)
                if measured.participants_cpu is not None:
                    cpu_hosts.append(measured.participants_cpu)
                probes.append(probe.worst)
                if rss_before is not None and probe.rss_peak is not None:
                    memory.append((probe.rss_peak - rss_before) / ranks)
            rows.append(
                {
                    "mode": "cold, simulated",
                    "processes": procs,
                    "clients": ranks,
                    "ranks_per_connection": per_host,
                    "aiocoll": statistics.median(values),
                    "aiocoll_rounds": values,
                    "probe_worst_s": {k: max(p[k] for p in probes) for k in probes[0]},
                    "member_bytes": statistics.median(memory) if memory else None,
                    "listen_overflows": _difference(listen_overflows(), overflows_before),
                    "coordinator_cpu_s": statistics.median(cpu_coordinator) if cpu_coordinator else None,
                    "hosts_cpu_s": statistics.median(cpu_hosts) if cpu_hosts else None,
                }
            )
            if not args.quiet:
                sys.stderr.write(f"[bench rendezvous] {ranks} simulated ranks done\n")
    finally:
        for server in servers:
            server.stop()
    print(
        f"# aiocoll bench: rendezvous time in seconds (median of {args.rounds} rounds), from the release of "
        f"ready processes until the last one holds the member table, {utc_now()}"
    )
    print(
        "# cold: connecting is part of the rendezvous; warm: every process connected before the release "
        "(only the exchange is timed)"
    )
    if with_tcp:
        print(
            "# tcpstore: connect, set addr/RANK, add(count), last sets complete, wait(complete), multi_get "
            "all addresses; ratio = aiocoll/tcpstore (lower is better)"
        )
    for r in rows:
        if "probe_worst_s" in r:
            worst = ", ".join(f"{k} {v:.3f} s" for k, v in r["probe_worst_s"].items())
            print(
                f"# simulated: {r['clients']} ranks, {r['ranks_per_connection']} per connection (a host's "
                f"ranks joined together), each host then reads its ring neighbours' rows; slowest answers "
                f"of the coordinator meanwhile: {worst}"
            )
            if r["member_bytes"] is not None:
                per_rank = r["member_bytes"]
                print(f"# simulated: coordinator memory per rank {per_rank:.0f} bytes (peak RSS growth)")
            print(
                f"# simulated: the simulated hosts run at nice +{SIMULATED_NICE} (on a real cluster they run "
                f"on other machines; here they would otherwise take the coordinator's CPU)"
            )
            coordinator_cpu, hosts_cpu = r["coordinator_cpu_s"], r["hosts_cpu_s"]
            if coordinator_cpu is not None and hosts_cpu is not None:
                hosts = math.ceil(r["clients"] / r["ranks_per_connection"])
                cores = os.cpu_count() or 1
                print(
                    f"# simulated: CPU time from the release until the last host held its rows (median): "
                    f"coordinator {coordinator_cpu:.2f} s ({coordinator_cpu / r['clients'] * 1e6:.0f} us "
                    f"per rank), simulated hosts {hosts_cpu:.2f} s ({hosts_cpu / hosts * 1e3:.2f} ms per "
                    f"host); on {cores} cores the rendezvous takes at least their sum / {cores} = "
                    f"{(coordinator_cpu + hosts_cpu) / cores:.2f} s"
                )
            if r["listen_overflows"]:
                print(
                    f"# simulated: the kernel's listen queue overflowed {r['listen_overflows']} times "
                    f"(net.core.somaxconn = {somaxconn()}): those connections waited a second or more "
                    f"for their SYN to be sent again; raise net.core.somaxconn on the coordinator's host"
                )
    headers = ["mode", "processes", "clients", "aiocoll (s)"] + (
        ["tcpstore (s)", "ratio"] if with_tcp else []
    )
    print_table(
        headers,
        [
            [r["mode"], r["processes"], r["clients"], r["aiocoll"]]
            + ([r.get("tcpstore"), r.get("ratio")] if with_tcp else [])
            for r in rows
        ],
    )
    if args.json:
        meta = bench_meta("rendezvous", started, rounds=args.rounds, vs=args.vs, loop=loop_kind)
        write_json(args.json, {"meta": meta, "results": rows})
    return 0
