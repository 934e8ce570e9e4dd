"""The GPU path on a real GPU: CUDA tensors through pinned staging, stream ordering, the torch
backend on "cuda" (device_id, DDP on a CUDA module) and `aiocoll bench --tensor torch-cuda`.

Every test here carries the ``cuda`` marker and skips without a usable CUDA device. Two or more
processes share one GPU when there is only one (rank r uses device r % count). Run with
``pytest -m cuda``; docs/PERFORMANCE.md records where and when they last ran on a GPU.

Run as a script (``python THIS torch RANK PORT RESULT``) it is one rank of the torch backend test.
"""

from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiocoll.testing.world import free_ports, run_script_ranks, run_world, unwrap


def _cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


pytestmark = [
    pytest.mark.cuda,
    pytest.mark.integration,
    pytest.mark.skipif(_cuda_missing() is not None, reason=f"needs CUDA: {_cuda_missing()}"),
    pytest.mark.timeout(300),
]

N = 2
ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------- async API, CUDA tensors


async def async_worker(pg: Any) -> dict[str, Any]:
    import torch

    from aiocoll.device._staged_ops import StagedOp

    r, n = pg.rank, pg.size
    dev = torch.device("cuda", r % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    out: dict[str, Any] = {}

    x = torch.arange(300_000, dtype=torch.float32, device=dev) * (r + 1)  # many 64 KiB chunks
    await pg.all_reduce(x)
    out["all_reduce"] = x.cpu().numpy()
    out["path"] = StagedOp.last_path  # "ipc" between processes of one host, unless disabled

    b = torch.tensor([1.5, 2.0, -3.25], dtype=torch.bfloat16, device=dev) * (r + 1)
    await pg.all_reduce(b)
    out["bfloat16"] = b.float().cpu().numpy()

    strided = torch.arange(24, dtype=torch.float64, device=dev).reshape(4, 6).t()  # not contiguous
    await pg.all_reduce(strided)
    out["strided"] = strided.cpu().numpy()

    outs = [torch.zeros(70_000, dtype=torch.int32, device=dev) for _ in range(n)]
    await pg.all_gather(outs, torch.full((70_000,), r, dtype=torch.int32, device=dev))
    out["all_gather"] = [o.cpu().numpy() for o in outs]

    bc = torch.full((50_000,), float(r), device=dev)
    await pg.broadcast(bc, src=1)
    out["broadcast"] = bc.cpu().numpy()

    if r == 0:
        await pg.send(torch.arange(100_000, dtype=torch.float32, device=dev), 1)
    elif r == 1:
        got = torch.zeros(100_000, dtype=torch.float32, device=dev)
        await pg.recv(got, 0)
        out["p2p"] = got.cpu().numpy()

    # Stream ordering: the values are written by a kernel queued behind a long sleep on a side
    # stream that is current when the operation is called; the staging must wait for it.
    side = torch.cuda.Stream(device=dev)
    late = torch.zeros(1 << 20, device=dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        late.fill_(r + 1.0)
        work = pg.all_reduce(late)
    await work
    out["ordered"] = late.cpu().numpy()
    return out


@pytest.fixture(scope="module", params=["ipc", "staged"])
def results(request: Any) -> list[dict[str, Any]]:
    env = {"AIOCOLL_STAGING_CHUNK_BYTES": str(64 * 1024)}
    if request.param == "staged":
        env["AIOCOLL_CUDA_IPC"] = "0"
    out = unwrap(run_world(async_worker, N, timeout=240, env=env))
    for res in out:
        assert res["path"] == request.param, "set AIOCOLL_TEST_LOG_LEVEL=DEBUG to see why IPC was off"
    return out


def test_collectives_on_cuda_tensors_match_numpy(results: list[dict[str, Any]]) -> None:
    total = sum(range(1, N + 1))
    for res in results:
        np.testing.assert_array_equal(res["all_reduce"], np.arange(300_000, dtype=np.float32) * total)
        np.testing.assert_array_equal(res["bfloat16"], np.array([1.5, 2.0, -3.25]) * total)
        np.testing.assert_array_equal(res["strided"], np.arange(24.0).reshape(4, 6).T * N)
        for i in range(N):
            np.testing.assert_array_equal(res["all_gather"][i], np.full(70_000, i))
        np.testing.assert_array_equal(res["broadcast"], np.full(50_000, 1.0))
        np.testing.assert_array_equal(res["ordered"], np.full(1 << 20, float(total)))
    np.testing.assert_array_equal(results[1]["p2p"], np.arange(100_000, dtype=np.float32))


# ------------------------------------------------------------------ torch backend on "cuda", DDP


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double()


def _batches(world: int) -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(world * 4, 8, generator=gen).double(), torch.randn(world * 4, 4, generator=gen).double())
        for _ in range(4)
    ]


def torch_rank(rank: int, port: int, result: str) -> None:
    import torch
    import torch.distributed as dist

    import aiocoll.torch  # noqa: F401  registers "aiocoll"

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(
        "aiocoll", rank=rank, world_size=N, timeout=datetime.timedelta(seconds=120), device_id=dev
    )
    out: dict[str, Any] = {"backend": dist.get_backend()}

    # async_op on a side stream: wait() orders the caller's stream after the results
    side = torch.cuda.Stream(device=dev)
    x = torch.zeros(1 << 20, device=dev)
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        x.fill_(rank + 1.0)
        work = dist.all_reduce(x, async_op=True)
        work.wait()
        y = x * 2  # queued on the side stream after wait(): must see the reduced values
    side.synchronize()
    out["stream_wait"] = (float(x[0]), float(y[-1]))

    model = _model().to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for xb, yb in _batches(N):
        part = slice(rank * 4, rank * 4 + 4)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xb[part].to(dev)), yb[part].to(dev)).backward()
        opt.step()
    out["params"] = [p.detach().cpu().numpy() for p in model.parameters()]
    dist.destroy_process_group()
    Path(result).write_bytes(pickle.dumps(out))


def test_torch_backend_serves_cuda_with_device_id_stream_order_and_ddp(tmp_path: Path) -> None:
    import torch

    (port,) = free_ports(1)
    files = [str(tmp_path / f"r{r}.pkl") for r in range(N)]
    run_script_ranks(
        __file__,
        [["torch", str(r), str(port), files[r]] for r in range(N)],
        tmp_path,
        timeout=240,
        token="cuda-test",
    )
    outs = [pickle.loads(Path(f).read_bytes()) for f in files]
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for xb, yb in _batches(N):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
    reference = [p.detach().numpy() for p in model.parameters()]
    total = float(sum(range(1, N + 1)))
    for out in outs:
        assert out["backend"] == "aiocoll"
        assert out["stream_wait"] == (total, 2 * total)
        for got, want in zip(out["params"], reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------------------------------ bench


def test_bench_measures_cuda_tensors_and_names_the_path() -> None:
    import torch.distributed

    # NCCL needs a device per rank (two ranks on one GPU is refused); gloo serves CUDA tensors
    # on one GPU, so the comparison runs either way.
    one_gpu_per_rank = torch.cuda.device_count() >= 2
    vs = "nccl" if torch.distributed.is_nccl_available() and one_gpu_per_rank else "gloo"
    result = _bench_cuda("--vs", vs, "--sizes", "4K,4M", "--iters", "3", "--warmup", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    rows = _table_rows(result.stdout)
    assert len(rows) == 3 and any("+staged" in cell or "+ipc" in cell for cell in rows[1])
    # gloo has no CUDA point-to-point: its columns show "-" and the header says why
    p2p = _bench_cuda(
        "--vs", "gloo", "--op", "sendrecv", "--sizes", "4K,4M", "--iters", "3", "--warmup", "1", "--quiet"
    )
    assert p2p.returncode == 0, p2p.stderr
    assert "# gloo columns show '-'" in p2p.stdout, p2p.stdout
    p2p_rows = _table_rows(p2p.stdout)
    assert len(p2p_rows) == 3 and all(row[8] == "-" and float(row[3]) > 0 for row in p2p_rows[1:]), p2p.stdout
    if not one_gpu_per_rank and torch.distributed.is_nccl_available():
        # NCCL would fail at its first call with two ranks on one device; the bench says so first
        refused = _bench_cuda("--vs", "nccl", "--sizes", "4K", timeout=60)
        assert refused.returncode != 0 and "needs a GPU per rank" in refused.stderr, refused.stderr


def _bench_cuda(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``aiocoll bench --tensor torch-cuda ARGS`` in a process of its own."""
    command = [sys.executable, "-m", "aiocoll", "bench", "--tensor", "torch-cuda", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _table_rows(stdout: str) -> list[list[str]]:
    """The bench table's lines (header row first), split into cells."""
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


if __name__ == "__main__":
    if sys.argv[1] == "torch":
        torch_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
