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


def _issue_recorded(
    loop_thread: Any,
    me: int,
    i: int,
    born: bool,
    started: list[tuple[int, int]],
    launched: list[tuple[int, int]],
    order_lock: threading.Lock,
) -> Outcome:
    """Issue call ``i`` of thread ``me``: its start notes itself in ``started`` (in the order
    calls start) and completes with ``(me, i)``, inside the start when ``born`` (a Work born
    complete) or a loop turn later; the launch is noted in ``launched`` under ``order_lock``."""

    def start() -> Any:
        started.append((me, i))
        fut = asyncio.get_running_loop().create_future()
        if born:
            fut.set_result((me, i))
        else:
            asyncio.get_running_loop().call_soon(fut.set_result, (me, i))
        return Work(fut)

    with order_lock:
        outcome = loop_thread.issue(start)
        launched.append((me, i))
    return outcome


@pytest.mark.timeout(60)
def test_calls_from_many_threads_start_in_launch_order_and_each_caller_gets_its_own_result() -> None:
    loop_thread = get_loop_thread()
    started: list[tuple[int, int]] = []  # (thread, call) in the order the loop started them
    launched: list[tuple[int, int]] = []  # the order issue() was called, under one lock
    order_lock = threading.Lock()
    errors: list[str] = []

    def caller(me: int) -> None:
        for i in range(300):
            outcome = _issue_recorded(loop_thread, me, i, i % 3 == 0, started, launched, order_lock)
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


class _BusyLoop:
    """Holds a loop thread inside a callback (so its turn is taken) until ``release``."""

    def __init__(self, loop_thread: Any) -> None:
        self.gate = threading.Event()
        entered = threading.Event()

        def hold() -> None:
            entered.set()
            self.gate.wait(20)

        loop_thread.loop.call_soon_threadsafe(hold)
        assert entered.wait(10)

    def release(self) -> None:
        self.gate.set()


def _until_the_loop_sleeps(loop_thread: Any) -> None:
    if loop_thread._poller is None:
        pytest.skip("the loop thread runs uvloop (AIOCOLL_LOOP=uvloop): no call is driven")
    deadline = time.monotonic() + 10
    while loop_thread._poller.until == 0.0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert loop_thread._poller.until > 0.0


def _recording_start(started: list[Any], key: Any, value: Any = None) -> Any:
    def start() -> Any:
        started.append((key, threading.get_ident()))
        return Work(_done_future(value if value is not None else key))

    return start


@pytest.mark.timeout(30)
def test_a_call_runs_on_its_callers_thread_when_the_loop_sleeps_and_on_the_loop_when_busy() -> None:
    loop_thread = get_loop_thread()
    started: list[Any] = []
    driven, handed = loop_thread.driven, loop_thread.handed
    _until_the_loop_sleeps(loop_thread)
    assert loop_thread.issue(_recording_start(started, "driven")).result(10) == "driven"
    assert started == [("driven", threading.get_ident())]  # no hop: it ran here
    assert (loop_thread.driven, loop_thread.handed) == (driven + 1, handed)

    busy = _BusyLoop(loop_thread)
    outcome = loop_thread.issue(_recording_start(started, "handed"))
    assert not outcome.done()  # the loop is busy: the call waits for it, it does not run here
    busy.release()
    assert outcome.result(10) == "handed"
    assert started[1] == ("handed", loop_thread.thread.ident)
    assert (loop_thread.driven, loop_thread.handed) == (driven + 1, handed + 1)


@pytest.mark.timeout(60)
def test_a_call_handed_over_but_not_started_goes_before_a_later_call_from_any_thread() -> None:
    """A caller that finds the loop's turn free still does not start its call while one handed
    to the loop before it waits to start: the later call is handed over behind it."""
    loop_thread = get_loop_thread()
    loop: Any = loop_thread.loop
    _until_the_loop_sleeps(loop_thread)  # (skips where no call is driven)
    for other_thread in (False, True):
        started: list[Any] = []
        # Calls handed over are held back on their way to the loop, which sleeps meanwhile with
        # its turn free: the moment at which a later caller could otherwise overtake them.
        on_their_way: list[tuple[Any, ...]] = []
        hand_over = loop.call_soon_threadsafe
        busy = _BusyLoop(loop_thread)
        loop.call_soon_threadsafe = lambda *args, held=on_their_way: held.append(args)
        try:
            first = loop_thread.issue(_recording_start(started, "first"))
            busy.release()
            _until_the_loop_sleeps(loop_thread)  # its turn is free
            later: list[Outcome] = []
            if other_thread:
                caller = threading.Thread(
                    target=lambda got=later, log=started: got.append(
                        loop_thread.issue(_recording_start(log, "later"))
                    )
                )
                caller.start()
                caller.join(10)
            else:
                later.append(loop_thread.issue(_recording_start(started, "later")))
            assert started == [] and len(on_their_way) == 2, "the later call overtook the first"
        finally:
            loop.call_soon_threadsafe = hand_over
        for args in on_their_way:
            hand_over(*args)
        assert first.result(10) == "first" and later[0].result(10) == "later"
        assert [key for key, _ in started] == ["first", "later"]
        # once nothing waits to start, the next call runs on its caller's thread again
        _until_the_loop_sleeps(loop_thread)
        assert loop_thread.issue(_recording_start(started, "next")).result(10) == "next"
        assert started[-1] == ("next", threading.get_ident())


@pytest.mark.timeout(60)
def test_driven_calls_from_many_threads_beside_a_busy_loop_keep_launch_order() -> None:
    """Threads that take turns driving, while the loop thread now and then holds its turn (so
    some calls are handed over and some driven), start every call in launch order."""
    loop_thread = get_loop_thread()
    started: list[tuple[int, int]] = []
    launched: list[tuple[int, int]] = []
    order_lock = threading.Lock()
    stop = threading.Event()

    def keep_loop_busy() -> None:
        while not stop.is_set():
            loop_thread.loop.call_soon_threadsafe(time.sleep, 0.0005)
            time.sleep(0.001)

    def caller(me: int) -> None:
        for i in range(300):
            outcome = _issue_recorded(loop_thread, me, i, bool(i % 2), started, launched, order_lock)
            assert outcome.result(timeout=20) == (me, i)

    _until_the_loop_sleeps(loop_thread)  # (skips where no call is driven)
    driven, handed = loop_thread.driven, loop_thread.handed
    busy = threading.Thread(target=keep_loop_busy, daemon=True)
    busy.start()
    try:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(50)
    finally:
        stop.set()
    assert len(launched) == 1200 and started == launched
    assert loop_thread.driven > driven and loop_thread.handed > handed  # both paths were taken


@pytest.mark.timeout(30)
def test_a_blocking_call_from_a_handler_that_interrupted_a_driven_start_raises_not_hangs() -> None:
    """The handler runs inside the core on the driving thread, which holds the loop's turn: its
    blocking call (or wait) could only wait for ever, so it raises at once; the interrupted
    call completes, and the next blocking call works."""
    from aiocoll._errors import DistError

    loop_thread = get_loop_thread()
    events: list[Any] = []
    waiting = loop_thread.issue(lambda: Work(asyncio.get_running_loop().create_future()))

    def handler(*_: object) -> None:
        for blocking in (lambda: loop_thread.issue(lambda: Work(_done_future(1))), waiting.wait):
            try:
                blocking()
                events.append("no error")
            except DistError as exc:
                events.append(str(exc))

    def start() -> Any:
        os.kill(os.getpid(), signal.SIGUSR2)
        deadline = time.monotonic() + 5
        while len(events) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)  # the handler runs here, inside the start
        return Work(_done_future("outer"))

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        _until_the_loop_sleeps(loop_thread)
        assert loop_thread.issue(start).result(10) == "outer"
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert len(events) == 2 and all("while this thread was starting" in e for e in events), events
    assert loop_thread.issue(lambda: Work(_done_future("next"))).result(10) == "next"


@pytest.mark.timeout(30)
def test_a_driven_start_that_raises_or_fails_later_reaches_the_caller_as_on_the_loop() -> None:
    loop_thread = get_loop_thread()

    def refuse() -> Any:
        raise ValueError("bad argument, rank 0")

    def fail_later() -> Any:
        fut = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.05, fut.set_exception, RuntimeError("peer lost"))
        return Work(fut)

    for busy in (False, True):
        if not busy:
            _until_the_loop_sleeps(loop_thread)
        hold = _BusyLoop(loop_thread) if busy else None
        driven = loop_thread.driven
        refused = loop_thread.issue(refuse)
        failed = loop_thread.issue(fail_later)
        if hold is not None:
            hold.release()
        assert loop_thread.driven == driven + (0 if busy else 2)
        with pytest.raises(ValueError, match="bad argument"):
            refused.wait_launched(10)
        failed.wait_launched(10)  # launched fine: its failure comes later, from the loop's timer
        with pytest.raises(RuntimeError, match="peer lost"):
            failed.result(10)


@pytest.mark.timeout(30)
def test_in_asyncio_debug_mode_every_call_is_handed_to_the_loop_thread() -> None:
    """asyncio's debug mode refuses a loop's calls from another thread: no call is driven."""
    loop_thread = get_loop_thread()
    started: list[Any] = []
    loop_thread.loop.set_debug(True)
    try:
        _until_the_loop_sleeps(loop_thread)
        driven = loop_thread.driven
        assert loop_thread.issue(_recording_start(started, "in debug")).result(10) == "in debug"
        assert started == [("in debug", loop_thread.thread.ident)] and loop_thread.driven == driven
    finally:
        loop_thread.loop.call_soon_threadsafe(loop_thread.loop.set_debug, False)
        loop_thread.call(lambda: None, timeout=10)
