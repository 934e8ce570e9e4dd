"""Per-step fault tolerance: three replicas train a small torch model; one is killed with
kill -9 mid-run and the others go on without restarting; restarted, it receives the model and
optimizer state from a live replica and trains on.

Run the whole story on this machine (a coordinator, three replicas, the kill and the restart):

    python examples/fault_tolerant_training.py --demo

One replica by hand (start `aiocoll coordinator --port 29500` first, then one per replica):

    AIOCOLL_TOKEN=secret python examples/fault_tolerant_training.py \\
        --coordinator 127.0.0.1:29500 --replica r0 --steps 200

or three without faults: `aiocoll run --nproc-per-node 3 examples/fault_tolerant_training.py`
(aiocoll run stops every worker when one fails, so run replicas by hand to see them survive).

The training loop is an ordinary one; fault tolerance is the Manager and the optimizer wrapper:
``zero_grad`` asks the coordinator for this step's quorum (and heals a replica that is behind),
``step`` averages the gradients over the quorum and applies them only when every replica of the
quorum completed the step. With --record each committed step is written as a JSON line (step,
quorum, members, a digest of the parameters and optimizer state, timings).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch

import aiocoll.ft_torch
from aiocoll.ft import Manager

LR, MOMENTUM = 0.05, 0.9


def make_model(replica: str, ballast_mib: int = 0) -> torch.nn.Module:
    """The model, initialised from the replica's name (the first quorum makes the replicas one)."""
    torch.manual_seed(zlib.crc32(replica.encode()))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    if ballast_mib:  # state that travels in a heal without being trained (to time large heals)
        model.register_buffer("ballast", torch.zeros(ballast_mib << 17, dtype=torch.float64))
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def batch(replica: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s data at ``step`` (each replica sees its own)."""
    generator = torch.Generator().manual_seed(zlib.crc32(replica.encode()) * 100_003 + step)
    x = torch.randn(32, 8, generator=generator, dtype=torch.float64)
    return x, torch.sin(x).sum(dim=1, keepdim=True)


def loss_of(model: torch.nn.Module, replica: str, step: int) -> torch.Tensor:
    x, y = batch(replica, step)
    device = next(model.parameters()).device
    return torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """SHA-256 of the parameters and the optimizer's momentum: equal only when bit-identical."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
        momentum = optimizer.state.get(p, {}).get("momentum_buffer")
        if momentum is not None:
            h.update(momentum.cpu().numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# one replica


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)  # the same arithmetic in every process (and in a reference run)
    replica = args.replica or os.environ.get("AIOCOLL_REPLICA") or f"replica{os.environ.get('RANK', 0)}"
    model = make_model(replica, args.ballast_mib).to(args.device)
    manager = Manager(
        args.coordinator,
        replica=replica,
        job=args.job,
        min_replicas=args.min_replicas,
        join_timeout=args.join_timeout,
        timeout=args.timeout,
    )
    opt = aiocoll.ft_torch.FaultTolerantOptimizer(manager, make_optimizer(model), model)
    record = open(args.record, "a", buffering=1) if args.record else None
    losses = []
    while manager.step < _last_step(args):
        began = time.perf_counter()
        heals = manager.last_heal
        opt.zero_grad()  # this step's quorum; the state from a live replica when behind
        asked = time.perf_counter() - began
        step = manager.step
        loss = loss_of(model, replica, step)
        loss.backward()
        time.sleep(args.step_time)  # stands for a real model's forward and backward
        if opt.step():  # averaged over the quorum, applied only if every replica completed it
            losses.append(float(loss.detach()))
            if record is not None:
                entry = {
                    "event": "step",
                    "step": step,
                    "quorum": manager.quorum_id,
                    "members": manager.members,
                    "group": manager.group.group_id if manager.group is not None else None,
                    "digest": digest(model, opt.optimizer),
                    "healed": manager.last_heal if manager.last_heal is not heals else None,
                    "quorum_s": asked,
                    "step_s": time.perf_counter() - began,
                }
                _write(record, replica, entry)
        elif record is not None:
            _write(record, replica, {"event": "failed", "step": step, "error": str(manager.last_error)})
    opt.close()
    print(
        f"replica {replica}: {manager.step} steps committed, loss {losses[0]:.4f} -> {losses[-1]:.4f}"
        if losses
        else f"replica {replica}: {manager.step} steps committed",
        flush=True,
    )


def _last_step(args: argparse.Namespace) -> int:
    """--steps, or the step --until-file names once it exists (read before every step)."""
    if args.until_file:
        with contextlib.suppress(FileNotFoundError):
            return int(Path(args.until_file).read_text())
    return args.steps


def _write(record: Any, replica: str, entry: dict[str, Any]) -> None:
    entry.update(replica=replica, pid=os.getpid(), host=socket.gethostname(), t=time.time())
    record.write(json.dumps(entry) + "\n")


# ---------------------------------------------------------------------------------------------
# the demo: a coordinator, the replicas, a kill -9 and a restart


def _records(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def _committed(path: Path) -> list[dict[str, Any]]:
    return [e for e in _records(path) if e["event"] == "step"]


def _new(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries of the last process that wrote them (a restarted replica's)."""
    return [e for e in entries if e["pid"] != entries[0]["pid"]] if entries else []


_MARGIN = 20  # steps every replica trains after the restarted one healed, at least


def demo(args: argparse.Namespace) -> None:
    from aiocoll.testing.coordinator import CoordinatorProcess

    out = Path(args.out or tempfile.mkdtemp(prefix="aiocoll-ft-"))
    out.mkdir(parents=True, exist_ok=True)
    token = os.environ.get("AIOCOLL_TOKEN") or secrets.token_hex(16)
    coordinator = CoordinatorProcess(
        out / "coordinator.log", "--state-dir", str(out / "state"), "--heartbeat-timeout", "5", token=token
    )
    names = [f"r{k}" for k in range(args.replicas)]
    until = out / "until"
    until.unlink(missing_ok=True)
    last_step = None
    victim = names[1]
    env = {**os.environ, "AIOCOLL_TOKEN": token}

    def start(name: str) -> subprocess.Popen[bytes]:
        command = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{coordinator.port}"]
        # The replicas train until the demo writes the last step into `until`: --steps, or more
        # when the restarted replica healed so late (a loaded machine) that fewer than MARGIN
        # steps were left; so it always trains on after its heal, and all stop at the same step.
        command += ["--replica", name, "--steps", str(1 << 40), "--until-file", str(until)]
        command += ["--record", str(out / f"{name}.jsonl")]
        command += ["--step-time", str(args.step_time), "--ballast-mib", str(args.ballast_mib)]
        command += ["--device", args.device]
        command += ["--min-replicas", "2", "--join-timeout", str(args.join_timeout)]
        log = open(out / f"{name}.log", "ab")  # the child holds it
        return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {name: start(name) for name in names}
    deadline = time.monotonic() + args.deadline
    killed_at = restarted = None
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                raise SystemExit(f"demo: not done within {args.deadline:g}s; logs in {out}")
            done = {n: _committed(out / f"{n}.jsonl") for n in names}
            if killed_at is None and any(e["step"] >= args.kill_at for e in done[victim]):
                procs[victim].send_signal(signal.SIGKILL)  # mid-step: no goodbye of any kind
                killed_at = time.time()
                print(f"demo: killed {victim} (kill -9) after its step {args.kill_at}", flush=True)
            if killed_at is not None and restarted is None:
                if (
                    min(max((e["step"] for e in done[n]), default=0) for n in names if n != victim)
                    >= args.restart_at
                ):
                    procs[victim].wait(10)
                    procs[victim] = start(victim)
                    restarted = time.time()
                    print(f"demo: restarted {victim}", flush=True)
            if restarted is not None and last_step is None and any(e["healed"] for e in _new(done[victim])):
                top = max(e["step"] for n in names for e in done[n])
                last_step = max(args.steps, top + _MARGIN)
                (out / "until.tmp").write_text(str(last_step))
                (out / "until.tmp").replace(until)  # whole, or not there
            time.sleep(0.01)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        coordinator.stop()
    failed = [n for n, p in procs.items() if p.returncode != 0]
    if failed:
        raise SystemExit(f"demo: replicas {failed} failed; logs in {out}")
    assert last_step is not None
    summary = check(out, names, victim, killed_at, last_step)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    heal = summary["heal"]
    print(
        f"fault-tolerant training: {len(names)} replicas, {last_step} steps; {victim} killed (kill -9) "
        f"after step {args.kill_at}; the others committed step {summary['recovered_step']} without it "
        f"{summary['recovery_s']:.2f}s later, without a restart; {victim} restarted and healed from "
        f"{heal['source']} before step {summary['healed_step']} ({heal['bytes']} bytes in "
        f"{heal['seconds'] * 1e3:.1f} ms); every replica held bit-identical parameters at every step; "
        f"quorum {summary['quorum_ms']:.2f} ms of a {summary['step_ms']:.1f} ms step (medians). "
        f"Records in {out}",
        flush=True,
    )


def check(out: Path, names: list[str], victim: str, killed_at: float | None, steps: int) -> dict[str, Any]:
    """What the records show; raises SystemExit when replicas diverged or a step is missing.

    The killed process may have committed one step the others then ran again without it (it died
    after its own commit but before theirs): its last record is not held against them.
    """
    records = {name: _committed(out / f"{name}.jsonl") for name in names}
    killed_pid = records[victim][0]["pid"]
    by_step: dict[int, list[dict[str, Any]]] = {}
    for e in (e for name in names for e in records[name] if e["pid"] != killed_pid):
        by_step.setdefault(e["step"], []).append(e)
    killed = [e for e in records[victim] if e["pid"] == killed_pid]
    for e in killed:
        others = by_step.get(e["step"], [])
        if e is not killed[-1] or not others or others[0]["members"] == e["members"]:
            by_step.setdefault(e["step"], []).append(e)
    if sorted(by_step) != list(range(steps)):
        raise SystemExit(f"demo: steps committed {sorted(by_step)} are not 0..{steps - 1}")
    for step, entries in by_step.items():
        if len({e["digest"] for e in entries}) != 1 or len({tuple(e["members"]) for e in entries}) != 1:
            raise SystemExit(f"demo: the replicas disagree at step {step}: {entries}")
        if sorted(e["replica"] for e in entries) != sorted(entries[0]["members"]):
            raise SystemExit(f"demo: step {step} was committed by {entries} but its quorum is other")
    assert killed_at is not None
    ordered = [e for s in sorted(by_step) for e in by_step[s]]
    survivors = [e for e in ordered if e["t"] > killed_at and victim not in e["members"]]
    healed = [e for e in records[victim] if e["healed"] and e["pid"] != killed_pid]
    if not survivors or not healed:
        raise SystemExit(f"demo: no step without {victim} after the kill, or no heal after its restart")
    timed = [e for e in ordered if not e["healed"]]
    return {
        "steps": steps,
        "killed_at": killed_at,
        "recovered_step": survivors[0]["step"],
        "recovery_s": survivors[0]["t"] - killed_at,
        "healed_step": healed[0]["step"],
        "heal": healed[0]["healed"],
        "quorum_ms": statistics.median(e["quorum_s"] for e in timed) * 1e3,
        "step_ms": statistics.median(e["step_s"] for e in timed) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--demo", action="store_true", help="run the coordinator, the replicas, a kill and a restart"
    )
    parser.add_argument("--coordinator", help="HOST:PORT (default: AIOCOLL_COORDINATOR, as aiocoll run sets)")
    parser.add_argument("--replica", help="this replica's name (default: replica{RANK})")
    parser.add_argument("--job", default=None, help="the job (default AIOCOLL_JOB, else 'default')")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--record", help="append a JSON line per committed step to this file")
    parser.add_argument("--until-file", help="once this file exists, train to the step it holds, not --steps")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of pretend compute per step")
    parser.add_argument("--device", default="cpu", help="where the model lives: cpu, cuda, cuda:1...")
    parser.add_argument("--ballast-mib", type=int, default=0, help="MiB of extra state (times large heals)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--join-timeout", type=float, default=10.0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds each collective may take")
    demo_args = parser.add_argument_group("--demo")
    demo_args.add_argument("--replicas", type=int, default=3)
    demo_args.add_argument(
        "--kill-at", type=int, default=20, help="kill a replica after it committed this step"
    )
    demo_args.add_argument(
        "--restart-at", type=int, default=25, help="restart it when the others reach this step"
    )
    demo_args.add_argument("--out", help="directory for the records and logs (default: a new temporary one)")
    demo_args.add_argument("--deadline", type=float, default=240.0, help="seconds the whole demo may take")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.WARNING, format=f"%(asctime)s {args.replica or ''} %(name)s %(message)s"
    )
    if args.demo:
        demo(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
