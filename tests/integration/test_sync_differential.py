"""The same torch.distributed script under gloo, under aiocoll.sync and on the "aiocoll" backend.

One world of 3 processes (not a power of two) runs ``tour`` — every function of contract §3 —
three times in a row: with ``torch.distributed`` on gloo (the reference), with
``import aiocoll.sync as dist``, and with ``torch.distributed`` on the backend that
``import aiocoll.torch`` registers. Each rank writes what it saw to a file; the tests compare the
three, entry by entry. The aiocoll.sync run also checks numpy arrays, async_op futures and
monitored_barrier naming a rank that never arrives.

Run as a script (``python THIS worker RANK ...``) it is one rank of that world.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.preload import TORCH
from aiocoll.testing.world import free_ports, run_script_ranks

WORLD = 3
pytestmark = [pytest.mark.integration, pytest.mark.torch]


# ------------------------------------------------------------------------------ the worker side


def _np(t: Any) -> Any:
    import torch

    if isinstance(t, torch.Tensor):
        return t.detach().float().numpy().copy() if t.dtype == torch.bfloat16 else t.detach().numpy().copy()
    if isinstance(t, (list, tuple)):
        return [_np(x) for x in t]
    return t


def tour(dist: Any, rank: int, ws: int, *, monitored: bool) -> dict[str, Any]:
    """Every function of contract §3, written for torch.distributed; returns what each gave."""
    import torch

    out: dict[str, Any] = {}
    out["is_initialized"] = dist.is_initialized()
    out["rank"], out["size"] = dist.get_rank(), dist.get_world_size()
    out["backend_is_str"] = isinstance(dist.get_backend(), str)

    # all_reduce with every op, floats and integers
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
        t = torch.tensor([rank + 1.0, -2.0 * rank, 0.5 * rank + 3.0])
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce/float32/{op}"] = t
    for op in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        t = torch.tensor([rank + 1, 6 + rank, 3 * rank + 5, -rank], dtype=torch.int32)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce/int32/{op}"] = t
    for dtype in (torch.float64, torch.int64, torch.uint8, torch.float16):
        t = (torch.arange(10) % 7 + rank).to(dtype)
        dist.all_reduce(t)
        out[f"all_reduce/{dtype}"] = t
    big = torch.arange(100_003, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(big)
    out["all_reduce/large"] = big
    t2d = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
    dist.all_reduce(t2d, op=dist.ReduceOp.MAX)
    out["all_reduce/2d"] = t2d

    # broadcast from every root, reduce to every root
    for src in range(ws):
        t = torch.full((5,), float(rank * 10 + src))
        dist.broadcast(t, src=src)
        out[f"broadcast/{src}"] = t
    for dst in range(ws):
        t = torch.tensor([rank + 1.0, rank * 2.0])
        dist.reduce(t, dst=dst, op=dist.ReduceOp.SUM)
        out[f"reduce/{dst}"] = t if rank == dst else None
    t = torch.tensor([rank + 2.0])
    dist.reduce(t, dst=1, op=dist.ReduceOp.PRODUCT)
    out["reduce/product"] = t if rank == 1 else None

    # gathers and scatters
    lst = [torch.zeros(3) for _ in range(ws)]
    dist.all_gather(lst, torch.arange(3, dtype=torch.float32) + 10 * rank)
    out["all_gather"] = lst
    big_out = torch.zeros(ws * 4, dtype=torch.int64)
    dist.all_gather_into_tensor(big_out, torch.arange(4) * (rank + 1))
    out["all_gather_into_tensor"] = big_out
    glist = [torch.zeros(2) for _ in range(ws)] if rank == 1 else None
    dist.gather(torch.tensor([rank, rank * rank], dtype=torch.float32), gather_list=glist, dst=1)
    out["gather"] = glist
    st = torch.zeros(3)
    slist = [torch.full((3,), float(i * 100)) for i in range(ws)] if rank == 2 else None
    dist.scatter(st, scatter_list=slist, src=2)
    out["scatter"] = st
    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.tensor([i + rank, i * rank], dtype=torch.float32) for i in range(ws)])
    out["reduce_scatter"] = rs
    rst = torch.zeros(2)
    dist.reduce_scatter_tensor(
        rst, torch.arange(2 * ws, dtype=torch.float32) * (rank + 1), op=dist.ReduceOp.MAX
    )
    out["reduce_scatter_tensor"] = rst
    a2a = [torch.zeros(2) for _ in range(ws)]
    dist.all_to_all(a2a, [torch.tensor([rank, i], dtype=torch.float32) for i in range(ws)])
    out["all_to_all"] = a2a
    a2as = torch.zeros(2 * ws)
    dist.all_to_all_single(a2as, torch.arange(2 * ws, dtype=torch.float32) + 100 * rank)
    out["all_to_all_single"] = a2as
    # uneven splits: rank r sends j+1 elements to rank j and receives r+1 from each
    in_splits = [j + 1 for j in range(ws)]
    out_splits = [rank + 1] * ws
    uneven_in = torch.arange(sum(in_splits), dtype=torch.float32) + 1000 * rank
    uneven_out = torch.zeros(sum(out_splits))
    dist.all_to_all_single(uneven_out, uneven_in, output_split_sizes=out_splits, input_split_sizes=in_splits)
    out["all_to_all_single/uneven"] = uneven_out

    # point to point: a ring with isend/recv, batch_isend_irecv, recv from any source
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    buf = torch.zeros(4)
    work = dist.isend(torch.full((4,), float(rank)), dst=nxt, tag=3)
    out["recv/src"] = dist.recv(buf, src=prv, tag=3)
    work.wait()
    out["recv/value"] = buf
    rbuf = torch.zeros(2, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, torch.tensor([rank, 7], dtype=torch.int64), nxt),
        dist.P2POp(dist.irecv, rbuf, prv),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv"] = rbuf
    if rank == 0:
        sources = []
        for _ in range(ws - 1):
            anybuf = torch.zeros(1)
            src = dist.recv(anybuf)
            sources.append((src, float(anybuf[0])))
        out["recv/any"] = sorted(sources)
    else:
        dist.send(torch.tensor([rank * 1.5]), dst=0)
        out["recv/any"] = None
    ibuf = torch.zeros(3)
    if rank == 1:
        w = dist.irecv(ibuf, src=2)
        w.wait()
    elif rank == 2:
        dist.isend(torch.ones(3) * 9, dst=1).wait()
    out["irecv"] = ibuf

    # async_op: Work.wait, is_completed, get_future
    t = torch.tensor([float(rank)])
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    out["async/completed"] = w.is_completed()
    out["async/future_value"] = w.get_future().value()
    t = torch.tensor([float(rank + 1)])
    w = dist.broadcast(t, src=2, async_op=True)
    out["async/broadcast_future"] = w.get_future().wait()

    dist.barrier()
    if monitored:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    out["barrier"] = True

    # objects
    objs: list[Any] = [{"from": rank}, f"s{rank}", None] if rank == 1 else [None, None, None]
    dist.broadcast_object_list(objs, src=1)
    out["broadcast_object_list"] = objs
    gathered: list[Any] = [None] * ws
    dist.all_gather_object(gathered, {"rank": rank, "sq": [rank] * rank})
    out["all_gather_object"] = gathered
    gol: list[Any] | None = [None] * ws if rank == 2 else None
    dist.gather_object((rank, "x" * rank), gol, dst=2)
    out["gather_object"] = gol
    sol: list[Any] = [None]
    dist.scatter_object_list(sol, [{"to": i} for i in range(ws)] if rank == 0 else None, src=0)
    out["scatter_object_list"] = sol

    # sub-groups: members and a non-member
    g = dist.new_group([0, 2])
    out["group/rank"], out["group/size"] = dist.get_rank(g), dist.get_world_size(g)
    t = torch.tensor([rank + 1.0])
    if rank in (0, 2):
        dist.all_reduce(t, group=g)
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=2, group=g)
        out["group/broadcast"] = b
        gl = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(gl, torch.tensor([rank * 3.0]), group=g)
        out["group/all_gather"] = gl
    out["group/all_reduce"] = t
    g_all = dist.new_group()
    t = torch.tensor([2.0])
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=g_all)
    out["group/all_ranks"] = t
    dist.barrier()
    return {k: _np(v) for k, v in out.items()}


def sync_only(dist: Any, rank: int, ws: int, flags: Path) -> dict[str, Any]:
    """What only aiocoll.sync offers or checks here: numpy, its Work, naming a missing rank."""
    import aiocoll

    out: dict[str, Any] = {}
    out["backend"] = dist.get_backend()
    a = np.arange(6, dtype=np.float64).reshape(2, 3) + rank
    dist.all_reduce(a)
    out["numpy/all_reduce"] = a
    b = np.full(3, rank, dtype=np.int16)
    dist.broadcast(b, src=2)
    out["numpy/broadcast"] = b
    w = dist.all_reduce(np.ones(2) * rank, async_op=True)
    out["work/wait"] = w.wait(timeout=60)
    out["work/success"] = w.is_success()
    # Argument errors surface at call time, before anything is sent.
    try:
        dist.broadcast(np.zeros(1), src=ws + 5)
    except ValueError as exc:
        out["bad_src"] = str(exc)
    # monitored_barrier: rank 2 never arrives; rank 0 names it, rank 1 hears rank 0 did not release.
    if rank == 2:
        # Stay connected until the others have seen their errors, so the failure is a timeout.
        deadline = time.monotonic() + 60
        while not all((flags / f"mb{r}").exists() for r in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.02)
        out["monitored/missing"] = None
    else:
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
            out["monitored/missing"] = "no error"
        except aiocoll.CollectiveTimeout as exc:
            out["monitored/missing"] = (exc.missing_ranks, str(exc), isinstance(exc, RuntimeError))
        (flags / f"mb{rank}").touch()
    return out


def silent_mismatch(dist: Any, rank: int) -> dict[str, Any]:
    """Ranks 0 and 1 all_reduce while rank 2 broadcasts from 0 on a fresh group: the two schedules
    exchange no message, so only the coordinator's cross-check of the ranks' progress reports can
    tell (issue 10); it must, on every rank, well before the group's 60 s timeout."""
    import torch

    g = dist.new_group([0, 1, 2])
    t = torch.ones(4)
    started = time.monotonic()
    try:
        if rank < 2:
            dist.all_reduce(t, group=g)
        else:
            dist.broadcast(t, src=0, group=g)
        return {"error": None}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - started}


def worker(rank: int, ports: list[int], result: Path) -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as tdist

    torch.manual_seed(0)
    results: dict[str, Any] = {}
    init = {"rank": rank, "world_size": WORLD, "timeout": datetime.timedelta(seconds=60)}

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", **init)
    results["gloo"] = tour(tdist, rank, WORLD, monitored=True)
    tdist.destroy_process_group()

    import aiocoll.sync as adist

    adist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}", **init)
    results["sync"] = tour(adist, rank, WORLD, monitored=True)
    results["sync/silent_mismatch"] = silent_mismatch(adist, rank)
    results["sync_only"] = sync_only(adist, rank, WORLD, result.parent)
    adist.destroy_process_group()
    results["sync/after_destroy"] = adist.is_initialized()

    import aiocoll.torch  # noqa: F401 - registers the backend

    tdist.init_process_group("aiocoll", init_method=f"tcp://127.0.0.1:{ports[2]}", **init)
    # torch allows monitored_barrier only on gloo, so the backend run skips it.
    results["backend"] = tour(tdist, rank, WORLD, monitored=False)
    results["backend/name"] = tdist.get_backend()
    results["backend/silent_mismatch"] = silent_mismatch(tdist, rank)
    tdist.destroy_process_group()

    result.write_bytes(pickle.dumps(results))


# ------------------------------------------------------------------------------ the test side


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sync_differential")
    ports = [str(p) for p in free_ports(3)]
    args = [["worker", str(r), *ports, str(tmp / f"rank{r}.pkl")] for r in range(WORLD)]
    run_script_ranks(__file__, args, tmp, timeout=150, token="differential-test", preload=TORCH)
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind == "f":
            return bool(np.allclose(a, b, rtol=1e-6, atol=1e-6))
        return bool(np.array_equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.timeout(170)
@pytest.mark.parametrize("mode", ["sync", "backend"])
def test_every_function_gives_what_gloo_gives(world: list[dict[str, Any]], mode: str) -> None:
    for rank, results in enumerate(world):
        reference, ours = results["gloo"], results[mode]
        assert len(reference) > 50, "the tour should record every function's result"
        assert sorted(ours) == sorted(reference)
        diffs = [
            f"{key}: gloo {reference[key]!r} vs {mode} {ours[key]!r}"
            for key in reference
            if not _same(reference[key], ours[key])
        ]
        assert not diffs, f"rank {rank}:\n" + "\n".join(diffs)


def test_reference_run_is_not_trivial(world: list[dict[str, Any]]) -> None:
    # Guards the comparison above against a tour that records nothing meaningful.
    ref = world[1]["gloo"]
    assert _same(ref["all_reduce/float32/SUM"], np.array([6.0, -6.0, 10.5], np.float32))
    assert ref["recv/src"] == 0 and world[0]["gloo"]["recv/any"] == [[1, 1.5], [2, 3.0]]
    assert ref["group/rank"] == -1 and world[2]["gloo"]["group/rank"] == 1


def test_numpy_arrays_and_work_through_the_facade(world: list[dict[str, Any]]) -> None:
    for results in world:
        extra = results["sync_only"]
        assert extra["backend"] == "gloo"  # what the script asked for, as torch answers
        expected = sum(np.arange(6, dtype=np.float64).reshape(2, 3) + r for r in range(WORLD))
        assert _same(extra["numpy/all_reduce"], expected)
        assert _same(extra["numpy/broadcast"], np.full(3, 2, dtype=np.int16))
        assert extra["work/wait"] is True and extra["work/success"] is True
        assert "src" in extra["bad_src"]
        assert results["sync/after_destroy"] is False
        assert results["backend/name"] == "aiocoll"


def test_monitored_barrier_names_the_rank_that_never_arrived(world: list[dict[str, Any]]) -> None:
    missing, message, is_runtime_error = world[0]["sync_only"]["monitored/missing"]
    assert missing == [2] and is_runtime_error
    assert "2" in message and "monitored_barrier" in message
    missing, message, _ = world[1]["sync_only"]["monitored/missing"]
    assert missing == [0], message


@pytest.mark.parametrize("mode", ["sync", "backend"])
def test_a_mismatch_that_exchanges_no_message_raises_on_every_rank(
    world: list[dict[str, Any]], mode: str
) -> None:
    for rank, results in enumerate(world):
        res = results[f"{mode}/silent_mismatch"]
        assert res["error"] is not None, (rank, res)
        assert "MismatchError" in res["error"] or "different operations" in res["message"], (rank, res)
        assert "all_reduce" in res["message"] and "broadcast" in res["message"], (rank, res)
        assert res["elapsed"] < 10.0, (rank, res)  # the group's timeout is 60 s


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(int(sys.argv[2]), [int(p) for p in sys.argv[3:6]], Path(sys.argv[6]))
