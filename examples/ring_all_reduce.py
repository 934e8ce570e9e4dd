"""A ring all-reduce written by hand with isend/recv, checked against the library's all_reduce.

Run:  aiocoll run --nproc-per-node 4 examples/ring_all_reduce.py
Each rank passes a running sum to its right neighbour; after world_size - 1 steps every rank has
the total. The library's own all_reduce does this chunked and pipelined.
"""

from __future__ import annotations

import torch

import aiocoll.sync as dist


def ring_all_reduce(send: torch.Tensor) -> torch.Tensor:
    rank, size = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % size, (rank + 1) % size
    accumulator = send.clone()
    passing = send.clone()
    incoming = torch.empty_like(send)
    for _ in range(size - 1):
        request = dist.isend(passing, dst=right)
        dist.recv(incoming, src=left)
        request.wait()
        accumulator += incoming
        passing = incoming.clone()
    return accumulator


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = torch.arange(8, dtype=torch.float64) * (rank + 1)
    by_hand = ring_all_reduce(data)
    by_library = data.clone()
    dist.all_reduce(by_library)
    assert torch.equal(by_hand, by_library), (by_hand, by_library)
    print(f"rank {rank}: ring all-reduce {by_hand.tolist()[:3]}... matches the library")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
