"""The blocking store client (client/control/_blocking_store.py, what ``aiocoll.sync.TCPStore`` uses)
against real coordinator processes on loopback: every operation, sets that are not answered, a
refused set reported by a later call, threads sharing one client, reconnection through a fault
proxy (sets re-sent once, mutations answered from the coordinator's memory, concurrent adds
through repeated cuts), a crash and restart with --state-dir, an outage during which connections
are accepted and closed, a silent coordinator, and the torch-style TCPStore over it.

The client is synchronous. Tests without a fault proxy call it from plain threads; tests with one
(the proxy runs on the test's event loop) call it through ``asyncio.to_thread``."""

from __future__ import annotations

import asyncio
import datetime
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiocoll.client.control._blocking_store import BlockingStoreClient

from aiocoll import StoreError, StoreTimeout, sync
from aiocoll.testing.coordinator import CoordinatorProcess
from aiocoll.testing.fault_proxy import FaultProxy

pytestmark = pytest.mark.integration

TOKEN = "blocking-store-secret"
MAX_VALUE = 1 << 20  # the shared coordinator's --max-value-bytes


def _coordinator(tmp: Path, *args: str, port: int = 0) -> CoordinatorProcess:
    log_path = tmp / f"coordinator-{uuid.uuid4().hex[:8]}.log"
    return CoordinatorProcess(log_path, *args, token=TOKEN, port=port)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    proc = _coordinator(tmp_path_factory.mktemp("blocking-store"), "--max-value-bytes", str(MAX_VALUE))
    yield proc
    proc.stop()


def _job(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex}"


def _client(port: int, job: str, timeout: float = 20) -> BlockingStoreClient:
    return BlockingStoreClient("127.0.0.1", port, token=TOKEN, job=job, timeout=timeout)


def _wait_for(condition: Callable[[], bool], what: str, seconds: float = 10) -> None:
    """Poll (from a plain thread) until ``condition()`` holds."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {seconds} s")
        time.sleep(0.002)


async def _until(condition: Callable[[], bool], what: str, *, twice: bool = False) -> None:
    """Wait (20 s at most) until the blocking ``condition()``, run on a thread, holds (on two
    checks in a row if ``twice``)."""
    deadline = time.monotonic() + 20
    held = 0
    while held < (2 if twice else 1):
        held = held + 1 if await asyncio.to_thread(condition) else 0
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within 20 s")
        await asyncio.sleep(0.005)


class _Writers:
    """Threads that each add 1 to "counter" and append their own entry to "log" on one shared
    client, until stopped; every answer and every failure is kept."""

    def __init__(self, store: BlockingStoreClient, count: int) -> None:
        self.store = store
        self.stop = threading.Event()
        self.seen: list[int] = []  # every value an add answered with
        self.appended: list[str] = []
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, args=(n,), daemon=True) for n in range(count)]
        for t in self.threads:
            t.start()

    def _run(self, n: int) -> None:
        i = 0
        try:
            while not self.stop.is_set():
                self.seen.append(self.store.add("counter", 1))
                self.store.append("log", f"{n}.{i},".encode())
                self.appended.append(f"{n}.{i}")
                i += 1
        except BaseException as exc:
            self.errors.append(exc)

    def check_alive(self) -> None:
        """Fail now (not after a long wait) when a writer's add or append raised."""
        if self.errors:
            raise AssertionError(f"a writer's add or append failed: {self.errors[0]!r}") from self.errors[0]

    async def finish(self, seconds: float = 15) -> None:
        """Stop them; each must be done within ``seconds`` (a reconnect takes far less)."""
        self.stop.set()
        deadline = time.monotonic() + seconds
        for t in self.threads:
            await asyncio.to_thread(t.join, max(0.0, deadline - time.monotonic()))
        self.check_alive()
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} writer(s) still blocked in add or append {seconds} s after the last fault"

    def check_exactly_once(self, counter: int, log: bytes) -> None:
        entries = log.decode().split(",")[:-1]
        assert counter == len(self.seen) > 0
        assert sorted(self.seen) == list(range(1, counter + 1)), "every add answered once, with its own value"
        assert sorted(entries) == sorted(self.appended) and len(set(entries)) == len(entries)


@pytest.mark.timeout(30)
def test_every_operation_round_trips_against_a_real_coordinator(coordinator: CoordinatorProcess) -> None:
    job = _job("ops")
    store = _client(coordinator.port, job)
    other = _client(coordinator.port, job)
    try:
        store.set("a", b"1")
        store.set("text", "str values are utf-8")
        assert store.get("a") == b"1"
        assert store.get("text", timeout=datetime.timedelta(seconds=5)) == b"str values are utf-8"

        assert store.add("n", 5) == 5
        assert store.add("n", -2) == 3
        assert store.add("n", 0) == 3
        assert store.get("n") == b"3"

        # torch's compareSet
        assert store.compare_set("cas", b"", b"new") == b"new"  # missing, expected empty: set
        assert store.compare_set("absent", b"old", b"new") == b"old"  # missing, other: nothing
        assert not store.check(["absent"])
        assert store.compare_set("cas", b"wrong", b"two") == b"new"  # mismatch: the current value
        assert store.compare_set("cas", "new", "two") == b"two"  # match: swapped
        assert store.get("cas") == b"two"

        store.wait(["a", "n"])
        store.wait(["a"], timeout=datetime.timedelta(seconds=1))
        with pytest.raises(StoreTimeout) as info:
            store.wait(["a", "never"], timeout=0.3)
        assert info.value.keys == ["never"]
        assert store.check(["a", "n", "cas"])
        assert not store.check(["a", "never"])

        assert store.num_keys() == 4  # a, text, n, cas
        assert store.delete_key("text") is True
        assert store.delete_key("text") is False
        assert store.num_keys() == 3

        store.multi_set(["m1", "m2"], [b"x", "y"])
        assert store.multi_get(["m1", "m2", "a"]) == [b"x", b"y", b"1"]
        with pytest.raises(StoreTimeout) as info:
            store.multi_get(["m1", "nowhere"], timeout=0.3)
        assert info.value.keys == ["nowhere"]

        store.append("log", b"ab")
        store.append("log", "cd")
        assert store.get("log") == b"abcd"

        started = time.monotonic()
        with pytest.raises(StoreTimeout) as info:
            store.get("missing", timeout=0.3)
        assert time.monotonic() - started < 3
        assert info.value.keys == ["missing"]
        assert "'missing'" in str(info.value) and job in str(info.value)
        assert store.get("a") == b"1", "the client goes on after a timeout"

        # Another client of the job sees all of it.
        store.flush()
        assert other.multi_get(["a", "n", "cas", "m1", "m2", "log"]) == [
            b"1",
            b"3",
            b"two",
            b"x",
            b"y",
            b"abcd",
        ]
        assert other.num_keys() == 6
        assert other.add("n", 10) == 13
        assert store.get("n") == b"13"
    finally:
        store.close()
        other.close()
    store.close()  # twice is fine


@pytest.mark.timeout(30)
def test_sets_are_not_answered_until_a_later_reply_or_flush_settles_them(
    coordinator: CoordinatorProcess,
) -> None:
    job = _job("unanswered")
    store = _client(coordinator.port, job)
    other = _client(coordinator.port, job)
    try:
        store.set("k", b"v1")
        store.set("k", b"v2")
        assert store._core.no_reply_unsettled == 2, "a set returns before it is acknowledged"
        # Replies come in request order on a connection: a later get sees the last value, and
        # its reply acknowledges the sets before it.
        assert store.get("k") == b"v2"
        assert store._core.no_reply_unsettled == 0

        store.set("j", b"1")
        store.multi_set(["m1", "m2"], [b"a", b"b"])
        store.append("log", b"x")
        assert store._core.no_reply_unsettled == 3
        store.flush()
        assert store._core.no_reply_unsettled == 0 and not store._core.unsettled
        # flush means the coordinator has them: another connection sees them at once.
        assert other.check(["j", "m1", "m2", "log"])
        store.flush()  # nothing to settle: returns at once

        # More sets than the coordinator remembers replies for (DEDUPE_WINDOW): the client asks
        # for acknowledgements itself on the way, and none is lost or reordered.
        for i in range(1500):
            store.set(f"s{i % 10}", str(i))
        assert store._core.no_reply_unsettled > 0
        store.flush()
        assert store._core.no_reply_unsettled == 0 and not store._core.unsettled
        assert other.multi_get([f"s{i}" for i in range(10)]) == [str(1490 + i).encode() for i in range(10)]
    finally:
        store.close()
        other.close()


@pytest.mark.timeout(30)
def test_a_refused_set_returns_and_a_later_call_or_flush_or_close_raises_it_once(
    coordinator: CoordinatorProcess,
) -> None:
    job = _job("refused")
    big = b"x" * (MAX_VALUE + 1)
    store = _client(coordinator.port, job)
    second = _client(coordinator.port, job)
    try:
        store.set("ok", b"fine")
        store.set("big", big)  # above the coordinator's limit: returns anyway
        # This get was sent before the refusal was read: it succeeds (and reads the refusal);
        # the refusal is raised by the next call that starts.
        assert store.get("ok") == b"fine"
        with pytest.raises(StoreError, match="'big'") as info:
            store.get("ok")
        assert not isinstance(info.value, StoreTimeout)
        assert store.get("ok") == b"fine"  # raised once; the client goes on
        assert not store.check(["big"])
        store.flush()  # nothing left to raise

        store.set("big", big)
        with pytest.raises(StoreError, match="'big'"):
            store.flush()
        store.flush()  # raised once
        assert store.get("ok") == b"fine"

        # A refusal not yet raised is raised by close, whether or not it was read yet.
        store.set("late", big)
        second.set("read-late", big)
        assert second.get("ok") == b"fine"  # reads the refusal, does not raise it
        assert second._core.deferred is not None
    finally:
        with pytest.raises(StoreError, match="'late'"):
            store.close()
        with pytest.raises(StoreError, match="'read-late'"):
            second.close()
    store.close()
    second.close()


@pytest.mark.timeout(30)
def test_a_thread_blocked_in_get_does_not_stop_another_thread_setting_the_key_on_the_same_client(
    coordinator: CoordinatorProcess,
) -> None:
    store = _client(coordinator.port, _job("threads"))
    got: dict[str, bytes | BaseException] = {}

    def get(key: str) -> None:
        try:
            got[key] = store.get(key, timeout=15)
        except BaseException as exc:
            got[key] = exc

    try:
        first = threading.Thread(target=get, args=("k1",), daemon=True)
        first.start()
        _wait_for(lambda: store._reading, "the first getter reading the socket")
        second = threading.Thread(target=get, args=("k2",), daemon=True)
        second.start()
        _wait_for(lambda: len(store._waiting) == 1, "the second getter waiting on the first's reads")

        started = time.monotonic()
        store.set("k2", b"two")  # from the main thread, while the first getter blocks in recv
        assert time.monotonic() - started < 2, "set waited for the blocked get"
        second.join(10)
        assert not second.is_alive() and got["k2"] == b"two"
        assert first.is_alive() and "k1" not in got, "the first get returned without its key"

        done = threading.Event()

        def set_k1() -> None:
            store.set("k1", b"one")
            done.set()

        threading.Thread(target=set_k1, daemon=True).start()
        assert done.wait(5), "a set from a third thread waited for the blocked get"
        first.join(10)
        assert not first.is_alive() and got["k1"] == b"one"
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_many_threads_adding_on_one_client_get_every_value_exactly_once(
    coordinator: CoordinatorProcess,
) -> None:
    threads, per_thread = 8, 150
    job = _job("adds")
    store = _client(coordinator.port, job)
    seen: list[list[int]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    go = threading.Barrier(threads)

    def adder(n: int) -> None:
        try:
            go.wait(10)
            for i in range(per_thread):
                seen[n].append(store.add("counter", 1))
                store.set(f"last/{n}", str(i))  # unanswered sets between the adds
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=adder, args=(n,), daemon=True) for n in range(threads)]
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
        assert not any(w.is_alive() for w in workers), "an adder hung"
        assert not errors, errors
        total = threads * per_thread
        assert sorted(v for values in seen for v in values) == list(range(1, total + 1))
        assert all(values == sorted(values) for values in seen), "one thread's adds went backwards"
        assert store.get("counter") == str(total).encode()
        store.flush()
        assert (
            store.multi_get([f"last/{n}" for n in range(threads)]) == [str(per_thread - 1).encode()] * threads
        )
    finally:
        store.close()


@pytest.mark.timeout(30)
async def test_sets_sent_while_paused_then_cut_are_resent_once_by_the_client_reconnecting_by_itself(
    coordinator: CoordinatorProcess,
) -> None:
    job = _job("cut-sets")
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await asyncio.to_thread(_client, proxy.port, job)
        observer = await asyncio.to_thread(_client, coordinator.port, job)
        try:
            await asyncio.to_thread(store.set, "ctr", b"0")
            await asyncio.to_thread(store.flush)
            proxy.pause()  # the next sets are written but held by the proxy

            def send_sets() -> None:
                for i in range(1, 201):
                    store.set("ctr", str(i))
                    store.set(f"k{i}", str(i))

            await asyncio.to_thread(send_sets)
            assert store._core.no_reply_unsettled == 400
            assert not await asyncio.to_thread(observer.check, ["k1"]), "the proxy let a set through"
            proxy.cut()
            proxy.resume()
            # The client finds the link broken by itself and sends the cut sets again, in
            # order, before this get.
            assert await asyncio.to_thread(store.get, "ctr") == b"200"
            assert await asyncio.to_thread(store.num_keys) == 201
            assert await asyncio.to_thread(store.multi_get, ["k1", "k200"]) == [b"1", b"200"]
            await asyncio.to_thread(store.flush)
            assert not store._core.lost_frames() and not store._core.unsettled
            assert await asyncio.to_thread(observer.get, "ctr") == b"200"
            assert proxy.accepted >= 2
        finally:
            proxy.resume()
            await asyncio.to_thread(store.close)
            await asyncio.to_thread(observer.close)


@pytest.mark.timeout(30)
async def test_mutations_whose_replies_are_lost_after_they_were_applied_are_answered_from_memory_once(
    coordinator: CoordinatorProcess,
) -> None:
    job = _job("held")
    resent_before = coordinator.log().count("event=resent_request_answered")
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await asyncio.to_thread(_client, proxy.port, job)
        observer = await asyncio.to_thread(_client, coordinator.port, job)
        try:
            await asyncio.to_thread(store.set, "doomed", b"x")
            # The proxy holds the coordinator's replies: the requests are carried out (the
            # observer, connected directly, sees it), their answers wait; the cut loses them.
            proxy.hold_replies()
            add = asyncio.ensure_future(asyncio.to_thread(store.add, "counter", 1))
            await _until(lambda: observer.check(["counter"]), "the add carried out behind held replies")
            await asyncio.to_thread(store.append, "log", b"once,")  # returns once sent
            gone = asyncio.ensure_future(asyncio.to_thread(store.delete_key, "doomed"))

            def carried_out() -> bool:
                return observer.check(["counter", "log"]) and not observer.check(["doomed"])

            await _until(carried_out, "the three requests carried out behind held replies")
            assert await asyncio.to_thread(observer.multi_get, ["counter", "log"]) == [b"1", b"once,"]
            assert not (add.done() or gone.done()), "a held reply got through"
            assert store._core.no_reply_unsettled == 2, "the set and the append are not acknowledged"
            proxy.cut()
            proxy.resume()
            assert await add == 1
            assert await gone is True  # the first reply, although the key is gone by now
            await asyncio.to_thread(store.flush)  # the set and append went again first, not applied twice
            assert not await asyncio.to_thread(observer.check, ["doomed"]), "the re-sent set undid the delete"
            assert await asyncio.to_thread(observer.multi_get, ["counter", "log"]) == [b"1", b"once,"]

            # Adds applied and unanswered, cut, again and again: each counts once.
            for expected in range(2, 7):
                proxy.hold_replies()
                add = asyncio.ensure_future(asyncio.to_thread(store.add, "counter", 1))
                await _until(
                    lambda n=expected: observer.get("counter") == str(n).encode(),
                    "an add carried out behind held replies",
                )
                assert not add.done()
                proxy.cut()
                proxy.resume()
                assert await add == expected
            assert await asyncio.to_thread(store.get, "counter") == b"6"
            assert await asyncio.to_thread(observer.get, "counter") == b"6"
            assert proxy.accepted >= 7
        finally:
            proxy.resume()
            await asyncio.to_thread(store.close)
            await asyncio.to_thread(observer.close)
    resent = coordinator.log().count("event=resent_request_answered") - resent_before
    assert resent >= 6, "the re-sent mutations were not answered from the coordinator's memory"


@pytest.mark.timeout(30)
async def test_concurrent_adds_and_appends_on_one_client_through_repeated_cuts_count_exactly_once(
    coordinator: CoordinatorProcess,
) -> None:
    # Eight threads share the client; the link is cut every 50 ms with requests of every thread
    # in flight (the reading thread and the waiting ones each send theirs again).
    job = _job("cuts")
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await asyncio.to_thread(_client, proxy.port, job, 20)
        writers = _Writers(store, 8)
        try:
            for _ in range(20):
                await asyncio.sleep(0.05)
                proxy.cut()
                writers.check_alive()
            await writers.finish(10)
            counter = int(await asyncio.to_thread(store.get, "counter"))
            log = await asyncio.to_thread(store.get, "log")
        finally:
            writers.stop.set()
            await asyncio.to_thread(store.close)
    writers.check_exactly_once(counter, log)
    assert proxy.accepted >= 20


@pytest.mark.timeout(60)
async def test_adds_and_appends_through_cuts_and_a_coordinator_crash_with_state_dir_count_exactly_once(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    coordinators = [_coordinator(tmp_path, "--state-dir", str(state))]
    job = _job("crash")
    async with FaultProxy("127.0.0.1", coordinators[0].port) as proxy:
        store = await asyncio.to_thread(_client, proxy.port, job, 30)
        writers = _Writers(store, 8)

        async def cut_with_requests_carried_out_unanswered(port: int) -> None:
            # The proxy holds the replies; once the coordinator (read directly) has carried out
            # an add or an append that no writer has had an answer to, the cut loses its reply.
            observer = await asyncio.to_thread(_client, port, job, 30)
            try:
                proxy.hold_replies()

                def unanswered() -> bool:
                    writers.check_alive()
                    counter = int(observer.get("counter", timeout=10))
                    entries = observer.get("log", timeout=10).count(b",")
                    return counter > max(writers.seen, default=0) or entries > len(writers.appended)

                await _until(unanswered, "an add or append carried out behind held replies", twice=True)
                proxy.cut()
                proxy.resume()
            finally:
                await asyncio.to_thread(observer.close)

        try:
            await asyncio.sleep(0.3)
            await cut_with_requests_carried_out_unanswered(coordinators[0].port)
            await asyncio.sleep(0.3)
            proxy.cut()  # at whatever moment the requests are in
            await asyncio.sleep(0.3)
            coordinators[0].stop(signal.SIGKILL)  # mid-stream: some applied, unanswered
            # Until the new coordinator listens, the proxy accepts the client's connections and
            # closes them at once (its target refuses): the client must keep trying.
            coordinators.append(await asyncio.to_thread(_coordinator, tmp_path, "--state-dir", str(state)))
            answered = len(writers.seen)
            proxy.retarget("127.0.0.1", coordinators[1].port)
            # Replies are held next, the handshake's too: the client must be back (an add
            # answered by the new coordinator) first, or it waits for its handshake's reply
            # behind the hold and carries out nothing (beside a CPU hog, 0.5 s was not enough).
            await _until(lambda: len(writers.seen) > answered, "an add answered after the restart")
            await cut_with_requests_carried_out_unanswered(coordinators[1].port)
            await asyncio.sleep(0.3)
            await writers.finish()
            counter = int(await asyncio.to_thread(store.get, "counter"))
            log = await asyncio.to_thread(store.get, "log")
        finally:
            writers.stop.set()
            proxy.resume()
            try:
                await asyncio.to_thread(store.close)
            finally:
                for c in coordinators:
                    c.stop()
    writers.check_exactly_once(counter, log)
    answered = sum(c.log().count("event=resent_request_answered") for c in coordinators)
    assert answered >= 1, "no re-sent request was answered from memory: the faults missed"
    assert proxy.accepted >= 4


@pytest.mark.timeout(60)
async def test_adds_and_appends_through_a_coordinator_crash_and_restart_on_its_port_count_exactly_once(
    tmp_path: Path,
) -> None:
    # No proxy: while the coordinator is down its port refuses connections outright.
    state = tmp_path / "state"
    coordinators = [_coordinator(tmp_path, "--state-dir", str(state))]
    port = coordinators[0].port
    job = _job("restart")
    store = await asyncio.to_thread(_client, port, job, 30)
    writers = _Writers(store, 8)
    try:
        await asyncio.sleep(0.3)
        writers.check_alive()
        coordinators[0].stop(signal.SIGKILL)  # mid-stream: some applied, unanswered
        before_restart = len(writers.seen)
        coordinators.append(
            await asyncio.to_thread(_coordinator, tmp_path, "--state-dir", str(state), port=port)
        )

        def progressed() -> bool:
            writers.check_alive()
            return len(writers.seen) > before_restart + 100

        await _until(progressed, "adds answered after the restart")
        await writers.finish()
        counter = int(await asyncio.to_thread(store.get, "counter"))
        log = await asyncio.to_thread(store.get, "log")
    finally:
        writers.stop.set()
        try:
            await asyncio.to_thread(store.close)
        finally:
            for c in coordinators:
                c.stop()
    writers.check_exactly_once(counter, log)


@pytest.mark.timeout(30)
async def test_an_outage_shorter_than_the_timeout_is_waited_out_when_connections_are_accepted_and_closed(
    coordinator: CoordinatorProcess,
) -> None:
    # As while the coordinator behind a proxy or load balancer is down, or drains: connections
    # are accepted, then closed (an orderly close) before the handshake ends. The client keeps
    # trying within its timeout, as it does when connections are refused.
    async def close_after_the_hello(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # all of the hello: the close that follows is a FIN, not a reset
        writer.close()

    closer = await asyncio.start_server(close_after_the_hello, "127.0.0.1", 0)
    closer_port = closer.sockets[0].getsockname()[1]
    async with closer, FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await asyncio.to_thread(_client, proxy.port, _job("outage"), 20)
        try:
            await asyncio.to_thread(store.set, "k", b"v")
            await asyncio.to_thread(store.flush)
            proxy.retarget("127.0.0.1", closer_port)
            proxy.cut()
            pending = asyncio.ensure_future(asyncio.to_thread(store.get, "k"))
            await asyncio.sleep(0.5)
            proxy.retarget("127.0.0.1", coordinator.port)  # the coordinator is back
            assert await asyncio.wait_for(pending, 15) == b"v"
            assert proxy.accepted >= 3
        finally:
            proxy.retarget("127.0.0.1", coordinator.port)
            await asyncio.to_thread(store.close)


@pytest.mark.timeout(30)
async def test_a_silent_coordinator_gives_store_timeout_naming_the_key_not_a_hang(
    coordinator: CoordinatorProcess,
) -> None:
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await asyncio.to_thread(_client, proxy.port, _job("silent"))
        try:
            await asyncio.to_thread(store.set, "before", b"ok")
            proxy.pause()
            started = time.monotonic()
            with pytest.raises(StoreTimeout) as info:
                await asyncio.to_thread(store.get, "unanswered", 0.5)
            assert time.monotonic() - started < 8
            assert info.value.keys == ["unanswered"]

            started = time.monotonic()
            await asyncio.to_thread(store.set, "unacknowledged", b"x")  # returns once sent
            assert time.monotonic() - started < 1
            with pytest.raises(StoreTimeout) as info:
                await asyncio.to_thread(store.flush, 0.5)
            assert time.monotonic() - started < 5
            assert "unacknowledged" in info.value.keys
            assert "127.0.0.1" in str(info.value)

            proxy.resume()  # the coordinator speaks again: the same client goes on
            assert await asyncio.to_thread(store.get, "unacknowledged") == b"x"
            assert await asyncio.to_thread(store.get, "before") == b"ok"
        finally:
            proxy.resume()
            await asyncio.to_thread(store.close)


@pytest.mark.timeout(30)
def test_sync_tcpstore_used_as_a_torch_user_would_forwards_to_the_blocking_client(
    coordinator: CoordinatorProcess,
) -> None:
    job = _job("tcpstore")
    store = sync.TCPStore(
        "127.0.0.1",
        coordinator.port,
        is_master=False,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
        token=TOKEN,
        job=job,
    )
    try:
        assert isinstance(store._client, BlockingStoreClient)
        assert store.timeout == datetime.timedelta(seconds=10)
        store.set("a", "1")
        assert store._client._core.no_reply_unsettled == 1
        assert store.get("a") == b"1"
        assert store.add("n", 3) == 3
        assert store.add("n", 4) == 7
        assert store.compare_set("a", "1", "2") == b"2"
        store.wait(["a", "n"])
        assert store.check(["a", "n"])
        assert store.num_keys() == 2
        store.set("gone", b"x")
        store.flush()
        assert store._client._core.no_reply_unsettled == 0
        assert store.delete_key("gone")

        store.set_timeout(datetime.timedelta(seconds=0.3))
        with pytest.raises(StoreTimeout) as info:
            store.get("missing")
        assert info.value.keys == ["missing"]
        store.set_timeout(datetime.timedelta(seconds=10))

        store.set("huge", b"x" * (MAX_VALUE + 1))
        with pytest.raises(StoreError, match="'huge'"):
            store.flush()

        # The async adapter speaks over the same connection: it sees a set made just before.
        store.set("seen", b"just now")

        async def read_async() -> tuple[bytes, int]:
            adapter = store.async_store
            return await adapter.get("seen"), await adapter.add("n", 1)

        value, counter = asyncio.run(read_async())
        assert (value, counter) == (b"just now", 8)
        assert store.get("n") == b"8"
    finally:
        store.close()
    store.close()  # twice is fine
