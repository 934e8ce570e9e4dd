"""One replica of a DiLoCo job (aiocoll.ft_torch.DiLoCo), for tests/integration/test_ft_diloco.py.

    python ft_diloco_replica.py HOST:PORT NAME OUT SYNCS SYNC_EVERY [--min-replicas N]
        [--pause SECONDS] [--start-file F] [--job NAME] [--fragments F --delay D --mix M]

SYNCS is a number, or a file's path: then the replica syncs until the file exists and holds the
number (read before each step), so that a test can end the job once what it waits for happened.
With --start-file it loads torch, says so (F.ready) and waits for F before it joins: a
replacement started ahead of its kill. --fragments, --delay and --mix are DiLoCo's streaming.
A linear model, plain SGD inside, SGD with Nesterov momentum outside; the data of inner step k
of replica NAME is ``batch(NAME, k)``. After each sync it writes one JSON line: the sync's
number, whether it committed, and the synced parameters' bytes (hex), so that the test can
compare replicas with each other and with its own reference, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import zlib

import torch

import aiocoll.ft
import aiocoll.ft_torch


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def optimizers(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    return inner, outer


def loss_of(model: torch.nn.Module, name: str, k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}:{k}".encode()))
    x = torch.randn(8, 4, generator=g)
    return torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))


def params_hex(model: torch.nn.Module) -> str:
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters()).hex()


def _syncs(given: str) -> int:
    if given.isdigit():
        return int(given)
    try:
        with open(given) as fh:
            return int(fh.read())
    except FileNotFoundError:
        return 1 << 40


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("coordinator", "name", "out", "syncs", "every"):
        ap.add_argument(name)
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.0, help="pretend compute per inner step")
    ap.add_argument("--start-file")
    ap.add_argument("--job", default="diloco")
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--mix", type=float, default=0.0)
    args = ap.parse_args()
    if args.start_file:
        open(f"{args.start_file}.ready", "w").close()  # torch is loaded
        deadline = time.monotonic() + 300
        while not os.path.exists(args.start_file):
            if time.monotonic() > deadline:
                raise SystemExit(f"{args.start_file} did not appear within 300 s")
            time.sleep(0.02)
    torch.set_num_threads(1)
    model = make_model()
    inner, outer = optimizers(model)
    manager = aiocoll.ft.Manager(
        args.coordinator, replica=args.name, job=args.job, min_replicas=args.min_replicas, join_timeout=5
    )
    diloco = aiocoll.ft_torch.DiLoCo(
        manager,
        model,
        inner,
        outer,
        sync_every=int(args.every),
        fragments=args.fragments,
        delay=args.delay,
        mix=args.mix,
    )
    # manager.step is read only between syncs: with a delay, a sync commits while this thread trains
    going = manager.step < _syncs(args.syncs)
    with open(args.out, "a", buffering=1) as fh:
        while going:
            diloco.zero_grad()
            loss_of(model, args.name, diloco.inner_step).backward()
            time.sleep(args.pause)
            committed = diloco.step()
            if committed is not None:
                synced = b"".join(t.numpy().tobytes() for t in diloco.synced).hex()
                record = {"sync": diloco.last_sync, "committed": committed, "params": synced}
                record.update(t=time.monotonic(), healed=manager.last_heal is not None)
                fh.write(json.dumps(record) + "\n")
                going = manager.step < _syncs(args.syncs)
    diloco.close()


if __name__ == "__main__":
    main()
