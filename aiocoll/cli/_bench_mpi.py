"""The MPI contender of `aiocoll bench --vs mpi`: a job of its own, launched with mpiexec.

MPI is what many users of collectives compare with, and MPICH's shared-memory path is the bar
for ranks on one host. Its ranks cannot join the aiocoll workers' processes (MPI owns process
start-up), so the parent runs them as a separate phase of the same invocation, under the same
machine conditions (the same --hog processes, the same sizes, iterations and checks):
``mpiexec -n N python -m aiocoll.cli._bench_mpi CONFIG OUT``. Each rank times exactly what the
gloo contender times, through the same ``OpRunner`` and ``time_blocking`` (an adapter gives
mpi4py the torch.distributed names), and rank 0 appends one JSON line per op and size to OUT
with every rank's times, flushed, so the parent can show progress and notice a stall.

The parent side lives here too (``find_mpiexec``, ``run_mpi_phase``) so that everything about
launching MPI is in one module. mpi4py is imported only inside the ranks. May import the bench
helpers and the standard library; nothing else of aiocoll.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._bench_common import SizedOp

__all__ = ["MPI_DTYPES", "MpiUnavailable", "find_mpiexec", "run_mpi_phase"]

# numpy types MPI reduces natively (MPI has no bfloat16, and float16 only as an MPICH extension)
MPI_DTYPES = ("int8", "uint8", "int32", "int64", "float32", "float64")


class MpiUnavailable(RuntimeError):
    """mpi4py or mpiexec is missing; the message says what to install."""


def find_mpiexec() -> str:
    """The mpiexec that belongs to this Python's mpi4py: the one beside the interpreter first
    (the `mpich` wheel installs it into the venv's bin), else the first on PATH.

    Raises:
        MpiUnavailable: mpi4py is not importable or no mpiexec can be found.
    """
    if importlib.util.find_spec("mpi4py") is None:
        raise MpiUnavailable(
            "--vs mpi needs mpi4py and an MPI: pip install 'aiocoll[mpi]' (mpi4py with MPICH's wheel)"
        )
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise MpiUnavailable(
            "--vs mpi: mpi4py is installed but no mpiexec was found beside the interpreter or on PATH; "
            "pip install mpich (the wheel ships mpiexec)"
        )
    return found


def run_mpi_phase(
    cfg: dict[str, Any],
    on_times: Callable[[str, int, list[list[float]], list[dict[str, float]]], None],
    stall_timeout: float,
) -> None:
    """Run the MPI job for ``cfg`` (the bench's worker configuration) and hand each op and size's
    per-rank times and resource usage to ``on_times(op, measured_size, times, usage)`` as rank 0
    reports them.

    Raises:
        MpiUnavailable: no mpi4py or mpiexec.
        RuntimeError: the job failed (its output is in the message) or made no progress for
            ``stall_timeout`` seconds.
    """
    mpiexec = find_mpiexec()
    with tempfile.TemporaryDirectory(prefix="aiocoll-bench-mpi-") as tmp:
        config = Path(tmp, "config.json")
        out = Path(tmp, "times.jsonl")
        config.write_text(json.dumps(cfg))
        out.touch()
        ranks = str(cfg["world_size"])
        command = [mpiexec, "-n", ranks, sys.executable, "-m", __name__, str(config), str(out)]
        log = Path(tmp, "mpiexec.log")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        with open(log, "w+b") as log_file:
            job = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
            try:
                for record in _follow(out, job, stall_timeout):
                    on_times(record["op"], record["size"], record["times"], record["usage"])
            except BaseException:
                job.kill()
                job.wait(10)
                raise
            finally:
                log_file.seek(0)
                output = log_file.read().decode(errors="replace")
        if job.returncode != 0:
            raise RuntimeError(
                f"the MPI job ({' '.join(command)}) exited with code {job.returncode}:\n{output}"
            )


def _follow(out: Path, job: subprocess.Popen[bytes], stall_timeout: float) -> Iterator[dict[str, Any]]:
    """Yield rank 0's JSON lines as they are written, until the job ends; a stall raises."""
    last_progress = time.monotonic()
    with open(out, encoding="utf-8") as handle:
        pending = ""
        while True:
            finished = job.poll() is not None
            chunk = handle.read()
            if chunk:
                pending += chunk
                *lines, pending = pending.split("\n")
                for line in lines:
                    if line.strip():
                        last_progress = time.monotonic()
                        yield json.loads(line)
            if finished:
                return
            if time.monotonic() - last_progress > stall_timeout:
                raise RuntimeError(f"the MPI job made no progress for {stall_timeout:.0f} s")
            time.sleep(0.05)


class _MpiGroup:
    """mpi4py's communicator under torch.distributed's names, so OpRunner drives it as it drives gloo.

    In-place where torch is in place (all_reduce, broadcast, reduce at the root), as aiocoll is.
    """

    def __init__(self, comm: Any, mpi: Any) -> None:
        self._comm = comm
        self._in_place = mpi.IN_PLACE

    def all_reduce(self, buf: Any) -> None:
        self._comm.Allreduce(self._in_place, buf)

    def broadcast(self, buf: Any, src: int) -> None:
        self._comm.Bcast(buf, root=src)

    def reduce(self, buf: Any, dst: int) -> None:
        if self._comm.Get_rank() == dst:
            self._comm.Reduce(self._in_place, buf, root=dst)
        else:
            self._comm.Reduce(buf, None, root=dst)

    def all_gather_into_tensor(self, out: Any, inp: Any) -> None:
        self._comm.Allgather(inp, out)

    def reduce_scatter_tensor(self, out: Any, inp: Any) -> None:
        self._comm.Reduce_scatter_block(inp, out)

    def all_to_all_single(self, out: Any, inp: Any) -> None:
        self._comm.Alltoall(inp, out)

    def barrier(self) -> None:
        self._comm.Barrier()

    def send(self, buf: Any, dst: int) -> None:
        self._comm.Send(buf, dest=dst)

    def recv(self, buf: Any, src: int) -> None:
        self._comm.Recv(buf, source=src)


async def _rank_main(cfg: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> None:
    from mpi4py import MPI

    from ._bench_worker import Buffers, OpRunner, time_blocking

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if n != cfg["world_size"]:
        raise RuntimeError(f"mpiexec started {n} ranks, the bench asked for {cfg['world_size']}")
    group = _MpiGroup(comm, MPI)
    for op in cfg["ops"]:
        for size in [0] if op == "barrier" else cfg["sizes"]:
            sized = SizedOp(op, size, n, cfg["itemsize"])
            runner = OpRunner("mpi", op, Buffers(sized, cfg["dtype"], False, rank, n), group)
            times, usage = await time_blocking(runner, cfg["warmup"], cfg["iters"])
            if op == "sendrecv":  # one iteration is a round trip: report one way, from rank 0
                times = [t / 2 for t in times] if rank == 0 else []
            every: list[Any] | None = comm.gather((times, usage), root=0)
            if every is not None:  # rank 0
                record = {"op": op, "size": sized.size, "times": [t for t, _ in every]}
                report({**record, "usage": [u for _, u in every]})


def _rank_entry(config_path: str, out_path: str) -> None:
    with open(config_path, encoding="utf-8") as config_file:
        cfg = json.load(config_file)
    with open(out_path, "a", encoding="utf-8") as out:

        def report(record: dict[str, Any]) -> None:
            out.write(json.dumps(record) + "\n")
            out.flush()

        asyncio.run(_rank_main(cfg, report))


if __name__ == "__main__":
    _rank_entry(sys.argv[1], sys.argv[2])
