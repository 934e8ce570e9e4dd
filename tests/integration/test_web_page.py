"""The coordinator's web page in a real browser (issue 21): headless Chromium, driven over the
DevTools protocol (a websocket client written here on asyncio streams: standard library only),
loads the page of an embedded coordinator serving a 3-rank job of real worker processes.

The job first runs collectives (healthy), then ranks 0 and 1 enter an all_reduce that rank 2
never calls: the page must tag rank 2 as holding the job back. Rank 2 is then killed, and the
same page, without a reload, must show it lost. The page gets the token from the URL fragment
and must never send it; without the token, or with a wrong one, it must show nothing of any job.

Screenshots of both states are taken each run; with AIOCOLL_PAGE_SCREENSHOTS=DIR they are also
written to DIR (docs/ holds the ones docs/COORDINATOR.md shows).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiocoll.server import Coordinator

from aiocoll.testing.world import World

pytestmark = [pytest.mark.integration]

TOKEN = "web-page-test-token"
JOB = "web-page-job"


CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
)


_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run"]


# -- the DevTools protocol over a websocket (RFC 6455, client side) ----------------------------


class DevTools:
    """One page target of a Chromium: ``call`` a method, read the events that came meanwhile."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.events: list[dict[str, Any]] = []
        self._ids = 0

    @classmethod
    async def connect(cls, url: str) -> DevTools:
        where = urllib.parse.urlsplit(url)
        reader, writer = await asyncio.open_connection(where.hostname, where.port, limit=1 << 26)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(
            f"GET {where.path} HTTP/1.1\r\nHost: {where.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 101"), head
        return cls(reader, writer)

    def _send(self, text: str) -> None:
        data = text.encode()
        n = len(data)
        head = bytearray([0x81])  # FIN, text
        if n < 126:
            head.append(0x80 | n)
        elif n < 1 << 16:
            head += bytes([0x80 | 126]) + n.to_bytes(2, "big")
        else:
            head += bytes([0x80 | 127]) + n.to_bytes(8, "big")
        mask = os.urandom(4)  # a client masks every frame
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.writer.write(bytes(head) + mask + masked)

    async def _receive(self) -> str:
        message = bytearray()
        while True:
            b0, b1 = await self.reader.readexactly(2)
            n = b1 & 0x7F
            if n == 126:
                n = int.from_bytes(await self.reader.readexactly(2), "big")
            elif n == 127:
                n = int.from_bytes(await self.reader.readexactly(8), "big")
            mask = await self.reader.readexactly(4) if b1 & 0x80 else b""
            payload = await self.reader.readexactly(n)
            if mask:
                payload = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("the browser closed the DevTools websocket")
            if opcode in (0x9, 0xA):  # ping, pong
                continue
            message += payload
            if b0 & 0x80:
                return message.decode()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        self._send(json.dumps({"id": self._ids, "method": method, "params": params}))
        while True:
            msg = json.loads(await asyncio.wait_for(self._receive(), 30))
            if msg.get("id") == self._ids:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self.events.append(msg)

    async def evaluate(self, expression: str) -> Any:
        reply = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"page script failed: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    async def until(self, expression: str, done: Callable[[Any], bool], within: float, what: str) -> Any:
        """Evaluate ``expression`` every 0.25 s until ``done(value)``; fail naming ``what``."""
        deadline = time.monotonic() + within
        value = None
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if done(value):
                return value
            await asyncio.sleep(0.25)
        text = await self.evaluate("document.body.innerText")
        raise AssertionError(f"{what} not seen within {within}s; last {value!r}; the page shows:\n{text}")

    async def screenshot(self, path: Path) -> None:
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=1180,
            height=max(400, int(height)),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.call("Page.captureScreenshot", format="png")
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[DevTools]:
    """A headless Chromium with one blank page, its own profile, and the DevTools port open."""
    assert CHROMIUM is not None
    profile = tmp_path / "profile"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        *_FLAGS,
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    tools: DevTools | None = None
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.returncode is None, f"chromium exited with {proc.returncode} before listening"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port within 30 s"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])

        def targets() -> list[dict[str, Any]]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
                found: list[dict[str, Any]] = json.load(reply)
                return found

        (page,) = [t for t in await asyncio.to_thread(targets) if t["type"] == "page"]
        tools = await DevTools.connect(page["webSocketDebuggerUrl"])
        await tools.call("Network.enable")
        yield tools
    finally:
        if tools is not None:
            tools.close()
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def _dump_dom(url: str) -> str:
    """What a fresh browser shows at ``url`` after a few seconds of (virtual) time."""
    with tempfile.TemporaryDirectory(prefix="aiocoll-page-") as profile:
        command = [str(CHROMIUM), *_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=4000"]
        done = subprocess.run([*command, "--dump-dom", url], capture_output=True, text=True, timeout=60)
    assert "<main" in done.stdout, f"chromium dumped no page (exit {done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


# -- the job the page shows ---------------------------------------------------------------------


async def healthy_then_stuck(pg: Any, flag: str) -> dict[str, Any]:
    """Collectives until ``flag`` exists (rank 0 decides, every rank follows); then ranks 0 and 1
    wait in an all_reduce that rank 2 never calls (the test kills rank 2 there)."""
    x = np.ones(4, np.float32)
    while await pg.broadcast_object(not Path(flag).exists() if pg.rank == 0 else None, src=0):  # noqa: ASYNC240
        await pg.all_reduce(x)
        await asyncio.sleep(0.1)
    if pg.rank == 2:
        await asyncio.sleep(300)  # alive, its loop running, elsewhere: the others wait for it  # SLEEPS
        return {}
    try:
        await pg.all_reduce(x, timeout=120)
    except Exception as exc:  # PeerLostError once rank 2 is killed
        return {"error": type(exc).__name__}
    return {"error": None}


_SLEEPS = next(n for n, t in enumerate(Path(__file__).read_text().splitlines(), 1) if t.endswith("# SLEEPS"))

_ROW = """(() => {{
  const row = document.querySelector('section[data-job="{job}"] tr[data-rank="{rank}"]');
  return row ? {{held: row.dataset.held, state: row.dataset.state}} : null;
}})()"""


def _keep(shot: Path) -> None:
    where = os.environ.get("AIOCOLL_PAGE_SCREENSHOTS")
    if where:
        shutil.copyfile(shot, Path(where) / shot.name)


@needs_chromium
@pytest.mark.timeout(240)
async def test_the_page_shows_the_rank_holding_a_job_back_then_lost_live(
    browser: DevTools, tmp_path: Path
) -> None:
    flag = tmp_path / "stuck-now"
    async with Coordinator("127.0.0.1", 0, token=TOKEN, http_port=0) as coord:
        world = World(
            healthy_then_stuck,
            3,
            args=(str(flag),),
            init_method=f"tcp://127.0.0.1:{coord.port}",
            token=TOKEN,
            job=JOB,
        )
        try:
            page = f"http://127.0.0.1:{coord.http_port}/"
            await browser.call("Page.navigate", url=page + "#token=" + urllib.parse.quote(TOKEN))

            # Healthy: every rank alive, nobody holds the job back.
            rows = f"""Array.from(document.querySelectorAll('section[data-job="{JOB}"] tr[data-rank]'))
                .map(r => [r.dataset.rank, r.dataset.state, r.dataset.held].join(':'))"""
            await browser.until(
                rows, lambda v: v == ["0:alive:false", "1:alive:false", "2:alive:false"], 60, "3 alive ranks"
            )
            assert await browser.evaluate("location.hash") == ""  # the token left the address bar
            assert "round 0 complete" in await browser.evaluate("document.body.innerText")
            await browser.screenshot(tmp_path / "coordinator-page-healthy.png")
            _keep(tmp_path / "coordinator-page-healthy.png")

            # Stuck: ranks 0 and 1 wait for rank 2, which the page tags as holding the job back.
            flag.write_text("now")
            await browser.until(
                _ROW.format(job=JOB, rank=2),
                lambda v: v == {"held": "true", "state": "alive"},
                40,
                "rank 2 held back",
            )
            text = await browser.evaluate("document.body.innerText")
            assert "holds the job back" in text and "all_reduce(" in text
            # Beside rank 2's row, its Python stack as it is now: the line it sleeps at, first.
            sleeps = _SLEEPS
            section = f'section[data-job="{JOB}"]'
            held = f'{section} tr[data-rank="2"] details.stack li'
            first = f"document.querySelector('{held}')?.innerText || ''"
            await browser.until(
                first, lambda v: f"test_web_page.py:{sleeps} in healthy_then_stuck" in v, 20, "rank 2's stack"
            )
            others = f"document.querySelectorAll('{section} tr[data-held=\"false\"] details.stack').length"
            assert not await browser.evaluate(others)
            assert (await browser.evaluate(_ROW.format(job=JOB, rank=0)))["held"] == "false"
            await browser.screenshot(tmp_path / "coordinator-page-stuck.png")
            _keep(tmp_path / "coordinator-page-stuck.png")

            # Without the token, or with a wrong one, a fresh browser sees nothing of any job.
            for url, notice in ((page, "locked"), (page + "#token=not-the-token", "refused")):
                dom = await asyncio.to_thread(_dump_dom, url)
                assert JOB not in dom and "data-rank" not in dom, dom
                assert re.search(rf'id="notice"[^>]*data-kind="{notice}"', dom), dom

            # Rank 2 dies: the same page, never reloaded, shows it lost and says so in its events.
            await browser.evaluate("window.notReloaded = true")
            world.kill(2)
            lost = _ROW.format(job=JOB, rank=2)
            await browser.until(lost, lambda v: v and v["state"] == "lost", 30, "rank 2 lost")
            assert await browser.evaluate("window.notReloaded === true")
            await browser.until(
                f"""Array.from(document.querySelectorAll('section[data-job="{JOB}"] li[data-kind="lost"]'))
                    .map(li => li.textContent).join(' | ')""",
                lambda v: "rank 2 lost from round 0" in v,
                10,
                "the loss among the recent events",
            )

            # The token was never sent: not in a URL, a header or a body (DevTools reports the
            # address bar's fragment as the navigation's urlFragment: that stays in the browser).
            await browser.evaluate("1")  # collect the network events that came meanwhile
            wire = []
            for event in browser.events:
                params = event.get("params", {})
                if event.get("method") == "Network.requestWillBeSent":
                    request = params["request"]
                    wire.append([request["url"], request.get("headers"), request.get("postData")])
                elif event.get("method") == "Network.requestWillBeSentExtraInfo":
                    wire.append(params.get("headers"))  # the headers as sent, cookies included
            assert any(str(w[0]).endswith("/jobs") for w in wire if isinstance(w, list))
            assert all(TOKEN not in json.dumps(w) for w in wire), wire
        finally:
            results = await asyncio.to_thread(world.join, 60)
        # Ranks 0 and 1 returned and left: their State cell says "left" once, not "left left".
        states = f"""Array.from(document.querySelectorAll('section[data-job="{JOB}"] tr[data-rank] td.state'))
            .map(td => td.innerText.trim())"""
        await browser.until(states, lambda v: v[:2] == ["left", "left"], 30, "ranks 0 and 1 left, once each")
    for rank in (0, 1):
        assert results[rank].value == {"error": "PeerLostError"}, results[rank]
    for name in ("coordinator-page-healthy.png", "coordinator-page-stuck.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
