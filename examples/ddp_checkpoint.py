"""DistributedDataParallel on the aiocoll backend, with checkpoint save and load around a barrier.

Run:  aiocoll run --nproc-per-node 2 examples/ddp_checkpoint.py --checkpoint /tmp/aiocoll-ddp.pt
Rank 0 saves the model; a barrier makes sure the file is complete before the other ranks load it
(mapping tensors to the CPU). Training then continues from the checkpoint and the script checks
that every rank holds the same parameters afterwards.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aiocoll.torch  # noqa: F401  (registers the torch.distributed backend "aiocoll")


def train(model: torch.nn.Module, steps: int, rank: int) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    loss = torch.zeros(())
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces the gradients over aiocoll here
        optimizer.step()
    return float(loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", default="/tmp/aiocoll-ddp-checkpoint.pt")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    dist.init_process_group("aiocoll")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's at wrap time
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DistributedDataParallel(model)

    first = train(ddp, args.steps, rank)
    if rank == 0:
        torch.save(ddp.state_dict(), args.checkpoint)
    dist.barrier()  # nobody loads before rank 0 has finished writing
    ddp.load_state_dict(torch.load(args.checkpoint, map_location="cpu"))
    second = train(ddp, args.steps, rank)

    flat = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    assert all(torch.equal(copies[0], c) for c in copies), "DDP replicas diverged"
    dist.barrier()
    if rank == 0:
        os.remove(args.checkpoint)
        print(f"DDP on aiocoll: loss {first:.4f} -> {second:.4f}; checkpoint round trip; replicas identical")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
