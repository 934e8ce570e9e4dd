"""All-reduce inside a sub-group: only ranks 0 and 1 take part; the others leave their tensor alone.

Run:  aiocoll run --nproc-per-node 4 examples/subgroup_all_reduce.py
"""

from __future__ import annotations

import torch

import aiocoll.sync as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # every rank calls new_group, members or not
    tensor = torch.ones(2) * (rank + 1)
    if rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        assert torch.equal(tensor, torch.full((2,), 3.0)), tensor  # 1 + 2
    else:
        assert torch.equal(tensor, torch.full((2,), float(rank + 1)))
    print(f"rank {rank}: {tensor.tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
