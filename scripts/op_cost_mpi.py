"""What one small all_reduce or ping-pong costs each rank with MPI: the plain-script counterpart
of scripts/op_cost.py, for side-by-side numbers (mpi4py over the MPI its mpiexec belongs to).

    mpiexec -n 2 python scripts/op_cost_mpi.py                   # us/op wall and CPU per rank
    mpiexec -n 2 python scripts/op_cost_mpi.py --ops 5000 --elements 256
    mpiexec -n 2 python scripts/op_cost_mpi.py --op sendrecv     # ping-pong: us one way
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ops", type=int, default=20000, help="timed operations (default 20000)")
    parser.add_argument("--warmup", type=int, default=500, help="untimed operations first (default 500)")
    parser.add_argument("--elements", type=int, default=1, help="float32 elements (default 1)")
    ops = ("all_reduce", "sendrecv")
    parser.add_argument("--op", choices=ops, default="all_reduce", help="(default all_reduce)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.zeros(args.elements, np.float32)
    y = np.empty_like(x)
    peer = 1 - comm.rank

    def one() -> None:
        if args.op == "all_reduce":
            comm.Allreduce(x, y)
        elif comm.rank == 0:  # a round trip: rank 0 sends first, rank 1 answers
            comm.Send(x, peer)
            comm.Recv(y, peer)
        elif comm.rank == 1:
            comm.Recv(y, peer)
            comm.Send(y, peer)

    for _ in range(args.warmup):
        one()
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.ops):
        one()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if args.op == "all_reduce":
        what = f"{wall / args.ops * 1e6:.2f} us/op wall, {cpu / args.ops * 1e6:.2f} us/op CPU"
        what += f" ({args.ops} Allreduces of {x.nbytes} B)"
    else:
        what = f"{wall / args.ops / 2 * 1e6:.2f} us one way wall, {cpu / args.ops * 1e6:.2f} us CPU per"
        what += f" round trip ({args.ops} ping-pongs of {x.nbytes} B)"
    print(f"rank {comm.rank}: {what}", flush=True)


if __name__ == "__main__":
    main()
