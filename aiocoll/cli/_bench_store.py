"""`aiocoll bench --op store`: the coordinator's key-value store against torch's TCPStore.

Store throughput: C client processes per implementation (each holding one connection) run
``--store-ops`` sequential operations of one kind (set, get, add, check, wait, multi_get of two
keys, compare_set) from a common start instant; throughput is
the total number of operations over the time from that instant until the last client finished.
Implementations alternate which goes first, round after round, so slow drift in the machine's
load falls on both; the median round is reported.

Each client is a process of its own, started and connected before the clock starts, so start-up
costs stay outside the measurement. Imports only the standard library at module level; the
rendezvous benchmark (_bench_rendezvous.py) shares its error and torch check.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import math
import multiprocessing
import multiprocessing.connection
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
from ._bench_servers import quiet_logs, start_coordinator, start_tcpstore

__all__ = ["StoreBenchError", "need_torch", "run_store"]

STORE_OPS = ("set", "get", "add", "check", "wait", "multi_get", "compare_set")
_KEYS_PER_CLIENT = 64


class StoreBenchError(RuntimeError):
    """The store or rendezvous benchmark could not complete; the message says why."""


def need_torch(args: argparse.Namespace) -> None:
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
            elif op == "add":
                for _ in range(count):
                    await store.add(counter, 1)
            elif op == "check":
                for i in range(count):
                    await store.check([keys[i % _KEYS_PER_CLIENT]])
            elif op == "wait":
                for i in range(count):
                    await store.wait([keys[i % _KEYS_PER_CLIENT]])
            elif op == "multi_get":
                for i in range(count):
                    await store.multi_get([keys[i % _KEYS_PER_CLIENT], keys[(i + 1) % _KEYS_PER_CLIENT]])
            else:
                for i in range(count):
                    await store.compare_set(keys[i % _KEYS_PER_CLIENT], value, value)
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
            elif op == "add":
                for _ in range(count):
                    store.add(counter, 1)
            elif op == "check":
                for i in range(count):
                    store.check([keys[i % _KEYS_PER_CLIENT]])
            elif op == "wait":
                for i in range(count):
                    store.wait([keys[i % _KEYS_PER_CLIENT]])
            elif op == "multi_get":
                for i in range(count):
                    store.multi_get([keys[i % _KEYS_PER_CLIENT], keys[(i + 1) % _KEYS_PER_CLIENT]])
            else:
                for i in range(count):
                    store.compare_set(keys[i % _KEYS_PER_CLIENT], value, value)
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
    need_torch(args)
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
