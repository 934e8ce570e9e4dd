"""What the "aiocoll" torch backend says when things go wrong or are not offered (3 ranks).

One world of 3 processes (torch.distributed on backend "aiocoll") records what each call raised;
the tests assert on it:
- ``ProcessGroup.monitored_barrier`` on the group itself: passes when all arrive; rank 0 names the
  missing rank (or all missing ranks with ``wait_all_ranks``) in torch's words, the others say
  rank 0 did not release them;
- a timeout says "Timed out" (what torch's tests and users' retry code match) and names the
  group as the user made it (its ``group_desc``), not aiocoll's internal id;
- ``set_timeout`` changes a group's later deadlines;
- what the backend cannot do raises at the call with what to use instead (a tensor on another
  device, ``_register_on_completion_hook``), and leaves the group usable; device-level coalescing works.

torch's own tests of the same features (all_gather_coalesced's layout, sparse all_reduce, barrier
timeouts, monitored_barrier's rank-0 timeout) run against gloo in test_torch_suite_subset.py.

Run as a script (``python THIS worker RANK PORT RESULT``) it is one rank.
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

WORLD = 3
pytestmark = [pytest.mark.integration, pytest.mark.torch]


def _outcome(call: Any) -> Any:
    try:
        call()
        return None
    except Exception as exc:
        return (type(exc).__name__, isinstance(exc, RuntimeError), str(exc))


def worker(rank: int, port: int, result: Path) -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    import aiocoll.torch  # noqa: F401

    dist.init_process_group("aiocoll", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    out: dict[str, Any] = {}
    second = datetime.timedelta(seconds=1)

    everyone = dist.new_group(list(range(WORLD)))
    out["monitored/all"] = _outcome(lambda: everyone.monitored_barrier(datetime.timedelta(seconds=30)))
    dist.barrier()
    # rank 2 stays away: rank 0 names it, rank 1 hears that rank 0 did not release it.
    first_missing = dist.new_group(list(range(WORLD)))
    if rank != 2:
        out["monitored/missing"] = _outcome(lambda: first_missing.monitored_barrier(second))
    dist.barrier()
    all_missing = dist.new_group(list(range(WORLD)))
    if rank == 0:
        out["monitored/all_missing"] = _outcome(
            lambda: all_missing.monitored_barrier(second, wait_all_ranks=True)
        )
    dist.barrier()

    # A timeout names the group as the user described it, in words torch's users match.
    trainers = dist.new_group([0, 1], timeout=second, group_desc="trainers")
    if rank == 0:
        out["timeout"] = _outcome(lambda: dist.barrier(group=trainers))
    dist.barrier()
    slow = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=300))
    if rank == 0:
        slow.set_timeout(second)
        started = time.monotonic()
        out["set_timeout"] = (_outcome(lambda: dist.barrier(group=slow)), time.monotonic() - started)
    dist.barrier()

    # What the backend does not offer raises at the call, saying what to use instead.
    out["device"] = _outcome(lambda: dist.all_reduce(torch.ones(2, device="meta")))

    # Device-level coalescing (torch's _coalescing_manager with a device): the Work it returns
    # covers every operation inside.
    a, b = torch.full((2,), float(rank)), torch.ones(3)
    with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    out["coalescing"] = (a.tolist(), b.tolist())
    out["on_completion_hook"] = _outcome(lambda: dist.group.WORLD._register_on_completion_hook(print))
    # The world is still usable afterwards.
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    out["after"] = t.tolist()
    dist.barrier()
    dist.destroy_process_group()
    result.write_bytes(pickle.dumps(out))


# ------------------------------------------------------------------------------ the test side


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("torch-limits")
    port = str(free_ports(1)[0])
    args = [["worker", str(r), port, str(tmp / f"rank{r}.pkl")] for r in range(WORLD)]
    run_script_ranks(__file__, args, tmp, timeout=100, token="torch-limits-test", preload=TORCH)
    return [pickle.loads((tmp / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


@pytest.mark.timeout(120)
def test_monitored_barrier_on_the_group_names_the_missing_ranks_in_torchs_words(
    world: list[dict[str, Any]],
) -> None:
    assert all(out["monitored/all"] is None for out in world)
    name, is_runtime, message = world[0]["monitored/missing"]
    assert name == "CollectiveTimeout" and is_runtime
    assert "Rank 2 failed to pass monitoredBarrier in 1000 ms" in message, message
    name, _, message = world[1]["monitored/missing"]
    assert "Rank 1 successfully reached monitoredBarrier, but received errors while waiting" in message, (
        message
    )
    assert "rank 0" in message
    _, _, message = world[0]["monitored/all_missing"]
    assert "Ranks 1, 2 failed to pass monitoredBarrier" in message, message


def test_a_timeout_says_timed_out_and_names_the_users_group(world: list[dict[str, Any]]) -> None:
    name, is_runtime, message = world[0]["timeout"]
    assert name == "CollectiveTimeout" and is_runtime
    assert " Timed out " in message and "'trainers'" in message, message
    assert "'w'" not in message, message
    assert "[1]" in message, message  # the rank that did not come


def test_set_timeout_changes_the_groups_later_deadlines(world: list[dict[str, Any]]) -> None:
    error, took = world[0]["set_timeout"]
    assert error is not None and error[0] == "CollectiveTimeout", error
    assert took < 30, took  # 1 s asked (the group was made with 300 s)


def test_what_the_backend_cannot_do_raises_at_the_call_with_what_to_use(world: list[dict[str, Any]]) -> None:
    for out in world:
        name, _, message = out["device"]
        assert name == "ValueError" and "device meta" in message and ".cpu()" in message, message
        assert out["coalescing"] == ([3.0, 3.0], [3.0, 3.0, 3.0])
        name, is_runtime, message = out["on_completion_hook"]
        assert name == "NotImplementedError" and is_runtime and "get_future().then" in message, message
        assert out["after"] == [3.0, 3.0]  # 0 + 1 + 2: the world still works


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
