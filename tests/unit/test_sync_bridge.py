"""The loop-thread bridge of aiocoll.sync and aiocoll.torch (aiocoll/_sync_loop.py): launch order
across threads, results and errors handed to the right caller, waits that time out and wait again,
callbacks off the loop thread. Real threads and the real loop thread; no network."""

from __future__ import annotations

import asyncio
import os
import signal
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
    assert Outcome().wait(0.01) is False  # no wake-up of the timed-out waits was left behind
    gate.set()
    assert outcome.wait(10) is True and outcome.result() == "done"
    assert Outcome().wait(0.01) is False  # nor of the wait that was woken
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


@pytest.mark.timeout(30)
def test_a_wait_nested_in_a_signal_handler_does_not_take_the_outer_waits_wake_up() -> None:
    """A handler that calls a blocking operation (a SIGTERM handler that checkpoints and calls
    dist.barrier()) while the main thread is parked in another: each wait gets its own wake-up,
    the settling thread never fails, and the outer wait returns when its operation completes."""
    outer, inner = Outcome(), Outcome()
    settling_errors: list[BaseException] = []

    def settle_both() -> None:
        try:
            time.sleep(0.3)
            outer._set_result("outer")
            time.sleep(0.3)
            inner._set_result("inner")
        except BaseException as exc:  # a lock released twice would land here
            settling_errors.append(exc)

    seen_in_handler: list[object] = []

    def handler(*_: object) -> None:
        seen_in_handler.append(inner.result(10))

    previous = signal.signal(signal.SIGUSR2, handler)  # SIGALRM is pytest-timeout's
    try:
        threading.Thread(target=settle_both, daemon=True).start()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        assert outer.result(5) == "outer"
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert seen_in_handler == ["inner"] and not settling_errors
    assert Outcome().wait(0.01) is False  # and no wake-up is left for the thread's next wait


@pytest.mark.timeout(30)
def test_a_wait_interrupted_by_keyboardinterrupt_leaves_the_next_wait_blocking() -> None:
    interrupted = Outcome()

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR2, interrupt)
    try:
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(KeyboardInterrupt):
            interrupted.wait(5)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    interrupted._set_result("late")  # the interrupted wait's entry is gone: nothing is released
    assert Outcome().wait(0.01) is False
    later = Outcome()
    threading.Timer(0.05, later._set_result, ("next",)).start()
    assert later.result(5) == "next"


@pytest.mark.timeout(60)
def test_a_forked_child_starts_its_own_loop_thread() -> None:
    """The child of a process whose loop thread runs gets a loop thread of its own (the inherited
    one never runs there), so a blocking call in the child completes instead of hanging."""
    parent_thread = get_loop_thread()
    assert parent_thread.call(lambda: 1, timeout=10) == 1
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            child_thread = get_loop_thread()
            outcome = child_thread.issue(lambda: asyncio.sleep(0, "child"))
            if child_thread is not parent_thread and outcome.result(10) == "child":
                code = 0
        finally:
            os.write(write_end, bytes([code]))
            os._exit(code)
    os.close(write_end)
    try:
        answer = os.read(read_end, 1)
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    assert answer == bytes([0]), "the forked child's blocking call did not complete"


@pytest.mark.timeout(30)
def test_a_caller_parked_when_its_loop_thread_dies_gets_an_error_not_a_hang(monkeypatch: Any) -> None:
    from aiocoll import _sync_loop
    from aiocoll._errors import DistError

    monkeypatch.setattr(_sync_loop, "_BACKSTOP_S", 0.05)
    doomed = _sync_loop.LoopThread(name="aiocoll-loop-doomed")  # not the process's loop thread
    never = doomed.issue(lambda: Work(asyncio.get_running_loop().create_future()))
    never.wait_launched(timeout=10)
    settled = doomed.issue(lambda: Work(asyncio.get_running_loop().create_future()))
    settled.wait_launched(timeout=10)

    def die() -> None:
        settled._set_result("settled as the loop ended")  # its release races the thread's end
        doomed.loop.stop()  # run_forever returns: the thread ends and settles nothing more

    doomed.loop.call_soon_threadsafe(die)
    with pytest.raises(DistError, match="loop thread stopped while this call waited"):
        never.result()
    assert not doomed.thread.is_alive()
    assert settled.result() == "settled as the loop ended"  # what was settled is not lost
    # the process's own loop thread is untouched
    ok = get_loop_thread().issue(lambda: Work(_done_future("fine")))
    assert ok.result(timeout=10) == "fine"


def _done_future(value: Any) -> asyncio.Future[Any]:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(value)
    return fut
