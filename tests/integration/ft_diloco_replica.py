"""One replica of a DiLoCo job (aiocoll.ft_torch.DiLoCo), for tests/integration/test_ft_diloco.py.

    python ft_diloco_replica.py HOST:PORT NAME OUT SYNCS SYNC_EVERY [MIN_REPLICAS [STEP_SECONDS [START_FILE]]]

SYNCS is a number, or a file's path: then the replica syncs until the file exists and holds the
number (read before each step), so that a test can end the job once what it waits for happened.
With START_FILE it loads torch, says so (START_FILE.ready) and waits for START_FILE before it
joins: a replacement started ahead of its kill.
A linear model, plain SGD inside, SGD with Nesterov momentum outside; the data of inner step k
of replica NAME is ``batch(NAME, k)``. After each sync it writes one JSON line: the sync's
number, whether it committed, and the parameters' bytes (hex), so that the test can compare
replicas with each other and with its own reference, bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
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
    coordinator, name, out, syncs, every = sys.argv[1:6]
    least = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    pause = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0  # pretend compute per inner step
    if len(sys.argv) > 8:
        open(f"{sys.argv[8]}.ready", "w").close()  # torch is loaded
        deadline = time.monotonic() + 300
        while not os.path.exists(sys.argv[8]):
            if time.monotonic() > deadline:
                raise SystemExit(f"{sys.argv[8]} did not appear within 300 s")
            time.sleep(0.02)
    torch.set_num_threads(1)
    model = make_model()
    inner, outer = optimizers(model)
    manager = aiocoll.ft.Manager(coordinator, replica=name, job="diloco", min_replicas=least, join_timeout=5)
    diloco = aiocoll.ft_torch.DiLoCo(manager, model, inner, outer, sync_every=int(every))
    with open(out, "a", buffering=1) as fh:
        while manager.step < _syncs(syncs):
            diloco.zero_grad()
            sync = manager.step
            loss_of(model, name, sync * diloco.sync_every + diloco.local_step).backward()
            time.sleep(pause)
            committed = diloco.step()
            if committed is not None:
                record = {"sync": sync, "committed": committed, "params": params_hex(model)}
                record.update(t=time.monotonic(), healed=manager.last_heal is not None)
                fh.write(json.dumps(record) + "\n")
    diloco.close()


if __name__ == "__main__":
    main()
