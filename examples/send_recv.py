"""Point-to-point: blocking send/recv, then non-blocking isend/irecv, with the blocking facade.

Run:  aiocoll run --nproc-per-node 2 examples/send_recv.py
Rank 0 sends a tensor to rank 1 twice; rank 1 checks what arrived. Any even number of ranks works:
each even rank pairs with the odd rank after it.
"""

from __future__ import annotations

import torch

import aiocoll.sync as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    assert dist.get_world_size() % 2 == 0, "run with an even number of ranks"

    # Blocking: send returns once the tensor may be reused; recv returns once it is filled.
    tensor = torch.zeros(4)
    if rank % 2 == 0:
        tensor += torch.arange(4.0) + rank
        dist.send(tensor=tensor, dst=peer)
    else:
        source = dist.recv(tensor=tensor, src=peer)
        assert source == peer
        assert torch.equal(tensor, torch.arange(4.0) + peer), tensor
    print(f"rank {rank}: blocking exchange with rank {peer} gave {tensor.tolist()}")

    # Non-blocking: both directions at once; wait() on each request.
    outgoing = torch.full((3,), float(rank))
    incoming = torch.empty(3)
    requests = [dist.isend(outgoing, dst=peer), dist.irecv(incoming, src=peer)]
    for request in requests:
        request.wait()
    assert torch.equal(incoming, torch.full((3,), float(peer))), incoming
    print(f"rank {rank}: non-blocking exchange received {incoming.tolist()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
