"""One rank of a replica of two ranks whose model is sharded with torch FSDP2, for
tests/integration/test_ft_sharded.py: a process started by the test (not a test module).
Imports torch, numpy and aiocoll only.

The replica's two ranks shard a small float64 MLP with ``torch.distributed.fsdp.fully_shard`` on
the CPU, over the replica's own torch group (the "aiocoll" backend through aiocoll.sync, one job
per replica and ``Manager.replica_generation``). When the generation changes (the first quorum, a
rank replaced, a failure inside the replica) the group is made again, and the FSDP model and its
optimizer are built again on it, taking over this rank's shards: an FSDP module stays bound to
the group it was built on.

What the Manager moves in a heal is this rank's sharded state: each parameter's local shard and
its momentum's (``DTensor.to_local()``: views of the shards' own memory, so a heal receives
straight into them). A step: ``start_step`` (the quorum; this rank's shards healed from the same
rank of a live replica when behind); the replica's forward and backward (FSDP's all-gathers and
reduce-scatters inside the replica; data by the replica rank and the step only, the same on
every replica, so the model is the same, bit for bit, as a run without faults); the local
gradient shards averaged over the quorum's replicas (``all_reduce_mean``, this rank's shard
group); ``commit``; the optimizer's step only when committed. Every committed step appends a line
to ``--record`` (JSON: the step, the members, a digest of this rank's shards and momentum, the
heal, the generation); a ``QuorumError`` is recorded and the process exits 3. It stops after the
step named in ``--until-file`` once that file exists. With ``--start-file`` it loads torch and then
waits for that file before it joins: a test starts a replacement ahead of its kill, so the time a
new process takes to load torch is not spent by the survivors training on alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import aiocoll.sync as dist
from aiocoll._sync_loop import get_loop_thread
from aiocoll.ft import Manager, QuorumError

WIDTH = 16


class Shards:
    """This rank's FSDP2 model and optimizer, on the replica's group of one generation."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, 2)
        ).double()
        mesh = init_device_mesh("cpu", (2,))
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.params = dict(self.model.named_parameters())
        self.opt = torch.optim.SGD(self.params.values(), lr=0.05, momentum=0.9)
        with torch.no_grad():
            for p in self.params.values():
                # momentum from the start (zeros give SGD's first step exactly), so that a
                # heal finds it in place
                self.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)

    def state(self) -> dict[str, Any]:
        """This rank's shards as plain tensors: views of the sharded parameters' own memory."""
        with torch.no_grad():
            return {
                "params": {name: p.to_local() for name, p in self.params.items()},
                "momentum": {
                    name: self.opt.state[p]["momentum_buffer"].to_local() for name, p in self.params.items()
                },
            }

    def load(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            for part in ("params", "momentum"):
                mine = self.state()[part]
                for name, value in state[part].items():
                    mine[name].copy_(value)  # a copy onto itself when the heal received in place

    def digest(self) -> str:
        h = hashlib.sha256()
        for part in ("params", "momentum"):
            for name, t in sorted(self.state()[part].items()):
                h.update(name.encode())
                h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This replica rank's data at ``step`` (the same on every replica)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, WIDTH, generator=gen, dtype=torch.float64)
    return x, torch.cat([x[:, :1] * 0.5 - x[:, 1:2], x[:, 2:3]], dim=1)


def regroup(
    args: argparse.Namespace, generation: int, old: Shards | None, received: dict[str, Any]
) -> Shards:
    """The replica's own group of ``generation`` (a job of its own, named after the Manager's job
    too), and the model built again on it with this rank's shards taken over from ``old``, or
    from a heal that came before any model."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # its lost peer may make the goodbye fail: it is going
            pass
    dist.init_process_group(
        "aiocoll",
        init_method=f"tcp://{args.coordinator}",
        rank=args.rank,
        world_size=2,
        timeout=10.0,
        job=f"{os.environ.get('AIOCOLL_JOB', 'default')}/fsdp-{args.replica}-g{generation}",
    )
    shards = Shards(args.seed)
    if old is not None:
        shards.load(old.state())
    if received:
        shards.load(received)
        received.clear()
    return shards


def main(args: argparse.Namespace, record: Any) -> int:
    run = get_loop_thread().run

    def write(**entry: Any) -> None:
        record.write(json.dumps({"pid": os.getpid(), "t": time.time(), **entry}) + "\n")

    shards: Shards | None = None
    # A process has no model before its first quorum says which group (generation) to build it
    # on: what a heal brings before then is kept here and loaded into the model once built. (At
    # a job's first quorum every replica's model is the same seed's; the heal then moves nothing.)
    received: dict[str, Any] = {}

    def load(state: dict[str, Any]) -> None:
        if shards is None:
            received.update(state)
        else:
            shards.load(state)

    generation = 0
    manager = Manager(
        args.coordinator,
        replica=args.replica,
        replica_rank=args.rank,
        replica_size=2,
        state_dict=lambda: shards.state() if shards is not None else {},
        load_state_dict=load,
        min_replicas=1,
        join_timeout=args.join_timeout,
        timeout=10.0,
        quorum_timeout=max(90.0, args.replace_timeout + 30.0),
        replace_timeout=args.replace_timeout,
    )
    until = Path(args.until_file)
    try:
        while not until.exists() or manager.step < int(until.read_text()):
            try:
                step = run(manager.start_step())
            except QuorumError as exc:
                write(event="error", error=str(exc))
                return 3
            healed = manager.last_heal
            manager.last_heal = None
            grads: list[torch.Tensor] = []
            try:
                if manager.replica_generation != generation:
                    shards = regroup(args, manager.replica_generation, shards, received)
                    generation = manager.replica_generation
                    write(event="generation", step=step, generation=generation)
                shards.opt.zero_grad(set_to_none=False)
                time.sleep(args.step_time)  # more of the forward and backward pass: a kill lands here
                x, y = batch(args.rank, step)
                torch.nn.functional.mse_loss(shards.model(x), y).backward()
                grads = [p.grad.to_local() for p in shards.params.values()]
            except Exception as exc:  # FSDP's collectives inside the replica failed
                manager.report_error(exc, inside_replica=True)
                if shards is None:
                    raise
                grads = [torch.zeros_like(t) for t in shards.state()["params"].values()]
            run(manager.all_reduce_mean(grads))
            if run(manager.commit()):
                assert shards is not None
                shards.opt.step()
                write(
                    event="step",
                    step=step,
                    members=manager.members,
                    quorum_id=manager.quorum_id,
                    digest=shards.digest(),
                    healed=healed,
                    generation=generation,
                )
            else:
                write(event="failed", step=step, error=str(manager.last_error))
        return 0
    finally:
        run(manager.close())
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # leaving anyway
                pass
        write(event="closed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--replica", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--until-file", required=True)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--join-timeout", type=float, default=5.0)
    parser.add_argument("--replace-timeout", type=float, default=200.0)
    parser.add_argument(
        "--start-file", help="wait for this file before joining (a process started ahead, torch loaded)"
    )
    parsed = parser.parse_args()
    if parsed.start_file:
        deadline = time.monotonic() + 400
        while not Path(parsed.start_file).exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"{parsed.start_file} did not appear within 400 s")
            time.sleep(0.02)
    with open(parsed.record, "a", buffering=1) as out:
        raise SystemExit(main(parsed, out))
