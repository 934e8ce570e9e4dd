"""Work: awaiting, completion state, callbacks, and blocking waits from other threads."""

from __future__ import annotations

import asyncio

import pytest

from aiocoll._errors import PeerLostError
from aiocoll._work import Work

pytestmark = pytest.mark.timeout(10)


async def test_awaiting_gives_the_result_and_state_follows_completion() -> None:
    fut = asyncio.get_running_loop().create_future()
    work = Work(fut, "all_reduce seq 0")
    assert not work.is_completed() and work.exception() is None and not work.is_success()
    asyncio.get_running_loop().call_later(0.01, fut.set_result, "tensor")
    assert await work == "tensor"
    assert work.is_completed() and work.is_success() and work.exception() is None
    assert work.result() == "tensor"
    assert await work == "tensor"  # awaiting twice is fine


async def test_failure_is_raised_on_await_and_reported_by_exception() -> None:
    fut = asyncio.get_running_loop().create_future()
    work = Work(fut)
    fut.set_exception(PeerLostError(3, "gone"))
    with pytest.raises(PeerLostError):
        await work
    exc = work.exception()
    assert isinstance(exc, PeerLostError) and exc.rank == 3
    assert work.is_completed() and not work.is_success()


async def test_cancelling_an_awaiting_task_leaves_the_operation_running() -> None:
    fut = asyncio.get_running_loop().create_future()
    work = Work(fut)

    async def waiter() -> object:
        return await work

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not fut.cancelled()
    fut.set_result(1)
    assert await work == 1


async def test_done_callbacks_run_with_the_work_also_when_added_late() -> None:
    fut = asyncio.get_running_loop().create_future()
    work = Work(fut)
    seen: list[object] = []
    work.add_done_callback(lambda w: seen.append(w))
    fut.set_result(None)
    await asyncio.sleep(0)
    work.add_done_callback(lambda w: seen.append("late"))
    await asyncio.sleep(0)
    assert seen == [work, "late"]


async def test_wait_blocks_another_thread_until_done_and_raises_the_error() -> None:
    loop = asyncio.get_running_loop()
    ok, bad = loop.create_future(), loop.create_future()
    loop.call_later(0.05, ok.set_result, 5)
    loop.call_later(0.05, bad.set_exception, PeerLostError(1))
    assert await asyncio.to_thread(Work(ok).wait, 5) is True
    with pytest.raises(PeerLostError):
        await asyncio.to_thread(Work(bad).wait, 5)


async def test_wait_times_out_and_refuses_to_block_the_loop_thread() -> None:
    fut = asyncio.get_running_loop().create_future()
    work = Work(fut, "barrier seq 4")
    with pytest.raises(TimeoutError, match="barrier seq 4"):
        await asyncio.to_thread(work.wait, 0.05)
    with pytest.raises(RuntimeError, match="event loop"):
        work.wait()
    fut.set_result(None)
    assert work.wait() is True  # done: returns at once even on the loop thread


async def test_get_future_is_a_thread_safe_future_of_the_result() -> None:
    fut = asyncio.get_running_loop().create_future()
    cf = Work(fut).get_future()
    fut.set_result("x")
    assert await asyncio.wrap_future(cf) == "x"


async def test_completed_builds_a_finished_work() -> None:
    work = Work.completed(7, "noop")
    assert work.is_completed() and await work == 7 and "noop" in repr(work)
