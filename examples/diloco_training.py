"""DiLoCo against per-step fault tolerance: what each communicates per inner step, and how fast.

Run both on this machine (a coordinator, then R replicas with each method, the same model, data
and inner optimizer):

    python examples/diloco_training.py --demo                    # 2 replicas, H = 20
    python examples/diloco_training.py --demo --replicas 3 --sync-every 50 --steps 500 --width 512

It prints, per inner step and per replica: the bytes handed to the all-reduce across replicas
(the replicas' average; with a ring over R replicas each sends 2(R-1)/R of it), the quorums
(coordinator round trips, each with a commit), the inner steps per second (from inner step H to
the last: the first H hold the first quorum's join window and torch's warm-up), and the loss each method
reached on held-out data. It checks that DiLoCo moved exactly 1/H of the bytes and did 1/H of the
quorums, that every replica ended with the same parameters, and that both methods trained.

One replica by hand (start `aiocoll coordinator --port 29500` first):

    AIOCOLL_TOKEN=secret python examples/diloco_training.py --coordinator 127.0.0.1:29500 \\
        --replica r0 --method diloco --steps 200

``aiocoll.ft_torch.DiLoCo`` takes H inner steps alone with the inner optimizer (AdamW here), then
averages the pseudo-gradients (parameters at the last sync minus now) over the quorum and applies
them with the outer optimizer (SGD with Nesterov momentum); ``FaultTolerantOptimizer`` averages
every step's gradients. Both survive a lost replica the same way (docs/FAULT_TOLERANCE.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import aiocoll.ft_torch
from aiocoll.ft import Manager

INPUTS = 32


class CountingManager(Manager):
    """A Manager that counts what it sends across replicas: quorums, and bytes all-reduced."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.quorums = 0
        self.reduced_bytes = 0

    async def start_step(self) -> int:
        self.quorums += 1
        return await super().start_step()

    async def all_reduce_mean(self, arrays: Sequence[Any], *, timeout: float | None = None) -> bool:
        self.reduced_bytes += sum(a.numel() * a.element_size() for a in arrays)
        return await super().all_reduce_mean(arrays, timeout=timeout)


def make_model(width: int) -> torch.nn.Module:
    """The model (the same initial values on every replica: the first quorum makes them one anyway)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(INPUTS, width), torch.nn.Tanh(), torch.nn.Linear(width, width), torch.nn.Tanh(),
        torch.nn.Linear(width, 1),
    )  # fmt: skip


def batch(replica: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica's data at inner step ``step``: a fixed nonlinear target of random inputs."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{replica}/{step}".encode()))
    x = torch.randn(64, INPUTS, generator=gen)
    return x, torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:5]


def held_out_loss(model: torch.nn.Module) -> float:
    x, y = batch("held-out", 0)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


def train(args: argparse.Namespace) -> dict[str, Any]:
    """One replica: ``args.steps`` inner steps with the chosen method; what it communicated."""
    model = make_model(args.width)
    manager = CountingManager(
        args.coordinator, replica=args.replica, min_replicas=args.replicas, join_timeout=args.join_timeout
    )
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    first_loss = held_out_loss(model)
    started = 0.0
    timed = 0
    if args.method == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        method: Any = aiocoll.ft_torch.DiLoCo(
            manager,
            model,
            inner,
            outer,
            sync_every=args.sync_every,
            fragments=args.fragments,
            delay=args.delay,
            mix=args.mix,
        )
        syncs = args.steps * args.fragments // args.sync_every
        going = True
        while going:
            method.zero_grad()  # after a sync was applied: the next quorum
            x, y = batch(args.replica, method.inner_step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            timed += 1 if started else 0
            if method.step() is not None:  # a sync (its part's average, the commit) was applied
                going = manager.step < syncs  # (read between syncs: with a delay one commits meanwhile)
                started = started or time.perf_counter()
        trained = method.synced  # the replicas' shared parameters (with a delay they drift locally)
    else:
        method = aiocoll.ft_torch.FaultTolerantOptimizer(manager, inner, model)
        while manager.step < args.steps:
            method.zero_grad()  # the quorum
            if not started and manager.step == args.sync_every:
                started = time.perf_counter()
            x, y = batch(args.replica, manager.step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            timed += 1 if started else 0
            method.step()  # the gradients averaged, the commit
        trained = list(model.parameters())
    seconds = time.perf_counter() - started
    method.close()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in trained)).hexdigest()
    return {
        "replica": args.replica,
        "method": args.method,
        "inner_steps": args.steps,
        "timed_steps": timed,
        "params": sum(p.numel() for p in model.parameters()),
        "reduced_bytes": manager.reduced_bytes,
        "quorums": manager.quorums,
        "seconds": seconds,
        "first_loss": first_loss,
        "loss": held_out_loss(model),
        "digest": digest,
    }


def demo(args: argparse.Namespace) -> None:
    from aiocoll.testing.coordinator import CoordinatorProcess

    token = secrets.token_hex(16)
    out = Path(tempfile.mkdtemp(prefix="aiocoll-diloco-"))
    coordinator = CoordinatorProcess(out / "coordinator.log", token=token)
    methods = ("ft", "diloco")
    try:
        # one method after the other (so that their steps/s do not share the CPUs), or both at once
        for batch in [methods] if args.at_once else [(m,) for m in methods]:
            procs = {
                (m, r): start(args, m, r, coordinator.port, token, out)
                for m in batch
                for r in range(args.replicas)
            }
            for (method, r), p in procs.items():
                if p.wait(timeout=600) != 0:
                    log = (out / f"{method}-r{r}.log").read_text()[-3000:]
                    raise SystemExit(f"replica r{r} ({method}) failed:\n{log}")
    finally:
        coordinator.stop()
    results = {
        m: [json.loads((out / f"{m}-r{r}.json").read_text()) for r in range(args.replicas)] for m in methods
    }
    report(results, args, out)


def start(
    args: argparse.Namespace, method: str, r: int, port: int, token: str, out: Path
) -> subprocess.Popen[bytes]:
    """Replica ``r`` of ``method`` (a job of its own), as a process."""
    command = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}", "--replica", f"r{r}"]
    command += [
        "--method",
        method,
        "--out",
        str(out / f"{method}-r{r}.json"),
        "--replicas",
        str(args.replicas),
    ]
    command += ["--steps", str(args.steps), "--width", str(args.width), "--sync-every", str(args.sync_every)]
    command += ["--join-timeout", str(args.join_timeout)]
    command += ["--fragments", str(args.fragments), "--delay", str(args.delay), "--mix", str(args.mix)]
    env = {**os.environ, "AIOCOLL_TOKEN": token, "AIOCOLL_JOB": f"diloco-example-{method}"}
    log = open(out / f"{method}-r{r}.log", "wb")  # the child holds it
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)


def report(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace, out: Path) -> None:
    """Print the comparison and check what must hold."""
    h, parts = args.sync_every, args.fragments
    rows = {}
    for method, replicas in results.items():
        steps = replicas[0]["inner_steps"]
        if len({r["digest"] for r in replicas}) != 1:
            raise SystemExit(f"{method}: the replicas ended with different parameters")
        rows[method] = {
            "bytes": replicas[0]["reduced_bytes"] / steps,
            "quorums": replicas[0]["quorums"] / steps,
            "rate": min(r["timed_steps"] / r["seconds"] for r in replicas),
            "loss": replicas[0]["loss"],
            "first": replicas[0]["first_loss"],
        }
    ft, dl = rows["ft"], rows["diloco"]
    params = results["ft"][0]["params"]
    overlap = f"{args.delay} inner step{'' if args.delay == 1 else 's'}"
    streaming = f", {parts} parts in turn, each sync overlapping {overlap}" if parts > 1 or args.delay else ""
    print(
        f"DiLoCo (H={h}{streaming}) against per-step fault tolerance: {args.replicas} replicas, a model of "
        f"{params:,} float32 parameters, {args.steps} inner steps each"
    )
    print(f"{'':<22}{'bytes all-reduced':>20}{'quorums':>10}{'inner steps/s':>15}{'held-out loss':>15}")
    start = f"(from {ft['first']:.3f})"
    print(f"{'per inner step':<22}{'(per replica)':>20}{'':>10}{'(slowest)':>15}{start:>15}")
    for name, row in (
        ("per-step FT", ft),
        (f"DiLoCo, H={h}" + (f", {parts} parts" if parts > 1 else ""), dl),
    ):
        print(
            f"{name:<22}{row['bytes']:>20,.0f}{row['quorums']:>10.3f}{row['rate']:>15.1f}{row['loss']:>15.4f}"
        )
    print(
        f"DiLoCo moved {ft['bytes'] / dl['bytes']:.1f}x fewer bytes and made "
        f"{ft['quorums'] / dl['quorums']:.1f}x fewer quorums per inner step, at "
        f"{dl['rate'] / ft['rate']:.2f}x the inner steps/s. Records in {out}"
    )
    # each sync moves one part: the bytes are 1/H of per-step FT's, the quorums `parts`/H
    if abs(ft["bytes"] / dl["bytes"] - h) > 1e-9 or abs(ft["quorums"] / dl["quorums"] - h / parts) > 1e-9:
        raise SystemExit(
            f"DiLoCo should move 1/{h} of per-step FT's bytes with {parts}/{h} of its quorums: {rows}"
        )
    for name, row in rows.items():
        if not row["loss"] < row["first"]:
            raise SystemExit(f"{name} did not train: held-out loss {row['first']} -> {row['loss']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--demo", action="store_true", help="start a coordinator and the replicas of both methods"
    )
    parser.add_argument("--coordinator", help="HOST:PORT of the coordinator (one replica by hand)")
    parser.add_argument("--replica", default=os.environ.get("AIOCOLL_REPLICA", "r0"))
    parser.add_argument("--method", choices=("diloco", "ft"), default="diloco")
    parser.add_argument(
        "--replicas", type=int, default=2, help="replicas (each quorum waits for all of them)"
    )
    parser.add_argument("--steps", type=int, default=200, help="inner steps per replica")
    parser.add_argument("--sync-every", type=int, default=20, help="DiLoCo's H: inner steps per sync")
    parser.add_argument(
        "--fragments", type=int, default=1, help="DiLoCo's parts synced in turn (streaming; divides H)"
    )
    parser.add_argument(
        "--delay", type=int, default=0, help="inner steps each of DiLoCo's syncs overlaps (streaming)"
    )
    parser.add_argument(
        "--mix",
        type=float,
        default=0.0,
        help="with --delay: weight of the local parameters when a sync lands",
    )
    parser.add_argument("--width", type=int, default=256, help="the model's hidden width")
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner optimizer's (AdamW) learning rate")
    parser.add_argument("--join-timeout", type=float, default=2.0)
    parser.add_argument("--out", help="write this replica's counts here (JSON)")
    parser.add_argument(
        "--at-once",
        action="store_true",
        help="run both methods' replicas at the same time (faster; steps/s then share the CPUs)",
    )
    args = parser.parse_args()
    if args.steps % args.sync_every or args.steps < 2 * args.sync_every:
        parser.error("--steps must be a multiple of --sync-every, at least two of them")
    if args.demo:
        demo(args)
        return
    if not args.coordinator:
        parser.error("give --demo, or --coordinator HOST:PORT for one replica")
    result = train(args)
    text = json.dumps(result)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
