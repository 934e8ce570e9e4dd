"""The loop-thread bridge of aiocoll.sync and aiocoll.torch (aiocoll/_sync_loop.py): launch order
across threads, results and errors handed to the right caller, waits that time out and wait again,
callbacks off the loop thread. Real threads and the real loop thread; no network."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from aiocoll._sync_loop import Outcome, get_loop_thread
from aiocoll._work import Work


@pytest.mark.timeout(60)
def test_calls_from_many_threads_start_in_launch_order_and_each_caller_gets_its_own_result() -> None:
    loop_thread = get_loop_thread()
    started: list[tuple[int, int]] = []  # (thread, call) in the order the loop started them
    launched: list[tuple[int, int]] = []  # the order issue() was called, under one lock
    order_lock = threading.Lock()
    errors: list[str] = []

    def caller(me: int) -> None:
        for i in range(300):

            def start(me: int = me, i: int = i) -> Any:
                started.append((me, i))
                fut = asyncio.get_running_loop().create_future()
                if i % 3 == 0:
                    fut.set_result((me, i))  # born complete: settled inside the start
                else:
                    asyncio.get_running_loop().call_soon(fut.set_result, (me, i))
                return Work(fut)

            with order_lock:
                outcome = loop_thread.issue(start)
                launched.append((me, i))
            got = outcome.result(timeout=20)
            if got != (me, i):
                errors.append(f"thread {me} call {i} got {got}")

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors
    assert started == launched  # issue order is launch order, whichever thread issued


@pytest.mark.timeout(30)
def test_a_wait_that_times_out_leaves_the_thread_able_to_wait_again() -> None:
    loop_thread = get_loop_thread()
    gate = threading.Event()

    async def slow() -> str:
        await asyncio.to_thread(gate.wait, 20)  # the test thread opens it
        return "done"

    outcome = loop_thread.issue(slow)
    assert outcome.wait(0.05) is False and not outcome.done()
    with pytest.raises(TimeoutError):
        outcome.result(0.01)
    gate.set()
    assert outcome.wait(10) is True and outcome.result() == "done"
    # the thread's waiter is ready for the next call (not left released by a stale wake-up)
    again = loop_thread.issue(slow)
    assert again.result(10) == "done"


@pytest.mark.timeout(60)
def test_timeouts_racing_completion_never_lose_or_leak_a_wake_up() -> None:
    """Waits whose timeout ends just as the loop settles the operation: each wait either sees it
    done or returns False, and the next wait of the same thread still blocks until settled."""
    loop_thread = get_loop_thread()
    for i in range(400):
        outcome = Outcome()
        delay = (i % 7) * 1e-5
        loop_thread.loop.call_soon_threadsafe(
            lambda o=outcome, d=delay, i=i: loop_thread.loop.call_later(d, o._set_result, i)
        )
        if outcome.wait(delay):
            assert outcome.done()
        assert outcome.wait(10) is True and outcome.result() == i
        pending = Outcome()
        assert pending.wait(0.0005) is False  # a stale wake-up would make this True


@pytest.mark.timeout(30)
def test_errors_reach_the_caller_and_call_time_errors_reach_wait_launched() -> None:
    loop_thread = get_loop_thread()

    def refuse() -> Any:
        raise ValueError("bad argument, rank 0")

    refused = loop_thread.issue(refuse)
    with pytest.raises(ValueError, match="bad argument"):
        refused.wait_launched(10)
    with pytest.raises(ValueError, match="bad argument"):
        refused.result(10)

    async def fail() -> None:
        raise RuntimeError("peer lost")

    failed = loop_thread.issue(fail)
    failed.wait_launched(10)  # launched fine: its failure comes later
    assert isinstance(failed.exception(10), RuntimeError)
    with pytest.raises(RuntimeError, match="peer lost"):
        failed.result()


@pytest.mark.timeout(30)
def test_done_callbacks_run_off_the_loop_thread_and_all_of_waits_for_every_outcome() -> None:
    loop_thread = get_loop_thread()
    ran_on: list[str] = []
    seen = threading.Event()

    async def value(x: int) -> int:
        await asyncio.sleep(0.01 * x)
        return x

    first = loop_thread.issue(lambda: value(1))
    first.add_done_callback(lambda o: (ran_on.append(threading.current_thread().name), seen.set()))
    assert seen.wait(10) and ran_on and ran_on[0] != loop_thread.thread.name
    late: list[int] = []
    first.add_done_callback(lambda o: late.append(o.result()))  # added after it finished
    deadline = time.monotonic() + 10
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late == [1]

    async def boom() -> None:
        raise KeyError("second")

    parts = [loop_thread.issue(lambda: value(3)), loop_thread.issue(boom)]
    parts.append(loop_thread.issue(lambda: value(0)))
    combined = Outcome.all_of(parts)
    assert combined.wait(10) and all(p.done() for p in parts)
    assert isinstance(combined.exception(), KeyError)
    assert Outcome.all_of([]).result(1) is None
