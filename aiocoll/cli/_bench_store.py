"""`aiocoll bench --op store` and `--op rendezvous`: the coordinator against torch's TCPStore.

Store throughput: C client processes per implementation (each holding one connection) run
``--store-ops`` sequential set, get or add operations from a common start instant; throughput is
the total number of operations over the time from that instant until the last client finished.
Implementations alternate which goes first, round after round, so slow drift in the machine's
load falls on both; the median round is reported.

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
import importlib.util
import math
import multiprocessing
import multiprocessing.connection
import os
import secrets
import statistics
import sys
import tempfile
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
from ._bench_servers import quiet_logs, raise_fd_limit, start_coordinator, start_tcpstore

__all__ = ["run_rendezvous", "run_store"]

STORE_OPS = ("set", "get", "add")
_KEYS_PER_CLIENT = 64


class StoreBenchError(RuntimeError):
    """The store or rendezvous benchmark could not complete; the message says why."""


def _need_torch(args: argparse.Namespace) -> None:
    if args.vs == "tcpstore" and importlib.util.find_spec("torch") is None:
        raise StoreBenchError(
            "--vs tcpstore needs torch (its TCPStore is the baseline): pip install 'aiocoll[torch]', "
            "or drop --vs tcpstore"
        )
    if args.vs not in (None, "tcpstore"):
        raise StoreBenchError(f"--op {args.op} compares with --vs tcpstore, not --vs {args.vs}")


# --------------------------------------------------------------------------------------------
# store throughput: client processes


def _aiocoll_store_client(
    conn: multiprocessing.connection.Connection,
    cid: int,
    port: int,
    token: str,
    job: str,
    value_size: int,
    loop_kind: str,
    verbose: bool,
    pipeline_sets: bool = True,
) -> None:
    quiet_logs(verbose)

    async def main() -> None:
        import aiocoll

        store = await aiocoll.connect_store(
            f"tcp://127.0.0.1:{port}", token=token, job=job, timeout=120.0, pipeline_sets=pipeline_sets
        )
        value = b"v" * value_size
        keys = [f"c{cid}/k{i}" for i in range(_KEYS_PER_CLIENT)]
        for key in keys:
            await store.set(key, value)
        counter = f"c{cid}/ctr"
        conn.send("ready")
        loop = asyncio.get_running_loop()
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command[0] == "stop":
                break
            _, op, count, start_at = command
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))
            begin = time.monotonic()
            if op == "set":
                for i in range(count):
                    await store.set(keys[i % _KEYS_PER_CLIENT], value)
                await store.flush()  # every set acknowledged before the clock stops
            elif op == "get":
                for i in range(count):
                    await store.get(keys[i % _KEYS_PER_CLIENT])
            else:
                for _ in range(count):
                    await store.add(counter, 1)
            conn.send((begin, time.monotonic()))
        await store.aclose()

    try:
        run_loop(main(), loop_kind)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(
                ("error", f"aiocoll store client {cid}: {type(exc).__name__}: {exc}", traceback.format_exc())
            )


def _tcpstore_client(
    conn: multiprocessing.connection.Connection,
    cid: int,
    port: int,
    value_size: int,
    token: str | None = None,
    job: str | None = None,
    verbose: bool = False,
) -> None:
    """A client of torch's TCPStore, or (with a token) of aiocoll's coordinator through
    ``aiocoll.sync.TCPStore``, the class a torch user swaps in: the same loop either way."""
    try:
        import datetime

        store: Any
        if token is None:
            from torch.distributed import TCPStore

            store = TCPStore(
                "127.0.0.1",
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=120),
            )
        else:
            quiet_logs(verbose)
            from aiocoll import sync

            store = sync.TCPStore(
                "127.0.0.1",
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=120),
                token=token,
                job=job,
            )
        value = "v" * value_size
        keys = [f"c{cid}/k{i}" for i in range(_KEYS_PER_CLIENT)]
        for key in keys:
            store.set(key, value)
        counter = f"c{cid}/ctr"
        conn.send("ready")
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            _, op, count, start_at = command
            time.sleep(max(0.0, start_at - time.monotonic()))
            begin = time.monotonic()
            if op == "set":
                for i in range(count):
                    store.set(keys[i % _KEYS_PER_CLIENT], value)
                if token is not None:
                    store.flush()  # aiocoll's: every set acknowledged before the clock stops
            elif op == "get":
                for i in range(count):
                    store.get(keys[i % _KEYS_PER_CLIENT])
            else:
                for _ in range(count):
                    store.add(counter, 1)
            conn.send((begin, time.monotonic()))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            name = "TCPStore" if token is None else "aiocoll.sync.TCPStore"
            conn.send(("error", f"{name} client {cid}: {type(exc).__name__}: {exc}", traceback.format_exc()))


class _ClientPool:
    """Client processes of one implementation, driven over pipes."""

    def __init__(self, impl: str, conns: list[multiprocessing.connection.Connection], procs: list[Any]):
        self.impl = impl
        self.conns = conns
        self.procs = procs

    def _recv(self, index: int, timeout: float) -> Any:
        conn = self.conns[index]
        if not conn.poll(timeout):
            raise StoreBenchError(f"{self.impl} client {index} did not answer within {timeout:.0f} s")
        try:
            message = conn.recv()
        except EOFError:
            raise StoreBenchError(
                f"{self.impl} client {index} exited (code {self.procs[index].exitcode}) unexpectedly"
            ) from None
        if isinstance(message, tuple) and message and message[0] == "error":
            sys.stderr.write(message[2])
            raise StoreBenchError(message[1])
        return message

    def wait_ready(self, timeout: float) -> None:
        for index in range(len(self.conns)):
            self._recv(index, timeout)

    def run(self, op: str, clients: int, count: int, timeout: float) -> float:
        """Run ``op`` on the first ``clients`` clients at once; returns operations per second."""
        start_at = time.monotonic() + 0.05
        for conn in self.conns[:clients]:
            conn.send(("run", op, count, start_at))
        ends = [self._recv(i, timeout)[1] for i in range(clients)]
        elapsed = max(ends) - start_at
        return clients * count / elapsed if elapsed > 0 else math.inf

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)


def _start_pool(impl: str, count: int, target: Any, extra: tuple[Any, ...]) -> _ClientPool:
    ctx = multiprocessing.get_context("spawn")
    conns, procs = [], []
    for cid in range(count):
        parent_conn, child_conn = ctx.Pipe()
        proc = ctx.Process(
            target=target, args=(child_conn, cid, *extra), name=f"{impl}-client-{cid}", daemon=True
        )
        proc.start()
        child_conn.close()
        conns.append(parent_conn)
        procs.append(proc)
    return _ClientPool(impl, conns, procs)


def run_store(args: argparse.Namespace) -> int:
    """Store throughput of aiocoll's coordinator from its async store and from the blocking
    ``aiocoll.sync.TCPStore`` (and torch's TCPStore with --vs tcpstore); prints a table.

    Raises:
        StoreBenchError: for bad arguments, a missing torch, or a client that failed or hung.
    """
    _need_torch(args)
    clients_list = parse_int_list(args.clients, name="--clients")
    with_tcp = args.vs == "tcpstore"
    loop_kind = resolve_loop(args.loop)
    token = secrets.token_hex(16)
    servers: list[Any] = []
    pools: list[_ClientPool] = []
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    state_dir = tempfile.TemporaryDirectory(prefix="aiocoll-bench-state-") if args.state_dir else None
    try:
        coordinator = start_coordinator(
            token, verbose=args.verbose, state_dir=None if state_dir is None else state_dir.name
        )
        servers.append(coordinator)
        most = max(clients_list)
        job = f"bench-store-{secrets.token_hex(4)}"
        pipelined = not args.acked_sets
        pools.append(
            _start_pool(
                "aiocoll",
                most,
                _aiocoll_store_client,
                (coordinator.port, token, job, args.value_size, loop_kind, args.verbose, pipelined),
            )
        )
        pools.append(
            _start_pool(
                "aiocoll.sync",
                most,
                _tcpstore_client,
                (coordinator.port, args.value_size, token, job + "-sync", args.verbose),
            )
        )
        if with_tcp:
            tcp = start_tcpstore()
            servers.append(tcp)
            pools.append(_start_pool("tcpstore", most, _tcpstore_client, (tcp.port, args.value_size)))
        for pool in pools:
            pool.wait_ready(args.timeout)
        step = 0
        for clients in clients_list:
            for op in STORE_OPS:
                samples: dict[str, list[float]] = {pool.impl: [] for pool in pools}
                for _ in range(args.rounds):
                    order = pools[step % len(pools) :] + pools[: step % len(pools)]
                    step += 1
                    for pool in order:
                        samples[pool.impl].append(pool.run(op, clients, args.store_ops, args.timeout))
                row: dict[str, Any] = {"clients": clients, "op": op}
                for impl, values in samples.items():
                    row[impl] = statistics.median(values)
                    row[f"{impl}_rounds"] = values
                if with_tcp:
                    row["ratio"] = row["aiocoll"] / row["tcpstore"]
                    row["ratio_sync"] = row["aiocoll.sync"] / row["tcpstore"]
                rows.append(row)
                if not args.quiet:
                    sys.stderr.write(f"[bench store] {clients} client(s) {op} done\n")
    finally:
        for pool in pools:
            pool.close()
        for server in servers:
            server.stop()
        if state_dir is not None:
            state_dir.cleanup()
    print(
        f"# aiocoll bench: store operations per second (median of {args.rounds} rounds), "
        f"{args.store_ops} sequential ops per client, {args.value_size}-byte values, {utc_now()}"
    )
    print(
        "# each client is its own process with one connection; aiocoll = the async store "
        "(aiocoll.connect_store), aiocoll.sync = aiocoll.sync.TCPStore; ratio = aiocoll/tcpstore "
        "(higher is better)"
    )
    if args.acked_sets:
        print("# aiocoll's async sets wait for their acknowledgement (--acked-sets)")
    else:
        print("# aiocoll's sets are not answered (as TCPStore's); each timed set loop ends with a flush")
    if args.state_dir:
        print("# aiocoll's coordinator runs with --state-dir: on disk before acknowledged or seen")
    headers = ["clients", "op", "aiocoll ops/s", "aiocoll.sync ops/s"] + (
        ["tcpstore ops/s", "ratio", "ratio sync"] if with_tcp else []
    )
    print_table(
        headers,
        [
            [r["clients"], r["op"], r["aiocoll"], r["aiocoll.sync"]]
            + ([r["tcpstore"], r["ratio"], r["ratio_sync"]] if with_tcp else [])
            for r in rows
        ],
    )
    if args.json:
        meta = bench_meta(
            "store",
            started,
            store_ops=args.store_ops,
            rounds=args.rounds,
            value_size=args.value_size,
            pipeline_sets=not args.acked_sets,
            state_dir=bool(args.state_dir),
            vs=args.vs,
            loop=loop_kind,
        )
        write_json(args.json, {"meta": meta, "results": rows})
    return 0


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
    from aiocoll.client.session import CoordinatorSession

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
        results.put(("ready", os.getpid()))
        # Blocking on purpose, as torch's participants do: a thread hop here would be the
        # harness's cost, not aiocoll's. Nothing needs the loop before joining (no heartbeats).
        go.wait()
        if per_host == 1:
            sessions = await asyncio.gather(*(join(h[0], s) for h, s in zip(hosts, early, strict=True)))
        else:
            sessions = await asyncio.gather(*(join_host(h, s) for h, s in zip(hosts, early, strict=True)))
        results.put(("done", time.monotonic()))
        # sessions stay up until every process is done, as a real job's would
        await loop.run_in_executor(None, release.wait, timeout)
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
) -> list[Any]:
    """Gather ``expected`` messages from the participants; an error, a dead child or the timeout stops it."""
    import queue

    values: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(values) < expected:
        try:
            kind, value, *_ = results.get(timeout=1.0)
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
        values.append(value)
    return values


def _rendezvous_launcher(
    conn: multiprocessing.connection.Connection,
    impl: str,
    procs: int,
    ranks: int,
    port: int,
    token: str,
    job: str,
    timeout: float,
    loop_kind: str,
    verbose: bool,
    warm: bool,
    per_host: int = 1,
) -> None:
    """Import one implementation, fork the participants, release them at once, report the time."""
    raise_fd_limit()
    quiet_logs(verbose)  # inherited by every forked participant
    if not verbose:
        # torch's C++ warnings (one per client that retried its connect) would bury the table
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        if impl == "aiocoll":
            import aiocoll.client.session  # noqa: F401  (imported once, shared by every fork)

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
            begin = time.monotonic()
            go.set()
            ends = _collect(results, procs, timeout, children, errors)
            last = max([begin, *ends])
            if errors:
                conn.send(("error", errors[0]))
            else:
                conn.send(("time", last - begin))
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


def _measure_rendezvous(
    impl: str,
    procs: int,
    ranks: int,
    port: int,
    token: str,
    timeout: float,
    loop_kind: str,
    verbose: bool,
    warm: bool,
    per_host: int = 1,
) -> float:
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    job = f"rdzv-{secrets.token_hex(4)}"
    launcher = ctx.Process(
        target=_rendezvous_launcher,
        args=(
            child_conn,
            impl,
            procs,
            ranks,
            port,
            token,
            job,
            timeout,
            loop_kind,
            verbose,
            warm,
            per_host,
        ),
        name=f"{impl}-rendezvous-launcher",
        daemon=False,  # it forks the participants, which daemonic processes may not do
    )
    launcher.start()
    child_conn.close()
    try:
        for stage in ("ready", "time"):
            if not parent_conn.poll(timeout + 30):
                raise StoreBenchError(
                    f"{impl} rendezvous of {ranks}: no {stage} within {timeout:.0f} s"
                )
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
        return float(message[1])
    finally:
        launcher.join(60)
        if launcher.is_alive():
            launcher.kill()
            launcher.join(5)


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

        from aiocoll.client.session import CoordinatorSession

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
    _need_torch(args)
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
                                impl, count, count, port, token, args.timeout, loop_kind, args.verbose, warm
                            )
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
            values, probes, memory = [], [], []
            for _ in range(args.rounds):
                rss_before = coordinator.rss_bytes()
                with _Probe(coordinator, token) as probe:
                    values.append(
                        _measure_rendezvous(
                            "aiocoll",
                            procs,
                            ranks,
                            coordinator.port,
                            token,
                            args.timeout,
                            loop_kind,
                            args.verbose,
                            False,
                            per_host,
                        )
                    )
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
