"""`aiocoll status` run as a real process: against a small fake admin server written here with
aiocoll.protocol (every failure mode, exact rendering), and against a real coordinator process
(jobs, members and the HTTP endpoints, once `aiocoll coordinator` is available)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import re
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiocoll.server._page_access import page_proof

from aiocoll.protocol import ClientHandshake, FrameDecoder, ServerHandshake, encode_frame
from aiocoll.protocol._coordinator import ROLE_ADMIN, ROLE_BEAT, ROLE_WORKER
from aiocoll.protocol._store import OK
from aiocoll.testing.store_frames import request_frames

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TOKEN = "status-test-token"
# last_seen is "seconds ago", as the coordinator sends it, so the table does not depend on when
# this test runs relative to the module's import.
JOBS: list[dict[str, Any]] = [
    {
        "job": "train-a",
        "world_size": 2,
        "round": 1,
        "complete": True,
        "keys": 7,
        "members": [
            {"rank": 1, "host": "node-b", "alive": False, "last_seen": 125.0},
            {"rank": 0, "host": "node-a", "alive": True, "last_seen": 0.5},
        ],
    },
    {"job": "eval", "world_size": 4, "round": 0, "complete": False, "keys": 0, "members": []},
    # A job only store clients used: no rendezvous yet, so no world size or round.
    {"job": "store-only", "world_size": None, "round": None, "complete": False, "keys": 2, "members": []},
]


class FakeCoordinator:
    """Speaks just enough of the coordinator protocol: admin handshake, then `status`."""

    def __init__(self, *, silent: bool = False) -> None:
        self.silent = silent
        self.requests: list[dict[str, Any]] = []
        self.hellos: list[dict[str, Any]] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.silent:
                await reader.read()
                return
            hs = ServerHandshake(TOKEN, roles={ROLE_ADMIN})
            while not hs.done:
                data = await reader.read(65536)
                if not data:
                    return
                try:
                    out = hs.receive_data(data)
                except Exception as exc:
                    writer.write(ServerHandshake.reject_bytes(str(exc)))
                    return
                writer.write(out)
            self.hellos.append(hs.hello)
            decoder = FrameDecoder()
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                for frame in decoder.feed(data):
                    self.requests.append(frame.header)
                    # An unsolicited event first: the client must skip it.
                    writer.writelines(encode_frame({"ev": "restarted"}))
                    wanted = frame.header.get("job")
                    jobs = [j for j in JOBS if wanted is None or j["job"] == wanted]
                    writer.writelines(encode_frame({"id": frame.header["id"], "ok": True, "jobs": jobs}))
        finally:
            writer.close()


@pytest.fixture
async def fake() -> AsyncIterator[FakeCoordinator]:
    server = FakeCoordinator()
    await server.start()
    yield server
    await server.stop()


# The status module's own entry, as the dispatcher calls it; the real-coordinator test below goes
# through `python -m aiocoll status` itself.
_STATUS_ONLY = (
    "import argparse, sys; from aiocoll.cli import status; p = argparse.ArgumentParser('aiocoll status'); "
    "status.add_arguments(p); sys.exit(status.main(p.parse_args()))"
)


async def _status(
    *args: str, env: dict[str, str] | None = None, full_cli: bool = False
) -> tuple[int, str, str]:
    unset = ("AIOCOLL_TOKEN", "MASTER_ADDR", "MASTER_PORT")
    full_env = {k: v for k, v in os.environ.items() if k not in unset}
    full_env.update(env or {})
    entry = ["-m", "aiocoll", "status"] if full_cli else ["-c", _STATUS_ONLY]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *entry,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_status_prints_jobs_and_members_as_a_table(fake: FakeCoordinator, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")  # the trailing newline is not part of the token
    rc, out, err = await _status("--coordinator", f"127.0.0.1:{fake.port}", "--token-file", str(token_file))
    assert rc == 0, err
    assert fake.hellos[0]["role"] == ROLE_ADMIN
    assert fake.requests[0]["op"] == "status" and fake.requests[0]["job"] is None
    lines = out.splitlines()
    assert lines[0].split() == ["JOB", "WORLD", "SIZE", "ROUND", "COMPLETE", "KEYS"]
    assert lines[1].split() == ["eval", "4", "0", "no", "0"]  # jobs sorted by name
    assert "(no members)" in lines[2]
    store_only = next(line for line in lines if line.startswith("store-only"))
    assert store_only.split() == ["store-only", "-", "-", "no", "2"]
    train = lines.index(next(line for line in lines if line.startswith("train-a")))
    assert lines[train].split() == ["train-a", "2", "1", "yes", "7"]
    assert lines[train + 1].split() == ["RANK", "HOST", "ALIVE", "LAST", "HEARTBEAT"]
    rank0, rank1 = lines[train + 2].split(), lines[train + 3].split()
    assert rank0[:3] == ["0", "node-a", "yes"] and rank0[4] == "ago"
    assert float(rank0[3].rstrip("s")) < 60  # seconds ago, rendered in seconds
    assert rank1[:3] == ["1", "node-b", "no"] and rank1[3].endswith("m")  # ~2 minutes ago


async def test_status_json_for_one_job_with_token_from_env(fake: FakeCoordinator) -> None:
    rc, out, err = await _status(
        "--coordinator", f"127.0.0.1:{fake.port}", "--job", "train-a", "--json", env={"AIOCOLL_TOKEN": TOKEN}
    )
    assert rc == 0, err
    assert fake.requests[0]["job"] == "train-a"
    assert json.loads(out) == [JOBS[0]]


async def test_status_defaults_to_master_addr_and_port(fake: FakeCoordinator) -> None:
    rc, out, err = await _status(
        "--json", env={"AIOCOLL_TOKEN": TOKEN, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(fake.port)}
    )
    assert rc == 0, err
    assert [j["job"] for j in json.loads(out)] == ["train-a", "eval", "store-only"]


async def test_status_for_a_missing_job_exits_non_zero_naming_it(fake: FakeCoordinator) -> None:
    rc, _, err = await _status(
        "--coordinator", f"127.0.0.1:{fake.port}", "--job", "nope", env={"AIOCOLL_TOKEN": TOKEN}
    )
    assert rc == 1
    assert "no job 'nope'" in err


async def test_status_with_wrong_token_says_what_to_check(fake: FakeCoordinator) -> None:
    rc, out, err = await _status("--coordinator", f"127.0.0.1:{fake.port}", env={"AIOCOLL_TOKEN": "wrong"})
    assert rc == 1
    assert out == ""
    assert "authentication" in err and "AIOCOLL_TOKEN" in err and "--token-file" in err


async def test_status_without_a_coordinator_says_how_to_start_one() -> None:
    free = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = free.sockets[0].getsockname()[1]
    free.close()
    await free.wait_closed()
    rc, _, err = await _status("--coordinator", f"127.0.0.1:{port}")
    assert rc == 1
    assert f"no coordinator answers at 127.0.0.1:{port}" in err
    assert "aiocoll coordinator" in err


async def test_status_gives_up_on_a_silent_server_within_its_timeout() -> None:
    silent = FakeCoordinator(silent=True)
    await silent.start()
    try:
        started = time.monotonic()
        rc, _, err = await _status("--coordinator", f"127.0.0.1:{silent.port}", "--timeout", "1")
        assert rc == 1
        assert "did not answer within 1s" in err
        assert time.monotonic() - started < 20  # not a hang
    finally:
        await silent.stop()


async def test_status_rejects_a_malformed_address_and_unreadable_token_file(tmp_path: Path) -> None:
    rc, _, err = await _status("--coordinator", "127.0.0.1")
    assert rc == 1 and "HOST:PORT" in err
    rc, _, err = await _status("--coordinator", "127.0.0.1:1", "--token-file", str(tmp_path / "missing"))
    assert rc == 1 and "cannot read --token-file" in err
    (tmp_path / "empty").write_text("\n")
    rc, _, err = await _status("--coordinator", "127.0.0.1:1", "--token-file", str(tmp_path / "empty"))
    assert rc == 1 and "is empty" in err


# -- against a real coordinator process -------------------------------------------------------

_HAS_COORDINATOR = importlib.util.find_spec("aiocoll.cli.coordinator") is not None


async def _client(port: int, role: str, job: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    hs = ClientHandshake(TOKEN, role=role, job=job)
    writer.write(hs.start())
    while not hs.done:
        data = await asyncio.wait_for(reader.read(65536), 10)
        assert data, "coordinator closed the connection during the handshake"
        writer.write(hs.receive_data(data))
    return reader, writer


async def _request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    decoder: FrameDecoder,
    header: dict[str, Any],
    payload: bytes = b"",
) -> tuple[dict[str, Any], bytes]:
    writer.writelines(encode_frame(header, payload))
    while True:
        data = await asyncio.wait_for(reader.read(65536), 20)
        assert data, f"coordinator closed the connection instead of answering {header}"
        for frame in decoder.feed(data):
            if type(frame.header) is dict and frame.header.get("id") == header["id"]:
                return frame.header, bytes(frame.payload)


async def _until_reply(reader: asyncio.StreamReader, decoder: FrameDecoder, req_id: Any) -> Any:
    """Read frames until the reply to ``req_id`` (a compact store reply) arrives; returns its header."""
    while True:
        data = await asyncio.wait_for(reader.read(65536), 20)
        assert data, f"coordinator closed the connection instead of answering request {req_id}"
        for frame in decoder.feed(data):
            if type(frame.header) is list and frame.header[0] == req_id:
                return frame.header


def _http_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


@pytest.mark.skipif(not _HAS_COORDINATOR, reason="aiocoll.cli.coordinator is not written yet")
@pytest.mark.timeout(90)
async def test_status_and_http_endpoints_against_a_real_coordinator(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "aiocoll",
        "coordinator",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--http-port",
        "0",
        "--token-file",
        str(token_file),
        # The test's two members are raw connections that send no beats: past the heartbeat
        # timeout (10 s by default) the coordinator drops them, and on a loaded machine the
        # status commands this test starts one after another can take longer than that.
        "--heartbeat-timeout",
        "300",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    log: list[str] = []
    try:
        port = http_port = None
        assert proc.stdout is not None
        while port is None or http_port is None:
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            assert line, f"coordinator exited before listening: {log}"
            log.append(line)
            if m := re.search(r"http\S* .*on 127\.0\.0\.1:(\d+)", line):
                http_port = int(m.group(1))
            elif m := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
        drain = asyncio.ensure_future(proc.stdout.read())  # keep the pipe from filling

        # Two workers join job "train" and a store client writes keys.
        workers = []
        for _ in (0, 1):
            r, w = await _client(port, ROLE_WORKER, "train")
            workers.append((r, w, FrameDecoder(lists=True)))
        joins = [
            _request(
                r,
                w,
                d,
                {
                    "op": "join",
                    "id": 1,
                    "rank": rank,
                    "world_size": 2,
                    "addrs": [["127.0.0.1", 40000 + rank]],
                    "host": f"host-{rank}",
                    "timeout": 20,
                },
            )
            for rank, (r, w, d) in enumerate(workers)
        ]
        for reply, _ in await asyncio.gather(*joins):
            assert reply["ok"], reply
        r, w, d = workers[0]
        for i in range(3):
            frames, sync = request_frames("set", 10 + i, b"v", key=f"k{i}")
            w.write(frames)
            reply = await _until_reply(r, d, sync)
            assert reply == [sync, OK], reply  # no refusal came before the SYNC behind the set

        rc, out, err = await _status(
            "--coordinator", f"127.0.0.1:{port}", "--json", env={"AIOCOLL_TOKEN": TOKEN}, full_cli=True
        )
        assert rc == 0, err
        (job,) = [j for j in json.loads(out) if j["job"] == "train"]
        assert job["world_size"] == 2 and job["complete"] is True and job["keys"] >= 3
        assert [(m["rank"], m["host"], m["alive"]) for m in job["members"]] == [
            (0, "host-0", True),
            (1, "host-1", True),
        ]
        rc, out, err = await _status(
            "--coordinator", f"127.0.0.1:{port}", "--job", "train", "--token-file", str(token_file)
        )
        assert rc == 0, err
        assert "train" in out and "host-1" in out and "ago" in out

        rc, _, err = await _status("--coordinator", f"127.0.0.1:{port}", env={"AIOCOLL_TOKEN": "wrong"})
        assert rc == 1 and "AIOCOLL_TOKEN" in err
        # The web port given for the coordinator's: said once, what answered and which port to use.
        rc, _, err = await _status("--coordinator", f"127.0.0.1:{http_port}", env={"AIOCOLL_TOKEN": TOKEN})
        assert rc == 1 and f"an HTTP server answered at 127.0.0.1:{http_port}" in err, err
        assert err.count("answered") == 1 and "main port" in err, err

        status, _, body = await asyncio.to_thread(_http_get, http_port, "/healthz")
        assert status == 200 and body
        status, _, body = await asyncio.to_thread(_http_get, http_port, "/jobs")
        assert status == 401 and b"train" not in body  # with a token: only for who proved holding it
        nonce = json.loads((await asyncio.to_thread(_http_get, http_port, "/auth"))[2])["nonce"]
        proof = page_proof(TOKEN, nonce)
        _, _, body = await asyncio.to_thread(_http_get, http_port, f"/auth?nonce={nonce}&proof={proof}")
        bearer = {"Authorization": f"Bearer {json.loads(body)['session']}"}
        status, content_type, body = await asyncio.to_thread(_http_get, http_port, "/jobs", bearer)
        assert status == 200 and content_type.startswith("application/json")
        assert "train" in json.dumps(json.loads(body))
        status, content_type, body = await asyncio.to_thread(_http_get, http_port, "/metrics")
        assert status == 200 and content_type.startswith("text/plain")
        from prometheus_client.parser import text_string_to_metric_families

        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode())
            for s in f.samples
        }
        assert samples[("aiocoll_coordinator_operations_total", (("op", "set"), ("outcome", "ok")))] >= 3
        assert samples[("aiocoll_coordinator_connections_open", ())] >= 2
        # The wrong-token `aiocoll status` above closed after the coordinator's challenge.
        assert samples[("aiocoll_coordinator_auth_failures_total", ())] >= 1
        assert samples[("aiocoll_coordinator_members", ())] == 2
        for _, w, _ in workers:
            w.close()
        drain.cancel()
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()


async def test_status_watch_refreshes_until_interrupted(fake: FakeCoordinator) -> None:
    full_env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    full_env["AIOCOLL_TOKEN"] = TOKEN
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _STATUS_ONLY,
        "--coordinator",
        f"127.0.0.1:{fake.port}",
        "--watch",
        "0.2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=full_env,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    while sum("Ctrl-C stops" in line for line in lines) < 3:  # three refreshes
        lines.append((await asyncio.wait_for(proc.stdout.readline(), 20)).decode())
    proc.send_signal(signal.SIGINT)
    await asyncio.wait_for(proc.wait(), 20)
    assert proc.returncode == 0
    # the third header is printed before its query: at least two queries were answered
    assert len(fake.requests) >= 2 and all(r["op"] == "status" for r in fake.requests)
    assert any(line.startswith("train-a") for line in lines)


@pytest.mark.timeout(30)
async def test_a_beat_connection_of_a_member_already_gone_is_closed_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A quick process may leave before its beat thread's connection arrives: the coordinator
    closes that connection, noting it, without a warning in the job's log."""
    from aiocoll.server import Coordinator

    caplog.set_level(logging.INFO, logger="aiocoll.server")
    coordinator = Coordinator("127.0.0.1", 0, token=TOKEN)
    await coordinator.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", coordinator.port)
        hs = ClientHandshake(TOKEN, role=ROLE_BEAT, job="quick", extra={"session": "left-already"})
        writer.write(hs.start())
        while not hs.done:
            data = await asyncio.wait_for(reader.read(65536), 10)
            assert data, "the coordinator closed the connection during the handshake"
            writer.write(hs.receive_data(data))
        with contextlib.suppress(ConnectionError):
            while await asyncio.wait_for(reader.read(65536), 10):
                pass  # until the coordinator closes it
        writer.close()
    finally:
        await coordinator.stop()
    about = [r for r in caplog.records if "job=quick" in r.getMessage()]
    assert [r.levelno for r in about] == [logging.INFO], [r.getMessage() for r in about]
    assert "event=beat_closed" in about[0].getMessage() and "alive member" in about[0].getMessage()
