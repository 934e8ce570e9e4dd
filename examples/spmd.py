"""The single-program-multiple-data shape every aiocoll run job has: one script, many ranks.

Run:  aiocoll run --nproc-per-node 3 examples/spmd.py --steps 5
The launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and AIOCOLL_JOB; the
script reads nothing but its own arguments. Each step every rank all-reduces a counter; the
result must equal the step's expected total on every rank.
"""

from __future__ import annotations

import argparse
import os

import torch

import aiocoll.sync as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    dist.init_process_group("gloo")  # env:// from the launcher
    rank, size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    for step in range(args.steps):
        counter = torch.tensor([rank + step], dtype=torch.int64)
        dist.all_reduce(counter)
        expected = size * (size - 1) // 2 + size * step
        assert counter.item() == expected, (step, counter.item(), expected)
    dist.barrier()
    print(f"rank {rank} (local {local_rank}) of {size}: {args.steps} steps agreed")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
