"""The "aiocoll" torch.distributed backend inside one process: registration, Work and futures.

Multi-process behaviour (every collective against gloo, DDP and its hooks) is tested in
test_sync_differential.py and test_ddp.py; this file checks, in a world of one, what c10d and
users touch directly: registration, the group's name, the Work and its torch future, where
callbacks run, and that a failure reaches ``wait()`` and the future.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.torch, pytest.mark.timeout(60)]
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    import aiocoll.torch

    mp = pytest.MonkeyPatch()
    mp.setenv("AIOCOLL_TOKEN", "torch-backend-test")
    dist.init_process_group("aiocoll", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield aiocoll.torch
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        mp.undo()


def test_importing_registers_the_backend(world: Any) -> None:
    assert "aiocoll" in dist.Backend.backend_list
    assert dist.get_backend() == "aiocoll"
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, world.AiocollProcessGroup)
    assert isinstance(pg.group_name, str)
    assert pg.getBackendName() == "aiocoll"


def test_work_future_holds_the_output_tensors_and_runs_callbacks_off_the_loop(world: Any) -> None:
    t = torch.arange(4.0)
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, dist.Work)
    seen: list[str] = []

    def double(fut: Any) -> Any:
        seen.append(threading.current_thread().name)
        return fut.value()[0] * 2

    doubled = work.get_future().then(double).wait()
    assert torch.equal(doubled, torch.arange(4.0) * 2)
    assert work.wait() is True and work.is_completed() and work.is_success()
    assert [x.tolist() for x in work.result()] == [[0.0, 1.0, 2.0, 3.0]]
    assert seen and seen[0] != "aiocoll-loop"


def test_a_failed_operation_raises_from_wait_and_fails_the_future(world: Any) -> None:
    # A bitwise reduction of floats: refused by aiocoll (torch does not check it itself).
    work = dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, async_op=True)
    with pytest.raises(TypeError, match=r"(?i)band"):
        work.wait()
    assert not work.is_success()
    with pytest.raises(RuntimeError):
        work.get_future().wait()


def test_each_call_reads_its_own_reduce_op(world: Any) -> None:
    # (c10d's reduce ops are looked up in a cache: a refused op and an accepted one, alternately)
    ops = ((dist.ReduceOp.SUM, False), (dist.ReduceOp.BAND, True), (dist.ReduceOp.MAX, False))
    for _ in range(2):
        for op, refused in ops:
            t = torch.ones(2)
            if refused:
                with pytest.raises(TypeError, match=r"(?i)band"):
                    dist.all_reduce(t, op=op)
            else:
                dist.all_reduce(t, op=op)
                assert torch.equal(t, torch.ones(2))


def test_new_group_and_group_collectives(world: Any) -> None:
    g = dist.new_group([0])
    t = torch.ones(3)
    dist.all_reduce(t, group=g)
    out = [torch.zeros(3)]
    dist.all_gather(out, t, group=g)
    assert torch.equal(out[0], torch.ones(3))
    assert dist.get_rank(g) == 0 and dist.get_world_size(g) == 1
    dist.destroy_process_group(g)


def test_shutdown_twice_is_fine(world: Any) -> None:
    g = dist.new_group([0])
    backend = g if isinstance(g, world.AiocollProcessGroup) else None
    assert backend is not None
    backend.shutdown()
    backend.shutdown()


def test_sync_facade_rendezvous_through_a_torch_store(world: Any) -> None:
    import aiocoll.sync as sdist

    torch_store = dist.HashStore()
    sdist.init_process_group(store=torch_store, rank=0, world_size=1)
    try:
        t = torch.arange(3.0)
        sdist.all_reduce(t, op=dist.ReduceOp.MAX)  # torch's ReduceOp is accepted too
        assert torch.equal(t, torch.arange(3.0))
        assert torch_store.num_keys() > 0  # the peer address went through torch's store
    finally:
        sdist.destroy_process_group()
