"""A coordinator out of file descriptors says so at once, in every place someone looks: the
refused client's error, the ranks waiting in a forming round, the log and /metrics; and it takes
connections again once some close. Against a real coordinator process with a small limit."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiocoll.client.control.session import CoordinatorSession, CoordinatorUnreachable

from aiocoll.testing.coordinator import CoordinatorProcess
from aiocoll.testing.world import free_port

pytestmark = pytest.mark.integration

TOKEN = "capacity-secret"
LIMIT = 160


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


async def _until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not seen within {timeout} s"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(60)
async def test_a_coordinator_out_of_descriptors_refuses_saying_why_and_tells_the_waiting_ranks(
    tmp_path: Path,
) -> None:
    http_port = free_port()
    coord = CoordinatorProcess(
        tmp_path / "coordinator.log", "--http-port", str(http_port), token=TOKEN, descriptor_limit=LIMIT
    )
    sessions: list[CoordinatorSession] = []
    try:
        # (the line after "listening on", which the constructor waits for: under load, a moment later)
        await _until(lambda: f"at most {LIMIT}" in coord.log(), "its descriptor budget stated when it starts")
        waiter = await CoordinatorSession.connect("127.0.0.1", coord.port, token=TOKEN, job="big", timeout=30)
        sessions.append(waiter)
        events: list[dict[str, Any]] = []
        waiter.on_event(events.append)
        join = asyncio.ensure_future(waiter.join(None, 1000, [("127.0.0.1", 1)], "h", timeout=30))
        refused: BaseException | None = None
        for _ in range(LIMIT):
            try:
                sessions.append(
                    await CoordinatorSession.connect(
                        "127.0.0.1", coord.port, token=TOKEN, job="other", role="store", timeout=1.0
                    )
                )
            except CoordinatorUnreachable as exc:
                refused = exc
                break
        assert refused is not None, f"{len(sessions)} connections and none refused"
        assert "out of file descriptors" in str(refused) and f"limit {LIMIT}" in str(refused), refused
        assert len(sessions) > LIMIT // 3, "the reserve leaves most descriptors to connections"
        # The rank waiting for the others hears it now, not when its join times out.
        await _until(
            lambda: any(
                e.get("ev") == "refused" and "file descriptors" in e.get("reason", "") for e in events
            ),
            "the refusal told to the rank waiting in a forming round",
        )
        assert not join.done()
        assert "event=out_of_descriptors" in coord.log()
        metrics = await asyncio.to_thread(_get, f"http://127.0.0.1:{http_port}/metrics")
        assert 'aiocoll_coordinator_refused_connections_total{reason="descriptors"}' in metrics
        assert f"aiocoll_coordinator_descriptor_limit {LIMIT}.0" in metrics
        # Connections that close give their descriptors back: a new client gets in.
        for session in sessions[-10:]:
            await session.aclose()
        del sessions[-10:]
        late = await CoordinatorSession.connect(
            "127.0.0.1", coord.port, token=TOKEN, job="other", role="store", timeout=10
        )
        sessions.append(late)
        await late.set("k", b"v")
        assert await late.get("k") == b"v"
        join.cancel()
    finally:
        for session in sessions:
            session.abort()
        coord.stop()
