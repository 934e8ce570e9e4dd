"""What one sequential store request costs, on each end: wall time per operation, CPU per
operation in the client and in the server, Python calls per operation, bytecode instructions per
operation on each end (aiocoll's clients; they do not move with the machine's load), and
optionally a cProfile of either end. A developer's tool for the coordinator's request path;
docs/PERFORMANCE.md quotes it.

    python scripts/store_cost.py                          # aiocoll async, aiocoll.sync, TCPStore, bare
    taskset -c 0 python scripts/store_cost.py --ops get,add # one core: no cross-core wake-ups
    python scripts/store_cost.py --ops get --count 20000
    python scripts/store_cost.py --ops get,add,check,wait,multi_get,compare_set --clients async,sync
    python scripts/store_cost.py --clients async --profile client   # cProfile of the client
    python scripts/store_cost.py --clients sync --profile server     # cProfile of the coordinator

Each server runs in a process of its own (as in ``aiocoll bench``); the client runs here, one
connection, sequential operations. CPU times come from getrusage in each process, read before
and after the timed loop, so they count only that loop. ``calls/op`` counts the client's Python
function calls (sys.setprofile) in a separate, untimed pass: unlike times, it does not move with
the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime
import io
import multiprocessing
import os
import pstats
import resource
import secrets
import statistics
import sys
import time
from typing import Any

OPS = ("set", "get", "add", "check", "wait", "multi_get", "compare_set")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------- servers


def _serve_aiocoll(conn: Any, token: str, profile: bool) -> None:
    import logging

    logging.getLogger("aiocoll").setLevel(logging.ERROR)
    import uvloop
    from aiocoll.server import Coordinator

    profiler = cProfile.Profile() if profile else None
    opcodes = Opcodes()

    async def serve() -> None:
        coordinator = Coordinator("127.0.0.1", 0, token=token)
        await coordinator.start()
        conn.send(coordinator.port)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_command() -> None:
            command = conn.recv()
            if command == "cpu":
                conn.send(_cpu())
            elif command == "opcodes-on":
                sys.settrace(opcodes)
                conn.send("ok")
            elif command == "opcodes-off":
                sys.settrace(None)
                conn.send(opcodes.take())
            elif command == "profile-on" and profiler is not None:
                profiler.enable()
                conn.send("ok")
            elif command == "profile-off" and profiler is not None:
                profiler.disable()
                conn.send("ok")
            elif command == "stop" and not done.done():
                done.set_result(None)

        loop.add_reader(conn.fileno(), on_command)
        await done
        loop.remove_reader(conn.fileno())
        await coordinator.stop()

    uvloop.run(serve())
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        conn.send(out.getvalue())


def _serve_tcpstore(conn: Any) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    conn.send(store.port)
    while True:
        command = conn.recv()
        if command == "cpu":
            conn.send(_cpu())
        elif command == "stop":
            break
    del store


def _serve_bare(conn: Any) -> None:
    """The floor of a Python request path: a uvloop server that answers each 4-byte-length-prefixed
    request with a fixed short reply and does nothing else (no parsing, no state)."""
    import struct

    import uvloop

    reply = struct.pack("!I", 4) + b"done"

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while len(self.buffer) >= 4:
                size = struct.unpack_from("!I", self.buffer)[0]
                if len(self.buffer) < 4 + size:
                    return
                self.buffer = self.buffer[4 + size :]
                self.transport.write(reply)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(Echo, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        done = loop.create_future()

        def on_command() -> None:
            command = conn.recv()
            if command == "cpu":
                conn.send(_cpu())
            elif command == "stop" and not done.done():
                done.set_result(None)

        loop.add_reader(conn.fileno(), on_command)
        await done
        server.close()

    uvloop.run(serve())


class BareClient:
    """A blocking socket that sends each operation as one small frame and reads the reply: what
    any Python client of any Python server pays at least."""

    def __init__(self, port: int) -> None:
        import socket
        import struct

        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.frame = struct.pack("!I", 8) + b"request!"

    def _round_trip(self, *_: Any) -> bytes:
        self.sock.sendall(self.frame)
        return self.sock.recv(64)

    set = get = add = check = wait = multi_get = compare_set = _round_trip


class Server:
    def __init__(self, target: Any, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.port = int(self.conn.recv())

    def ask(self, command: str) -> Any:
        self.conn.send(command)
        return self.conn.recv()

    def stop(self) -> str | None:
        self.conn.send("stop")
        report = None
        with contextlib.suppress(EOFError):
            if self.conn.poll(10):
                report = self.conn.recv()
        self.proc.join(10)
        return report


# ---------------------------------------------------------------------------------- clients


def _calls(store: Any, op: str, value: bytes) -> Any:
    """One operation ``op`` on ``store`` as a function of its index (the same for every client)."""
    keys = [f"k{i}" for i in range(64)]
    if op == "set":
        return lambda i: store.set(keys[i & 63], value)
    if op == "get":
        return lambda i: store.get(keys[i & 63])
    if op == "add":
        return lambda i: store.add("ctr", 1)
    if op == "check":
        return lambda i: store.check([keys[i & 63]])
    if op == "wait":
        return lambda i: store.wait([keys[i & 63]])
    if op == "multi_get":
        return lambda i: store.multi_get([keys[i & 63], keys[(i + 1) & 63]])
    return lambda i: store.compare_set(keys[i & 63], value, value)


def _loop_body(store: Any, op: str, count: int, value: bytes) -> Any:
    call = _calls(store, op, value)
    return lambda: [call(i) for i in range(count)]


class Calls:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.n += 1


class Opcodes:
    """Counts the bytecode instructions run while it is the thread's trace function
    (sys.settrace): a measure of Python work that does not move with the machine's load."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.n += 1
        return self

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


def measure_sync(name: str, store: Any, server: Server, op: str, count: int, profile: bool) -> dict[str, Any]:
    value = b"v" * 32
    for i in range(64):
        store.set(f"k{i}", value)
    run = _loop_body(store, op, max(count // 10, 100), value)
    run()  # warm
    calls = Calls()
    sys.setprofile(calls)
    run()
    sys.setprofile(None)
    opcodes: dict[str, float] = {}
    if name.startswith("aiocoll"):  # its coordinator counts its own (an untimed pass)
        mine = Opcodes()
        server.ask("opcodes-on")
        sys.settrace(mine)
        run()
        sys.settrace(None)
        small = max(count // 10, 100)
        opcodes = {
            "client opcodes/op": mine.n / small,
            "server opcodes/op": server.ask("opcodes-off") / small,
        }
    run = _loop_body(store, op, count, value)
    profiler = cProfile.Profile() if profile else None
    server_cpu = server.ask("cpu")
    cpu, wall = _cpu(), time.perf_counter()
    if profiler:
        profiler.enable()
    run()
    if profiler:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall, _cpu() - cpu
    server_cpu = server.ask("cpu") - server_cpu
    result = {
        "client": name,
        "op": op,
        "us/op": wall / count * 1e6,
        "client cpu us/op": cpu / count * 1e6,
        "server cpu us/op": server_cpu / count * 1e6,
        "calls/op": calls.n / max(count // 10, 100),
        **opcodes,
    }
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile"] = out.getvalue()
    return result


def measure_async(server: Server, token: str, op: str, count: int, profile: bool) -> dict[str, Any]:
    import uvloop

    import aiocoll

    async def main() -> dict[str, Any]:
        store = await aiocoll.connect_store(f"tcp://127.0.0.1:{server.port}", token=token, job="cost")
        value = b"v" * 32
        keys = [f"k{i}" for i in range(64)]
        for key in keys:
            await store.set(key, value)

        call = _calls(store, op, value)

        async def run(n: int) -> None:
            for i in range(n):
                await call(i)
            if op == "set":
                await store.flush()

        small = max(count // 10, 100)
        await run(small)
        calls = Calls()
        sys.setprofile(calls)
        await run(small)
        sys.setprofile(None)
        mine = Opcodes()
        server.ask("opcodes-on")
        sys.settrace(mine)
        await run(small)
        sys.settrace(None)
        theirs = server.ask("opcodes-off")
        profiler = cProfile.Profile() if profile else None
        server_cpu = server.ask("cpu")
        cpu, wall = _cpu(), time.perf_counter()
        if profiler:
            profiler.enable()
        await run(count)
        if profiler:
            profiler.disable()
        wall, cpu = time.perf_counter() - wall, _cpu() - cpu
        server_cpu = server.ask("cpu") - server_cpu
        await store.aclose()
        result = {
            "client": "aiocoll async",
            "op": op,
            "us/op": wall / count * 1e6,
            "client cpu us/op": cpu / count * 1e6,
            "server cpu us/op": server_cpu / count * 1e6,
            "calls/op": calls.n / small,
            "client opcodes/op": mine.n / small,
            "server opcodes/op": theirs / small,
        }
        if profiler:
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
            result["profile"] = out.getvalue()
        return result

    return uvloop.run(main())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="set,get,add", help=f"comma-separated, of: {', '.join(OPS)}")
    parser.add_argument(
        "--clients",
        default="async,sync,tcpstore,bare",
        help="async, sync, tcpstore, bare (a Python server and client doing nothing but a round trip)",
    )
    parser.add_argument("--count", type=int, default=20000, help="operations per measurement")
    parser.add_argument("--profile", choices=("client", "server"), help="cProfile one end (aiocoll only)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, clients interleaved; medians kept")
    args = parser.parse_args()
    ops = [o for o in args.ops.split(",") if o]
    clients = [c for c in args.clients.split(",") if c]
    token = secrets.token_hex(8)
    os.environ["AIOCOLL_TOKEN"] = token
    rows: list[dict[str, Any]] = []
    profiles: list[str] = []
    for client in [c for _ in range(args.rounds) for c in clients]:
        if client == "bare":
            server = Server(_serve_bare)
            bare = BareClient(server.port)
            for op in ops:
                rows.append(measure_sync("bare python (floor)", bare, server, op, args.count, False))
            server.stop()
            continue
        if client == "tcpstore":
            server = Server(_serve_tcpstore)
            from torch.distributed import TCPStore

            store = TCPStore(
                "127.0.0.1",
                server.port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=60),
            )
            for op in ops:
                rows.append(measure_sync("torch TCPStore", store, server, op, args.count, False))
            del store
            server.stop()
            continue
        server = Server(_serve_aiocoll, token, args.profile == "server")
        if args.profile == "server":
            server.ask("profile-on")
        if client == "async":
            for op in ops:
                rows.append(measure_async(server, token, op, args.count, args.profile == "client"))
        else:
            import aiocoll.sync as dist

            store = dist.TCPStore(
                "127.0.0.1", server.port, is_master=False, wait_for_workers=False, token=token, job="cost"
            )
            for op in ops:
                rows.append(
                    measure_sync(
                        "aiocoll.sync.TCPStore", store, server, op, args.count, args.profile == "client"
                    )
                )
            store.close()
        if args.profile == "server":
            server.ask("profile-off")
        report = server.stop()
        if report:
            profiles.append(f"== coordinator profile ({client} client)\n{report}")
    print(
        f"# store_cost: {args.count} sequential ops per row, one client, 32-byte values, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(f"# median of {args.rounds} rounds, the clients taking turns; us/op of each round in brackets")
    print(
        f"{'client':24} {'op':11} {'us/op':>8} {'client cpu':>11} {'server cpu':>11} {'calls/op':>9} "
        f"{'opcodes/op (client, server)':>28}  rounds"
    )
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        grouped.setdefault((r["client"], r["op"]), []).append(r)
    medians = []
    for (client, op), group in grouped.items():
        row = {
            k: statistics.median(g[k] for g in group)
            for k in group[0]
            if k not in ("client", "op", "profile")
        }
        row.update(client=client, op=op, rounds=" ".join(f"{g['us/op']:.1f}" for g in group))
        medians.append(row)
    for r in medians:
        codes = (
            f"{r['client opcodes/op']:.0f}, {r['server opcodes/op']:.0f}" if "client opcodes/op" in r else "-"
        )
        print(
            f"{r['client']:24} {r['op']:11} {r['us/op']:8.1f} {r['client cpu us/op']:11.1f} "
            f"{r['server cpu us/op']:11.1f} {r['calls/op']:9.1f} {codes:>28}  [{r['rounds']}]"
        )
    for r in rows:
        if "profile" in r:
            print(f"== client profile ({r['client']}, {r['op']})\n{r['profile']}")
    for p in profiles:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
