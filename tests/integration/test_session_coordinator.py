"""The coordinator client against real coordinator processes on loopback: the store
conformance suite, rendezvous, many concurrent clients, authentication failure, and
reconnection through a fault proxy and across a coordinator restart with --state-dir."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiocoll.client.control.session import CoordinatorSession, CoordinatorUnreachable

import aiocoll
import aiocoll.sync
from aiocoll import AuthenticationError, RendezvousError, Store, StoreTimeout
from aiocoll.protocol._coordinator import EV_RESTARTED, EV_SESSION_LOST, ROLE_STORE, ROLE_WORKER
from aiocoll.testing.coordinator import CoordinatorProcess
from aiocoll.testing.fault_proxy import FaultProxy
from aiocoll.testing.store_conformance import StoreConformance, StoreFactory
from aiocoll.testing.world import free_port

pytestmark = pytest.mark.integration

TOKEN = "integration-secret"


def _coordinator(tmp: Path, *, port: int = 0, state_dir: Path | None = None) -> CoordinatorProcess:
    args = ["--state-dir", str(state_dir)] if state_dir is not None else []
    log_path = tmp / f"coordinator-{uuid.uuid4().hex[:8]}.log"
    return CoordinatorProcess(log_path, *args, token=TOKEN, port=port)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    proc = _coordinator(tmp_path_factory.mktemp("coordinator"))
    yield proc
    proc.stop()


def _url(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


async def _connect(port: int, job: str, role: str = ROLE_WORKER, timeout: float = 20) -> CoordinatorSession:
    """A session of ``job`` with the coordinator (or a fault proxy) on loopback ``port``."""
    return await CoordinatorSession.connect(
        "127.0.0.1", port, token=TOKEN, job=job, role=role, timeout=timeout
    )


async def _until(condition: Callable[[], Awaitable[bool]], what: str, *, twice: bool = False) -> None:
    """Wait (20 s at most) until ``condition()`` holds (on two checks in a row if ``twice``)."""
    deadline = time.monotonic() + 20
    held = 0
    while held < (2 if twice else 1):
        held = held + 1 if await condition() else 0
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within 20 s")
        await asyncio.sleep(0.005)


async def _store(port: int, job: str, timeout: float = 20) -> Store:
    """``aiocoll.connect_store`` for ``job`` at loopback ``port``, with the test token."""
    return await aiocoll.connect_store(_url(port), token=TOKEN, job=job, timeout=timeout)


class TestCoordinatorStore(StoreConformance):
    """The conformance suite against connect_store; each test gets its own job (key space)."""

    @pytest.fixture
    async def store_factory(self, coordinator: CoordinatorProcess) -> AsyncIterator[StoreFactory]:
        job = f"conformance-{uuid.uuid4().hex}"
        made: list[Store] = []

        async def make() -> Store:
            made.append(await _store(coordinator.port, job))
            return made[-1]

        yield make
        for store in made:
            await store.aclose()


class TestBlockingCoordinatorStore(StoreConformance):
    """The same suite against the blocking driver of the store client core
    (client/control/_blocking_store.py, what aiocoll.sync.TCPStore uses), through the sync store's
    async view; each test gets its own job."""

    @pytest.fixture
    async def store_factory(self, coordinator: CoordinatorProcess) -> AsyncIterator[StoreFactory]:
        job = f"conformance-blocking-{uuid.uuid4().hex}"
        made: list[aiocoll.sync.TCPStore] = []

        async def make() -> Store:
            made.append(
                await asyncio.to_thread(
                    aiocoll.sync.TCPStore, "127.0.0.1", coordinator.port, timeout=20, token=TOKEN, job=job
                )
            )
            return made[-1].async_store

        yield make
        for store in made:
            await store.async_store.aclose()
            await asyncio.to_thread(store.close)


@pytest.mark.timeout(60)
async def test_many_concurrent_clients_each_see_every_other_clients_writes(
    coordinator: CoordinatorProcess,
) -> None:
    job = f"many-{uuid.uuid4().hex}"
    clients = await asyncio.gather(*(_store(coordinator.port, job, timeout=30) for _ in range(32)))
    try:

        async def work(i: int, store: Store) -> list[bytes]:
            await store.set(f"client/{i}", f"value-{i}")
            await store.add("arrived", 1)
            await store.wait(["client/" + str(j) for j in range(len(clients))], timeout=30)
            return await store.multi_get([f"client/{j}" for j in range(len(clients))])

        results = await asyncio.gather(*(work(i, c) for i, c in enumerate(clients)))
        expected = [f"value-{j}".encode() for j in range(len(clients))]
        assert all(r == expected for r in results)
        assert await clients[0].get("arrived") == str(len(clients)).encode()
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


@pytest.mark.timeout(60)
async def test_join_gives_every_member_the_same_table_and_reports_a_lost_member(
    coordinator: CoordinatorProcess,
) -> None:
    job = f"rdzv-{uuid.uuid4().hex}"
    sessions = [await _connect(coordinator.port, job) for _ in range(4)]
    try:
        # Ranks 3 and 1 are asked for; the others let the coordinator pick.
        wanted: list[int | None] = [3, None, 1, None]
        tables = await asyncio.gather(
            *(
                s.join(rank, 4, [("127.0.0.1", 40000 + i)], f"host-{i % 2}", timeout=20)
                for i, (s, rank) in enumerate(zip(sessions, wanted, strict=True))
            )
        )
        assert tables[0].rank == 3 and tables[2].rank == 1
        assert sorted(t.rank for t in tables) == [0, 1, 2, 3]
        assert all(t.members == tables[0].members and t.round == tables[0].round for t in tables)
        assert [m.rank for m in tables[0].members] == [0, 1, 2, 3]
        by_rank = {t.rank: i for i, t in enumerate(tables)}
        assert tables[0].members[3].addrs == [("127.0.0.1", 40000)]
        assert all(t.session for t in tables) and len({t.session for t in tables}) == 4

        lost: list[tuple[int, str]] = []
        got = asyncio.Event()

        def on_lost(rank: int, reason: str) -> None:
            lost.append((rank, reason))
            got.set()

        survivor = sessions[by_rank[0]]
        survivor.on_member_lost(on_lost)
        sessions[by_rank[2]].abort()
        await asyncio.wait_for(got.wait(), 15)
        assert lost[0][0] == 2 and lost[0][1]
    finally:
        for s in sessions:
            await s.aclose()


@pytest.mark.timeout(60)
async def test_join_refuses_a_duplicate_rank_and_a_different_world_size(
    coordinator: CoordinatorProcess,
) -> None:
    job = f"refuse-{uuid.uuid4().hex}"
    a, b, c = [await _connect(coordinator.port, job) for _ in range(3)]
    try:
        pending = asyncio.ensure_future(a.join(0, 2, [], "h", timeout=20))
        await asyncio.sleep(0.2)
        with pytest.raises(RendezvousError, match="rank 0"):
            await b.join(0, 2, [], "h", timeout=5)
        with pytest.raises(RendezvousError, match="world size"):
            await c.join(1, 3, [], "h", timeout=5)
        with pytest.raises(ValueError, match="out of range"):
            await c.join(5, 2, [], "h")
        pending.cancel()
    finally:
        for s in (a, b, c):
            await s.aclose()


@pytest.mark.timeout(60)
async def test_a_wrong_token_raises_authentication_error_at_once(coordinator: CoordinatorProcess) -> None:
    started = time.monotonic()
    with pytest.raises(AuthenticationError, match="AIOCOLL_TOKEN"):
        await aiocoll.connect_store(_url(coordinator.port), token="not-the-token", job="x", timeout=30)
    assert time.monotonic() - started < 10, "an authentication failure must not be retried until the timeout"


@pytest.mark.timeout(30)
async def test_connect_store_without_a_token_warns() -> None:
    # Nothing listens on this port: the warning comes before the connection fails.
    with pytest.warns(RuntimeWarning, match="without a token"), pytest.raises(CoordinatorUnreachable):
        await aiocoll.connect_store(_url(free_port()), token="", job="x", timeout=0.3)


@pytest.mark.timeout(30)
async def test_connection_refused_for_the_whole_budget_names_host_and_port() -> None:
    port = free_port()
    started = time.monotonic()
    with pytest.raises(CoordinatorUnreachable, match=f"127.0.0.1:{port}"):
        await CoordinatorSession.connect("127.0.0.1", port, token=TOKEN, timeout=0.5)
    assert time.monotonic() - started < 10


@pytest.mark.timeout(60)
async def test_a_pending_wait_survives_a_cut_link_and_completes(coordinator: CoordinatorProcess) -> None:
    job = f"cut-{uuid.uuid4().hex}"
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        waiter = await _connect(proxy.port, job, role=ROLE_STORE)
        setter = await _store(coordinator.port, job)
        events: list[dict[str, Any]] = []
        waiter.on_event(events.append)
        try:
            pending = asyncio.ensure_future(waiter.get("after-cut", timeout=20))
            await asyncio.sleep(0.2)
            proxy.cut()
            await asyncio.sleep(0.2)
            await setter.set("after-cut", b"made it")
            assert await pending == b"made it"
            assert any(e["ev"] == "reconnected" for e in events)
            assert proxy.accepted >= 2
        finally:
            await waiter.aclose()
            await setter.aclose()


@pytest.mark.timeout(60)
async def test_mutations_whose_replies_are_lost_after_they_were_applied_are_resent_and_applied_once(
    coordinator: CoordinatorProcess,
) -> None:
    job = f"add-{uuid.uuid4().hex}"
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await _connect(proxy.port, job, role=ROLE_STORE)
        observer = await _connect(coordinator.port, job, role=ROLE_STORE)
        try:
            await store.set("doomed", b"x")
            # The proxy holds the coordinator's replies: the requests are carried out (the
            # observer, connected directly, sees it), their answers wait; the cut loses them.
            proxy.hold_replies()
            add = asyncio.ensure_future(store.add("counter", 1))
            app = asyncio.ensure_future(store.append("log", b"once,"))
            gone = asyncio.ensure_future(store.delete_key("doomed"))

            async def carried_out() -> bool:
                return await observer.check(["counter", "log"]) and not await observer.check(["doomed"])

            await _until(carried_out, "the three requests carried out behind held replies")
            assert await observer.multi_get(["counter", "log"]) == [b"1", b"once,"]
            assert not (add.done() or gone.done()), "a held reply got through"
            await app  # an append expects no reply: it returned once queued ...
            assert store._core.no_reply_unsettled == 2, "... and no later reply has acknowledged it"
            proxy.cut()
            proxy.resume()
            assert await add == 1
            assert await gone is True  # the first reply, although the key is gone by now
            await store.flush()  # the set and the append, sent again first, were not applied twice
            assert not await observer.check(["doomed"]), "the set sent again did not undo the delete"
            assert await observer.multi_get(["counter", "log"]) == [b"1", b"once,"]
            assert proxy.accepted >= 2
        finally:
            await store.aclose()
            await observer.aclose()


@pytest.mark.timeout(30)
async def test_a_silent_coordinator_gives_store_timeout_naming_the_key_not_a_hang(
    coordinator: CoordinatorProcess,
) -> None:
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await _connect(proxy.port, "silent", role=ROLE_STORE)
        try:
            proxy.pause()
            with pytest.raises(StoreTimeout) as info:
                await store.get("unanswered", timeout=0.5)
            assert info.value.keys == ["unanswered"]
            await store.set("unacknowledged", b"x")  # returns once queued; its acknowledgement waits
            with pytest.raises(StoreTimeout) as info:
                await store.flush(timeout=0.5)
            assert info.value.keys == ["unacknowledged"]
            assert "127.0.0.1" in str(info.value)
        finally:
            proxy.resume()
            await store.aclose()


@pytest.mark.timeout(90)
async def test_a_worker_whose_link_was_cut_learns_its_session_was_lost(
    coordinator: CoordinatorProcess,
) -> None:
    job = f"lost-{uuid.uuid4().hex}"
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        cut_one = await _connect(proxy.port, job)
        other = await _connect(coordinator.port, job)
        try:
            await asyncio.gather(
                cut_one.join(0, 2, [], "h", timeout=20), other.join(1, 2, [], "h", timeout=20)
            )
            seen: list[dict[str, Any]] = []
            got = asyncio.Event()

            def on_event(event: dict[str, Any]) -> None:
                if event["ev"] == EV_SESSION_LOST:
                    seen.append(event)
                    got.set()

            cut_one.on_event(on_event)
            proxy.cut()
            await asyncio.wait_for(got.wait(), 20)
            assert cut_one.session_lost
            # The store still works on the new link: only the membership is gone.
            await cut_one.set("still-usable", b"yes")
            assert await other.get("still-usable") == b"yes"
        finally:
            await cut_one.aclose()
            await other.aclose()


@pytest.mark.timeout(120)
async def test_coordinator_restart_with_state_dir_resumes_waits_and_sessions_and_keeps_keys(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    first = _coordinator(tmp_path, state_dir=state)
    port = first.port
    job = "durable"
    second: CoordinatorProcess | None = None
    sessions: list[CoordinatorSession] = []
    try:
        store = await _store(port, job, timeout=60)
        sessions.append(store)
        workers = [await _connect(port, job, timeout=60) for _ in range(2)]
        sessions += workers
        tables = await asyncio.gather(
            *(w.join(i, 2, [("127.0.0.1", 1 + i)], "h", timeout=20) for i, w in enumerate(workers))
        )
        events: list[str] = []
        workers[0].on_event(lambda ev: events.append(ev["ev"]))

        acked = {f"acked/{i}": os.urandom(16) for i in range(50)}
        for key, value in acked.items():
            await store.set(key, value)
        assert await store.add("counter", 7) == 7
        waiting = asyncio.ensure_future(workers[0].get("after-restart", timeout=60))
        # A rendezvous half done when the coordinator dies: the early member's join resumes.
        early = await _connect(port, "durable-2", timeout=60)
        sessions.append(early)
        early_join = asyncio.ensure_future(early.join(0, 2, [], "h", timeout=60))
        await asyncio.sleep(0.2)

        first.stop(signal.SIGKILL)  # a crash: no drain, no final snapshot
        assert not waiting.done()
        second = _coordinator(tmp_path, port=port, state_dir=state)

        setter = await _store(port, job, timeout=60)
        sessions.append(setter)
        await setter.set("after-restart", b"hello again")
        assert await asyncio.wait_for(waiting, 60) == b"hello again"
        assert await store.multi_get(list(acked)) == list(acked.values())
        assert await store.add("counter", 1) == 8
        late = await _connect(port, "durable-2", timeout=60)
        sessions.append(late)
        late_table = await late.join(1, 2, [], "h", timeout=30)
        early_table = await asyncio.wait_for(early_join, 30)
        assert early_table.members == late_table.members and early_table.rank == 0
        assert EV_RESTARTED in events and EV_SESSION_LOST not in events
        assert workers[0].session_lost is None and workers[0].membership == tables[0]
    finally:
        for s in sessions:
            await s.aclose()
        first.stop()
        if second is not None:
            second.stop()


@pytest.mark.timeout(60)
async def test_concurrent_adds_and_appends_through_cuts_and_a_coordinator_crash_count_exactly_once(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    coordinators = [_coordinator(tmp_path, state_dir=state)]
    job = f"exact-{uuid.uuid4().hex}"
    async with FaultProxy("127.0.0.1", coordinators[0].port) as proxy:
        store = await _connect(proxy.port, job, role=ROLE_STORE, timeout=30)
        stop = asyncio.Event()
        seen: list[int] = []  # every value an add answered with
        appended: list[str] = []

        async def writer(n: int) -> None:
            i = 0
            while not stop.is_set():
                seen.append(await store.add("counter", 1))
                await store.append("log", f"{n}.{i},".encode())
                appended.append(f"{n}.{i}")
                i += 1

        async def cut_with_requests_carried_out_unanswered(port: int) -> None:
            # The proxy holds the replies; once the coordinator (read directly) has carried out
            # an add or an append that no writer has had an answer to, the cut loses its reply.
            # Checked twice a loop turn apart: a reply already past the proxy is read meanwhile.
            observer = await _connect(port, job, role=ROLE_STORE, timeout=30)
            try:
                proxy.hold_replies()

                async def unanswered() -> bool:
                    counter = int(await observer.get("counter", timeout=10))
                    entries = (await observer.get("log", timeout=10)).count(b",")
                    return counter > max(seen, default=0) or entries > len(appended)

                await _until(unanswered, "an add or append carried out behind held replies", twice=True)
                proxy.cut()
                proxy.resume()
            finally:
                await observer.aclose()

        writers = [asyncio.ensure_future(writer(n)) for n in range(16)]
        try:
            await asyncio.sleep(0.3)
            await cut_with_requests_carried_out_unanswered(coordinators[0].port)
            await asyncio.sleep(0.3)
            proxy.cut()  # at whatever moment the requests are in
            await asyncio.sleep(0.3)
            coordinators[0].stop(signal.SIGKILL)  # mid-stream: some applied, unanswered
            coordinators.append(_coordinator(tmp_path, state_dir=state))
            proxy.retarget("127.0.0.1", coordinators[1].port)
            await asyncio.sleep(0.5)
            await cut_with_requests_carried_out_unanswered(coordinators[1].port)
            await asyncio.sleep(0.3)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*writers), 30)  # no add or append failed
            counter = int(await store.get("counter"))
            log = (await store.get("log")).decode().split(",")[:-1]
        finally:
            stop.set()
            for task in writers:
                task.cancel()
            try:
                await store.aclose()
            finally:
                for c in coordinators:
                    c.stop()
    assert counter == len(seen) > 0
    assert sorted(seen) == list(range(1, counter + 1)), "every add answered once, with its own value"
    assert sorted(log) == sorted(appended) and len(set(log)) == len(log)
    logs = [c.log() for c in coordinators]
    answered = sum(text.count("event=resent_request_answered") for text in logs)
    assert answered >= 1, "no re-sent request was answered from memory: the faults missed"
    assert proxy.accepted >= 4


@pytest.mark.timeout(60)
async def test_an_outage_longer_than_a_wait_names_the_keys_and_the_session_recovers_after(
    coordinator: CoordinatorProcess,
) -> None:
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await _connect(proxy.port, "outage", role=ROLE_STORE, timeout=30)
        try:
            proxy.refuse()
            proxy.cut()
            with pytest.raises(StoreTimeout) as info:
                await store.get("during-outage", timeout=0.5)
            assert info.value.keys == ["during-outage"]
            assert "unreachable" in str(info.value)
            proxy.refuse(False)
            await store.set("after-outage", b"ok", timeout=20)
            assert await store.get("after-outage") == b"ok"
        finally:
            await store.aclose()


@pytest.mark.timeout(60)
async def test_a_session_whose_reconnect_budget_runs_out_says_the_coordinator_is_lost(
    coordinator: CoordinatorProcess,
) -> None:
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        store = await _connect(proxy.port, "budget", role=ROLE_STORE, timeout=0.5)
        lost = asyncio.Event()
        store.on_event(lambda ev: lost.set() if ev["ev"] == "coordinator_lost" else None)
        try:
            proxy.refuse()
            proxy.cut()
            await asyncio.wait_for(lost.wait(), 20)
            with pytest.raises(CoordinatorUnreachable, match=f"127.0.0.1:{proxy.port}"):
                await store.get("anything")
        finally:
            await store.aclose()


@pytest.mark.timeout(60)
async def test_an_unanswered_heartbeat_drops_a_silent_link_and_the_worker_reconnects(
    coordinator: CoordinatorProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    import aiocoll.client.control._join as session_module  # where heartbeats are sent

    monkeypatch.setattr(session_module, "HEARTBEAT_INTERVAL", 0.1)
    monkeypatch.setattr(session_module, "_HEARTBEAT_REPLY_TIMEOUT", 0.5)
    job = f"silent-{uuid.uuid4().hex}"
    async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
        worker = await _connect(proxy.port, job, timeout=30)
        events: list[str] = []
        reconnected = asyncio.Event()

        def on_event(event: dict[str, Any]) -> None:
            events.append(event["ev"])
            if event["ev"] == "reconnected":
                reconnected.set()

        worker.on_event(on_event)
        try:
            await worker.join(0, 1, [], "h", timeout=20)
            first_links = proxy.accepted
            proxy.pause()  # the link stays open but nothing moves: only a heartbeat can tell
            await asyncio.sleep(1.0)
            proxy.resume()
            await asyncio.wait_for(reconnected.wait(), 20)
            assert proxy.accepted > first_links
            assert await worker.check([]) is True
        finally:
            await worker.aclose()


@pytest.mark.timeout(60)
async def test_a_stalled_coordinator_keeps_its_members_when_their_heartbeats_time_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A coordinator that stops answering for longer than a heartbeat's reply timeout (SIGSTOP
    here; a long GC pause or an overloaded host in life) but comes back: each worker connects anew
    before closing the silent link, so the coordinator moves both members to their new links
    instead of reading the closed ones as members lost and then refusing their resumes."""
    import aiocoll.client.control._join as session_module  # where heartbeats are sent

    monkeypatch.setattr(session_module, "HEARTBEAT_INTERVAL", 0.1)
    monkeypatch.setattr(session_module, "_HEARTBEAT_REPLY_TIMEOUT", 0.5)
    coordinator = _coordinator(tmp_path)
    job = f"stalled-{uuid.uuid4().hex}"
    workers = [await _connect(coordinator.port, job, timeout=30) for _ in range(2)]
    events: list[list[str]] = [[], []]
    reconnected = [asyncio.Event(), asyncio.Event()]
    for i, worker in enumerate(workers):

        def on_event(event: dict[str, Any], i: int = i) -> None:
            events[i].append(event["ev"])
            if event["ev"] == "reconnected":
                reconnected[i].set()

        worker.on_event(on_event)
    try:
        await asyncio.gather(*(w.join(r, 2, [], "h", timeout=20) for r, w in enumerate(workers)))
        await workers[0].set("before", b"1")
        coordinator.proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(1.5)  # three reply timeouts: both workers replace their links
        finally:
            coordinator.proc.send_signal(signal.SIGCONT)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in reconnected)), 20)
        assert [w.session_lost for w in workers] == [None, None], events
        assert EV_SESSION_LOST not in events[0] + events[1], events
        # The store answers on the new links, and the membership is live: a member that now goes
        # away without leaving is reported to the other.
        assert await workers[1].get("before") == b"1"
        lost: list[int] = []
        got = asyncio.Event()
        workers[0].on_member_lost(lambda rank, reason: (lost.append(rank), got.set()))
        workers[1].abort()
        await asyncio.wait_for(got.wait(), 20)
        assert lost == [1], lost
        log = coordinator.log()
        assert log.count("event=resumed") == 2, log
        assert "resume_refused" not in log, log
        assert "member_lost round=0 reason=connection closed without leave (closed by the client)" in log
    finally:
        for worker in workers:
            await worker.aclose()
        coordinator.stop()


@pytest.mark.timeout(60)
async def test_a_beat_thread_the_coordinator_refuses_backs_off_instead_of_reconnecting_at_once(
    coordinator: CoordinatorProcess,
) -> None:
    """A beat connection naming a session the coordinator does not count is closed right after
    its handshake; the thread retries with a growing pause (0.1, 0.2, 0.4 ... 2 s), not ten
    times a second for the rest of the process."""
    from aiocoll.client.control._beat import BeatThread

    job = f"refused-beats-{uuid.uuid4().hex}"
    beats = BeatThread(
        "127.0.0.1",
        coordinator.port,
        token=TOKEN,
        job=job,
        session="no-such-session",
        rank=0,
        report=lambda full: None,
    )
    beats.start()
    try:
        await asyncio.sleep(3.0)
    finally:
        await asyncio.to_thread(beats.stop)
    refused = [line for line in coordinator.log().splitlines() if f"job={job} event=beat_closed" in line]
    # Pauses of 0.1 + 0.2 + 0.4 + 0.8 + 1.6 s fill 3 s with at most six connections; without
    # the backoff there were about thirty.
    assert 1 <= len(refused) <= 6, refused
    assert beats.beats == 0
