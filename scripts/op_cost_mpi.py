"""What one small all_reduce costs each rank with MPI: the plain-script counterpart of
scripts/op_cost.py, for side-by-side numbers (mpi4py over the MPI its mpiexec belongs to).

    mpiexec -n 2 python scripts/op_cost_mpi.py            # us/op wall and CPU per rank
    mpiexec -n 2 python scripts/op_cost_mpi.py --ops 5000 --elements 256
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
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.zeros(args.elements, np.float32)
    y = np.empty_like(x)
    for _ in range(args.warmup):
        comm.Allreduce(x, y)
    comm.Barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(args.ops):
        comm.Allreduce(x, y)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"rank {comm.rank}: {wall / args.ops * 1e6:.2f} us/op wall, {cpu / args.ops * 1e6:.2f} us/op CPU "
        f"({args.ops} Allreduces of {x.nbytes} B)",
        flush=True,
    )


if __name__ == "__main__":
    main()
