"""DistributedDataParallel on the "aiocoll" torch backend, with and without comm hooks.

One world of 2 processes trains a small MLP several ways and writes what it measured; the tests
assert on it:
- plain DDP (one gradient bucket, and many tiny buckets) ends with the parameters of
  single-process training on the concatenated batch;
- the fp16-compression hook gives what the same hook gives on gloo (run first, in the same
  processes), and stays near the uncompressed reference;
- the PowerSGD hook trains (loss falls) and leaves every rank with the same parameters;
- an operation's failure reaches the caller's ``wait()`` (and the future), naming the rank.

Run as a script (``python THIS worker RANK PORT_GLOO PORT_AIOCOLL RESULT``) it is one rank.
"""

from __future__ import annotations

import datetime
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from aiocoll.testing.preload import TORCH
from aiocoll.testing.world import free_ports, run_script_ranks

WORLD = 2
STEPS = 6
BATCH = 8  # per rank
pytestmark = [pytest.mark.integration, pytest.mark.torch]


# ------------------------------------------------------------------------------ the worker side


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    # 32x32 weights so PowerSGD really compresses (rank-1 factors are far smaller than the matrix).
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 4),
    ).double()


def _batches() -> list[tuple[Any, Any]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(WORLD * BATCH, 8, generator=gen).double(),
            torch.randn(WORLD * BATCH, 4, generator=gen).double(),
        )
        for _ in range(STEPS)
    ]


def _params(model: Any) -> list[Any]:
    return [p.detach().clone() for p in model.parameters()]


def _reference() -> tuple[list[Any], list[Any]]:
    """Single-process training on the concatenated batch; returns (initial, final) parameters."""
    import torch

    model = _model()
    initial = _params(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return initial, _params(model)


def _train_ddp(
    rank: int, hook: Any = None, state: Any = None, *, fixed_batch: bool = False, **ddp_kwargs: Any
) -> tuple[list[Any], list[float]]:
    """DDP training on this rank's half of each batch (or of the first batch, over and over)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(), **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    batches = _batches()
    for x, y in [batches[0]] * (2 * STEPS) if fixed_batch else batches:
        part = slice(rank * BATCH, (rank + 1) * BATCH)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[part]), y[part])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return _params(ddp.module), losses


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def worker(rank: int, port_gloo: int, port_aiocoll: int, result: Path) -> None:
    warnings.simplefilter("ignore")
    t0 = time.monotonic()

    def mark(what: str) -> None:
        print(f"rank {rank}: {what} at {time.monotonic() - t0:.1f}s", flush=True)

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    initial, reference = _reference()
    init = {"rank": rank, "world_size": WORLD, "timeout": datetime.timedelta(seconds=60)}

    mark("reference")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port_gloo}", **init)
    mark("gloo init")
    gloo_fp16, _ = _train_ddp(rank, default_hooks.fp16_compress_hook)
    mark("gloo trained")
    dist.destroy_process_group()
    mark("gloo destroyed")

    import aiocoll.torch  # noqa: F401 - registers the backend

    dist.init_process_group("aiocoll", init_method=f"tcp://127.0.0.1:{port_aiocoll}", **init)
    out["backend"] = dist.get_backend()
    mark('out["backend"] = dist.get_back')
    out["moved"] = _max_diff(initial, reference)

    params, _ = _train_ddp(rank)
    out["plain"] = _max_diff(params, reference)
    mark('out["plain"] = _max_diff(param')
    params, _ = _train_ddp(rank, bucket_cap_mb=0.001)
    out["plain/many_buckets"] = _max_diff(params, reference)

    params, _ = _train_ddp(rank, default_hooks.fp16_compress_hook)
    out["fp16/vs_gloo"] = _max_diff(params, gloo_fp16)
    out["fp16/vs_reference"] = _max_diff(params, reference)
    mark('out["fp16/vs_reference"] = _ma')

    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=0.5
    )
    params, losses = _train_ddp(rank, powersgd.powerSGD_hook, state, fixed_batch=True, bucket_cap_mb=100)
    out["powersgd/losses"] = losses
    out["powersgd/compressed"] = state.total_numel_after_compression < state.total_numel_before_compression
    gathered: list[Any] = [None] * WORLD
    dist.all_gather_object(gathered, params)
    out["powersgd/ranks_agree"] = _max_diff(gathered[0], gathered[1]) == 0.0
    mark('out["powersgd/ranks_agree"] = ')

    # An operation that cannot complete: only rank 0 calls all_reduce on a group with a 3 s
    # timeout, so its wait() must raise CollectiveTimeout naming rank 1.
    lonely = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 0:
        work = dist.all_reduce(torch.ones(3), group=lonely, async_op=True)
        try:
            work.wait()
            out["timeout/error"] = None
        except Exception as exc:
            out["timeout/error"] = (type(exc).__name__, getattr(exc, "missing_ranks", None), str(exc))
        try:
            work.get_future().wait()
            out["timeout/future_error"] = None
        except Exception as exc:
            out["timeout/future_error"] = (isinstance(exc, RuntimeError), str(exc))
    # Ranks that call different sizes at the same sequence number both get MismatchError.
    mismatched = dist.new_group([0, 1])
    work = dist.all_reduce(torch.ones(4 + rank), group=mismatched, async_op=True)
    try:
        work.wait()
        out["mismatch/error"] = None
    except Exception as exc:
        out["mismatch/error"] = (type(exc).__name__, isinstance(exc, RuntimeError))
    mark("errors")
    dist.barrier()
    dist.destroy_process_group()
    result.write_bytes(pickle.dumps(out))


# ------------------------------------------------------------------------------ the test side


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("ddp")
    ports = [str(p) for p in free_ports(2)]
    args = [["worker", str(r), *ports, str(tmp / f"rank{r}.pkl")] for r in range(WORLD)]
    run_script_ranks(__file__, args, tmp, timeout=150, token="ddp-test", preload=TORCH)
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


@pytest.mark.timeout(170)
def test_ddp_ends_with_the_parameters_of_single_process_training(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["backend"] == "aiocoll"
        assert out["moved"] > 1e-3, "training must move the parameters for the comparison to mean anything"
        assert out["plain"] < 1e-6
        assert out["plain/many_buckets"] < 1e-6


def test_fp16_compression_hook_matches_gloo(world: list[dict[str, Any]]) -> None:
    for out in world:
        assert out["fp16/vs_gloo"] < 1e-6
        assert out["fp16/vs_reference"] < 1e-2


def test_powersgd_hook_trains_and_ranks_agree(world: list[dict[str, Any]]) -> None:
    for out in world:
        losses = out["powersgd/losses"]
        assert losses[-1] < losses[0], losses
        assert out["powersgd/compressed"]
        assert out["powersgd/ranks_agree"]


def test_a_failed_operation_raises_from_wait_naming_the_rank(world: list[dict[str, Any]]) -> None:
    name, missing, message = world[0]["timeout/error"]
    assert name == "CollectiveTimeout" and missing == [1], message
    # torch's future carries the error as a RuntimeError holding our message.
    is_runtime_error, future_message = world[0]["timeout/future_error"]
    assert is_runtime_error and "CollectiveTimeout" in future_message and "[1]" in future_message
    for out in world:
        assert out["mismatch/error"] == ("MismatchError", True)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
