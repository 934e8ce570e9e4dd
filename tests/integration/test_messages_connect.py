"""Issue 18: a rank pointed at something that is not an aiocoll coordinator, or holding the wrong
token, is told so within seconds, naming what answered and what to do, over real sockets on
loopback: the async session (connect_store, init_process_group) and the blocking store client
(aiocoll.sync.TCPStore) alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from aiocoll.client.control._link_keeper import SILENCE, SILENT_ATTEMPTS
from aiocoll.server import Coordinator

import aiocoll
import aiocoll.sync
from aiocoll import AuthenticationError, ProtocolError
from aiocoll.testing.fault_proxy import FaultProxy

pytestmark = pytest.mark.integration

_PATIENCE = 120.0  # what the clients would wait for without the checks: far past the test's timeout


@contextlib.contextmanager
def _eager_http_server() -> Iterator[int]:
    """A web server that answers any bytes at once with 400, as most do to a bad request line."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


async def _failure(make: Callable[[], Awaitable[Any]]) -> tuple[BaseException, float]:
    began = time.monotonic()
    with pytest.raises((ProtocolError, AuthenticationError)) as err:
        await make()
    return err.value, time.monotonic() - began


def _sync_store(port: int, token: str | None = None) -> Callable[[], Awaitable[Any]]:
    return lambda: asyncio.to_thread(aiocoll.sync.TCPStore, "127.0.0.1", port, timeout=_PATIENCE, token=token)


def _async_store(port: int, token: str | None = None) -> Callable[[], Awaitable[Any]]:
    return lambda: aiocoll.connect_store(f"tcp://127.0.0.1:{port}", token=token, timeout=_PATIENCE)


@pytest.mark.timeout(90)
async def test_a_tcpstore_or_a_web_server_is_named_within_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed import TCPStore

    monkeypatch.setenv("AIOCOLL_TOKEN", "t")
    torch_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coordinator = Coordinator("127.0.0.1", 0, token="t", http_port=0)
    await coordinator.start()
    try:
        with _eager_http_server() as web:
            assert coordinator.http_port is not None
            silent, http, page = torch_store.port, web, coordinator.http_port
            cases = {
                ("tcpstore", "async"): _async_store(silent),
                ("tcpstore", "sync"): _sync_store(silent),
                ("tcpstore", "init"): lambda: aiocoll.init_process_group(
                    f"tcp://127.0.0.1:{silent}", rank=1, world_size=2, timeout=_PATIENCE
                ),
                ("web", "async"): _async_store(http),
                ("web", "sync"): _sync_store(http),
                ("page", "async"): _async_store(page),
                ("page", "sync"): _sync_store(page),
            }
            outcomes = dict(
                zip(cases, await asyncio.gather(*(_failure(make) for make in cases.values())), strict=True)
            )
    finally:
        await coordinator.stop()
    for (target, client), (err, took) in outcomes.items():
        message = str(err)
        assert isinstance(err, ProtocolError), (target, client, err)
        assert message.count("not an aiocoll coordinator") == 1, message  # said once, not wrapped again
        if target == "tcpstore":
            assert message.startswith(
                f"127.0.0.1:{silent} accepted the connection but did not answer aiocoll's handshake "
                f"within {SILENCE:g}s, {SILENT_ATTEMPTS} times in a row: it is not an aiocoll coordinator "
                f"(a torch TCPStore, such as torchrun's on MASTER_PORT, behaves like this)"
            ), message
            assert took < SILENT_ATTEMPTS * SILENCE + 5, (client, took)
        else:
            port = http if target == "web" else page
            assert message.startswith(
                f"an HTTP server answered at 127.0.0.1:{port} (the coordinator's --http-port, or another "
                f"web service), not an aiocoll coordinator: use the coordinator's main port"
            ), message
            # The coordinator's HTTP port answers bytes it cannot parse after its 5 s read timeout.
            assert took < (3 if target == "web" else 8), (target, client, took)


@pytest.mark.timeout(60)
async def test_a_missing_token_is_named_on_the_side_that_lacks_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("AIOCOLL_TOKEN", raising=False)
    caplog.set_level(logging.WARNING, logger="aiocoll.server")
    guarded = Coordinator("127.0.0.1", 0, token="secret")
    open_ = Coordinator("127.0.0.1", 0)
    await guarded.start()
    await open_.start()
    try:
        with pytest.warns(RuntimeWarning, match="without a token"):
            no_token = [await _failure(_async_store(guarded.port)), await _failure(_sync_store(guarded.port))]
        theirs_none = [
            await _failure(_async_store(open_.port, "secret")),
            await _failure(_sync_store(open_.port, "secret")),
        ]
        other = [
            await _failure(_async_store(guarded.port, "other")),
            await _failure(_sync_store(guarded.port, "other")),
        ]
        for _ in range(100):  # each coordinator reads its client's hang-up in a later loop turn
            if sum("event=auth_failed" in r.getMessage() for r in caplog.records) >= 6:
                break
            await asyncio.sleep(0.05)
    finally:
        await guarded.stop()
        await open_.stop()
    for err, took in no_token:
        assert isinstance(err, AuthenticationError) and took < 5
        assert str(err).startswith(
            f"this process has no token (AIOCOLL_TOKEN is not set) but the coordinator at "
            f"127.0.0.1:{guarded.port} requires one: set AIOCOLL_TOKEN"
        ), err
    for err, _ in theirs_none:
        assert isinstance(err, AuthenticationError)
        assert str(err).startswith(
            f"the coordinator at 127.0.0.1:{open_.port} has no token but this process has one"
        ), err
    for err, _ in other:
        assert isinstance(err, AuthenticationError)
        assert str(err).startswith(f"the coordinator at 127.0.0.1:{guarded.port} holds a different token"), (
            err
        )
    for err, _ in no_token + theirs_none + other:
        assert str(err).count("token") <= 4 and "did not accept us" not in str(err), err
    # The coordinator's log says what it can know: whether it holds a token itself.
    refusals = [r.getMessage() for r in caplog.records if "event=auth_failed" in r.getMessage()]
    assert len(refusals) == 6, refusals
    assert sum("it holds another token than ours, or none" in m for m in refusals) == 4, refusals
    assert sum("it holds a token and this coordinator has none" in m for m in refusals) == 2, refusals


@pytest.mark.timeout(60)
async def test_a_client_gone_in_the_middle_of_its_handshake_is_no_auth_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rank that exits right after it started (its beat thread still connecting) closes after
    the coordinator's challenge without a verdict: logged as an abandoned handshake, not as a
    wrong token, and no member hears of a refusal. A wrong token still is one."""
    from aiocoll.protocol import MAGIC, ClientHandshake

    caplog.set_level(logging.INFO, logger="aiocoll.server")
    coordinator = Coordinator("127.0.0.1", 0, token="secret")
    await coordinator.start()
    try:
        for cut in ("after_challenge", "mid_hello"):
            reader, writer = await asyncio.open_connection("127.0.0.1", coordinator.port)
            hello = ClientHandshake("secret", role="worker", job="quick").start()
            if cut == "after_challenge":
                writer.write(hello)
                assert await asyncio.wait_for(reader.read(4096), 10)  # the challenge
            else:
                writer.write(hello[: len(MAGIC) + 6])
                await writer.drain()
            writer.close()  # as the kernel does for a process that exited
        for _ in range(200):
            if sum("event=handshake_abandoned" in r.getMessage() for r in caplog.records) >= 2:
                break
            await asyncio.sleep(0.05)
        # A real mismatch afterwards, for contrast: the client says so before hanging up.
        with pytest.raises(AuthenticationError):
            await aiocoll.connect_store(f"tcp://127.0.0.1:{coordinator.port}", token="other", timeout=10)
        for _ in range(200):
            if any("event=auth_failed" in r.getMessage() for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        metrics = coordinator.metrics.render()[0].decode()
    finally:
        await coordinator.stop()
    messages = [r.getMessage() for r in caplog.records]
    abandoned = [m for m in messages if "event=handshake_abandoned" in m]
    assert len(abandoned) == 2, messages
    assert "job=quick" in abandoned[0] and "after our challenge" in abandoned[0], abandoned
    failed = [m for m in messages if "event=auth_failed" in m]
    assert len(failed) == 1 and "the client found our proof wrong" in failed[0], messages
    assert not any("most likely" in m for m in messages), messages
    assert re.search(r"aiocoll_coordinator_auth_failures_total 1\.0", metrics), metrics
    for stage in ("after_challenge", "after_first_bytes"):  # counted apart from auth failures
        assert f'aiocoll_coordinator_handshakes_abandoned_total{{stage="{stage}"}} 1.0' in metrics, metrics


@pytest.mark.timeout(90)
async def test_a_coordinator_that_answered_and_then_froze_is_waited_for_not_called_foreign() -> None:
    """Silence is a verdict only on a first connection: later it is the same coordinator, stopped
    (SIGSTOP, a debugger), and reconnecting keeps trying until the timeout, as before."""
    frozen = socket.create_server(("127.0.0.1", 0))  # the kernel accepts for it; nobody answers
    coordinator = Coordinator("127.0.0.1", 0, token="t")
    await coordinator.start()
    try:
        async with FaultProxy("127.0.0.1", coordinator.port) as proxy:
            store = await aiocoll.connect_store(f"tcp://127.0.0.1:{proxy.port}", token="t", timeout=60)
            blocking = await asyncio.to_thread(
                aiocoll.sync.TCPStore, "127.0.0.1", proxy.port, timeout=60, token="t"
            )
            try:
                await store.set("k", b"1")
                await store.flush()
                proxy.retarget("127.0.0.1", frozen.getsockname()[1])
                proxy.cut()  # both clients reconnect, to a server that accepts and says nothing
                blocked = asyncio.ensure_future(asyncio.to_thread(blocking.get, "k"))
                waiting = asyncio.ensure_future(store.get("k"))
                await asyncio.sleep(SILENT_ATTEMPTS * SILENCE + 3)
                assert not blocked.done() and not waiting.done(), (blocked, waiting)
                proxy.retarget("127.0.0.1", coordinator.port)
                assert await asyncio.wait_for(waiting, 30) == b"1"
                assert await asyncio.wait_for(blocked, 30) == b"1"
            finally:
                await store.aclose()
                await asyncio.to_thread(blocking.close)
    finally:
        await coordinator.stop()
        frozen.close()
