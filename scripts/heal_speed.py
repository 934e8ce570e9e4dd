"""How fast a fault-tolerant replica heals, against the links between the same two processes.

A developer's tool (docs/FAULT_TOLERANCE.md, "What it costs", quotes it); run it under the bench
lock on a shared machine:

    flock /tmp/aiocoll-bench.lock python scripts/heal_speed.py --mib 256 --reps 3
    flock /tmp/aiocoll-bench.lock python scripts/heal_speed.py --mib 256 --transport tcp --torch

Starts a coordinator and two processes, A and B, and in those same two processes measures,
each ``--reps`` times, B receiving ``--mib`` MiB from A:

- ``socket``: a plain TCP socket (``sendall`` / ``recv_into`` a buffer B wrote before);
- ``p2p``: aiocoll's own ``send`` / ``recv`` between the two (over ``--transport``: ``auto``
  is shared memory on one host, ``tcp`` the path between hosts), into a buffer B wrote before;
- ``heal``: a real heal: A is a replica of an ``aiocoll.ft.Manager`` job that trains on; B starts
  a new Manager (a new incarnation of replica ``b``, so it is behind) whose state is the same
  arrays (numpy, or with ``--torch`` a torch module's parameters and an SGD optimizer with
  momentum), and its ``start_step`` receives A's state and loads it. The time is the Manager's
  own ``last_heal["seconds"]``: from the first byte asked for to ``load_state_dict`` done.

Prints the median of each and the ratios heal/socket and heal/p2p (bandwidths). Timed on B, the
receiver, from the moment A was told to start (socket, p2p) or the heal began.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
_ARRAYS = 16  # the state is this many arrays of equal size


# ---------------------------------------------------------------------------------------------
# the two workers


def _plain_socket(role: str, port: int, nbytes: int, reps: int) -> list[float]:
    times = []
    if role == "b":
        buf = np.ones(nbytes, np.uint8)  # written before: its pages are there
        with socket.create_server(("127.0.0.1", port)) as server:
            conn, _ = server.accept()
            with conn:
                view = buf.data.cast("B")
                for _ in range(reps):
                    started = time.perf_counter()
                    conn.sendall(b"g")
                    got = 0
                    while got < nbytes:
                        n = conn.recv_into(view[got:])
                        if not n:
                            raise SystemExit("heal_speed: the socket closed early")
                        got += n
                    times.append(time.perf_counter() - started)
        return times
    data = np.full(nbytes, 7, np.uint8)
    deadline = time.monotonic() + 60
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        for _ in range(reps):
            conn.recv(1)
            conn.sendall(data.data)
    return times


async def _p2p(role: str, coordinator: str, nbytes: int, reps: int) -> list[float]:
    import aiocoll

    rank = 0 if role == "a" else 1
    url = f"tcp://{coordinator}"
    pg = await aiocoll.init_process_group(url, rank=rank, world_size=2, job="heal-speed-p2p")
    times = []
    buf = np.ones(nbytes, np.uint8) if rank else np.full(nbytes, 7, np.uint8)
    go = np.zeros(1, np.int64)
    await pg.send(go, 1 - rank, 1) if rank else await pg.recv(go, 1, 1)  # links up
    for _ in range(reps):
        if rank:
            started = time.perf_counter()
            await pg.send(go, 0, 2)
            await pg.recv(buf, 0, 3)
            times.append(time.perf_counter() - started)
        else:
            await pg.recv(go, 1, 2)
            await pg.send(buf, 1, 3)
    await pg.barrier()
    await pg.destroy()
    return times


def _numpy_state(nbytes: int) -> tuple[Any, Any, Any]:
    arrays = {f"w{i}": np.ones(nbytes // _ARRAYS // 4, np.float32) for i in range(_ARRAYS)}

    def load(state: dict[str, np.ndarray]) -> None:
        for key, value in state.items():
            arrays[key][...] = value

    return (lambda: arrays), load, arrays


def _torch_state(nbytes: int) -> tuple[Any, Any, Any]:
    import torch

    # parameters and momentum: half the bytes each
    per = nbytes // 2 // _ARRAYS // 4
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(per)) for _ in range(_ARRAYS)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the momentum buffers exist

    def get() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])

    return get, load, model


async def _exists(path: Path) -> bool:
    return await asyncio.to_thread(path.exists)


async def _heal(role: str, coordinator: str, nbytes: int, reps: int, flag: Path, torch: bool) -> list[float]:
    from aiocoll.ft import Manager

    get, load, _ = (_torch_state if torch else _numpy_state)(nbytes)

    def manager(name: str) -> Manager:
        return Manager(
            coordinator,
            replica=name,
            state_dict=get,
            load_state_dict=load,
            job="heal-speed",
            join_timeout=10.0,
            timeout=120.0,
        )

    if role == "a":
        async with manager("a") as a:
            while not await _exists(flag):
                await a.start_step()
                await a.all_reduce_mean([np.zeros(1)])
                await a.commit()
                await asyncio.sleep(0.01)
        return []
    times = []
    for _ in range(60 * 20):  # A is up (it is a replica before B starts its first)
        if await _exists(Path(str(flag) + ".a-up")):
            break
        await asyncio.sleep(0.05)
    for _ in range(reps):
        async with manager("b") as b:
            await b.start_step()
            assert b.last_heal is not None, "heal_speed: B did not heal"
            times.append(float(b.last_heal["seconds"]))
            assert b.last_heal["bytes"] >= nbytes, b.last_heal
            await b.all_reduce_mean([np.zeros(1)])
            await b.commit()
    await asyncio.to_thread(flag.touch)
    return times


def worker(args: argparse.Namespace) -> None:
    nbytes = args.mib * MIB
    out: dict[str, Any] = {"socket": _plain_socket(args.worker, args.socket_port, nbytes, args.reps)}
    out["p2p"] = asyncio.run(_p2p(args.worker, args.coordinator, nbytes, args.reps))
    flag = Path(args.flag)
    if args.worker == "a":
        Path(str(flag) + ".a-up").touch()
    out["heal"] = asyncio.run(_heal(args.worker, args.coordinator, nbytes, args.reps, flag, args.torch))
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------------------------------------
# the parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="the state's size (default 256)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--transport", default="auto", help="AIOCOLL_TRANSPORT of both: auto (shm) or tcp")
    parser.add_argument("--torch", action="store_true", help="a torch module and optimizer as the state")
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--socket-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--flag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    sys.path.insert(0, str(ROOT))
    from aiocoll.testing.coordinator import CoordinatorProcess

    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="heal-speed-") as tmp:
        coordinator = CoordinatorProcess(Path(tmp) / "coordinator.log", token=token)
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**os.environ, "AIOCOLL_TOKEN": token, "AIOCOLL_TRANSPORT": args.transport}
            command = [sys.executable, __file__, "--mib", str(args.mib), "--reps", str(args.reps)]
            command += ["--coordinator", f"127.0.0.1:{coordinator.port}", "--socket-port", str(port)]
            command += ["--flag", str(Path(tmp) / "done")] + (["--torch"] if args.torch else [])
            procs = {}
            for role in ("b", "a"):
                argv = [*command, "--worker", role]
                procs[role] = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
            outs = {role: p.communicate(timeout=900)[0] for role, p in procs.items()}
        finally:
            coordinator.stop()
        if any(p.returncode for p in procs.values()):
            raise SystemExit(f"heal_speed: a worker failed: {outs}")
    got = json.loads(outs["b"].strip().splitlines()[-1])
    nbytes = args.mib * MIB
    gbs = {what: nbytes / statistics.median(times) / 1e9 for what, times in got.items()}
    load = os.getloadavg()[0]
    state = "torch module + SGD momentum" if args.torch else "numpy arrays"
    print(
        f"heal_speed: {args.mib} MiB ({state}), transport {args.transport}, {args.reps} reps, "
        f"load {load:.1f} on {os.cpu_count()} CPUs; medians on the receiver:"
    )
    for what in ("socket", "p2p", "heal"):
        runs = ", ".join(f"{nbytes / t / 1e9:.2f}" for t in got[what])
        print(f"  {what:7s} {gbs[what]:6.2f} GB/s   ({runs})")
    socket_ratio, p2p_ratio = gbs["heal"] / gbs["socket"], gbs["heal"] / gbs["p2p"]
    print(f"  heal / socket = {socket_ratio:.2f}x   heal / p2p = {p2p_ratio:.2f}x")
    if args.json:
        record = {"args": vars(args), "load": load, "seconds": got, "gbs": gbs, "date": time.time()}
        Path(args.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
