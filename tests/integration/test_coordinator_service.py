"""The coordinator service against real `aiocoll coordinator` processes on loopback, spoken to by
a minimal raw client built on aiocoll.protocol only: every store operation, many concurrent
clients, bad input of every kind (garbage, truncated frames, gigabyte prefixes, unknown ops,
wrong tokens, hundreds of half-open connections), the HTTP endpoints, SIGTERM drain, and a
kill -9 restart on --state-dir that loses nothing acknowledged. A few checks that need short
timeouts (handshake deadline, heartbeat loss, resume grace) run on an embedded Coordinator."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiocoll.server import Coordinator
from aiocoll.server import _connection as connection_module
from aiocoll.server._page_access import page_proof

from aiocoll import AuthenticationError
from aiocoll.protocol import MAGIC, ClientHandshake, FrameDecoder, encode_frame, pack_prefix
from aiocoll.protocol._coordinator import (
    ERR_INVALID,
    ERR_TOO_LARGE,
    ERR_UNKNOWN_OP,
    EV_MEMBER_LOST,
    EV_RESTARTED,
    EV_SESSION_LOST,
    join_values,
)
from aiocoll.testing.coordinator import CoordinatorProcess
from aiocoll.testing.store_frames import CODES, as_map, request_frames
from aiocoll.testing.world import free_port

pytestmark = pytest.mark.integration

TOKEN = "service-test-token"


# ---------------------------------------------------------------- helpers
class RawClient:
    """Handshake, then requests matched to replies by id; unsolicited events go to a queue."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder(max_header=16 << 20, max_payload=1 << 31, lists=True)
        self.ids = itertools.count(1)
        self.ops: dict[int, str] = {}  # store requests' names by id, to read their replies
        self.pending: dict[int, asyncio.Future[tuple[dict[str, Any], bytes]]] = {}
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.task = loop.create_task(self._read_loop())

    @classmethod
    async def connect(
        cls,
        port: int,
        *,
        token: str | None = TOKEN,
        job: str = "job",
        role: str = "store",
        extra: dict[str, Any] | None = None,
    ) -> RawClient:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        hs = ClientHandshake(token, role=role, job=job, extra=extra)
        writer.write(hs.start())
        try:
            while not hs.done:
                data = await asyncio.wait_for(reader.read(4096), 10)
                if not data:
                    raise ConnectionError("the coordinator closed the connection during the handshake")
                out = hs.receive_data(data)
                if out:
                    writer.write(out)
        except BaseException:
            if hs.farewell:  # the coordinator's proof failed: say so, as every client does
                writer.write(hs.farewell)
            writer.close()
            raise
        return cls(reader, writer)

    async def _read_loop(self) -> None:
        try:
            while data := await self.reader.read(1 << 20):
                for frame in self.decoder.feed(data):
                    header = frame.header
                    if type(header) is list:  # a store reply, compact: read it as a map
                        req_id = header[0]
                        if req_id < 0:  # the SYNC behind a set: the set's "ok"
                            req_id, header = -req_id, {"id": -req_id, "ok": True}
                        else:
                            header = as_map(self.ops.pop(req_id, ""), header)
                        fut = self.pending.pop(req_id, None)
                        if fut is not None and not fut.done():
                            fut.set_result((header, bytes(frame.payload)))
                    elif "id" in header:
                        fut = self.pending.pop(header["id"], None)
                        if fut is not None and not fut.done():
                            fut.set_result((header, bytes(frame.payload)))
                    else:
                        self.events.put_nowait(header)
        except OSError:
            pass
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("connection closed"))
            if not self.closed.done():
                self.closed.set_result(None)

    def send(
        self, op: str, payload: bytes = b"", **fields: Any
    ) -> asyncio.Future[tuple[dict[str, Any], bytes]]:
        req_id = next(self.ids)
        fut: asyncio.Future[tuple[dict[str, Any], bytes]] = asyncio.get_running_loop().create_future()
        self.pending[req_id] = fut
        # Replies to fire-and-forget requests may never be awaited: mark their errors as seen.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        if op in CODES:  # a store request: its compact form (and a SYNC behind a set)
            self.ops[req_id] = op
            self.writer.write(request_frames(op, req_id, payload, **fields)[0])
        else:
            self.writer.writelines(encode_frame({"op": op, "id": req_id, **fields}, payload))
        return fut

    async def call(self, op: str, payload: bytes = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        return await asyncio.wait_for(self.send(op, payload, **fields), 10)

    async def ok(self, op: str, payload: bytes = b"", **fields: Any) -> tuple[dict[str, Any], bytes]:
        header, body = await self.call(op, payload, **fields)
        assert header["ok"] is True, header
        return header, body

    async def close(self) -> None:
        self.writer.close()
        try:
            await asyncio.wait_for(asyncio.shield(self.closed), 5)
        finally:
            self.task.cancel()


def _coordinator(tmp: Path, *args: str, name: str = "coordinator") -> CoordinatorProcess:
    return CoordinatorProcess(tmp / f"{name}.log", *args, token=TOKEN)


def rss_kib(coord: CoordinatorProcess) -> int:
    for line in Path(f"/proc/{coord.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def spawned(tmp_path: Path) -> Iterator[list[CoordinatorProcess]]:
    procs: list[CoordinatorProcess] = []
    yield procs
    for p in procs:
        p.stop(signal.SIGKILL)


async def wait_closed_by_server(reader: asyncio.StreamReader, within: float = 10.0) -> bytes:
    """Read until the coordinator closes the connection; returns what it sent first."""
    received = b""
    async with asyncio.timeout(within):
        while True:
            try:
                data = await reader.read(65536)
            except ConnectionResetError:
                return received
            if not data:
                return received
            received += data


async def http_get(port: int, path: str, extra: str = "") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def wait_for_log(proc: CoordinatorProcess, pattern: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if re.search(pattern, proc.log()):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{pattern!r} never appeared in the coordinator's log:\n{proc.log()}")


# ---------------------------------------------------------------- one process, many checks
@pytest.mark.timeout(60)
async def test_coordinator_process_serves_everyone_despite_bad_input_and_drains_on_sigterm(
    tmp_path: Path, spawned: list[CoordinatorProcess]
) -> None:
    http_port = free_port()
    coord = _coordinator(tmp_path, "--max-value-bytes", "65536", "--http-port", str(http_port))
    spawned.append(coord)
    port = coord.port
    good = await RawClient.connect(port, job="train")

    # Every store operation, over the wire.
    await good.ok("set", b"v1", key="a")
    assert (await good.ok("get", key="a", timeout=5))[1] == b"v1"
    assert (await good.ok("add", key="n", amount=41))[0]["value"] == 41
    payload, sizes = join_values([b"", b"x"])
    assert (await good.ok("cas", payload, key="c", sizes=sizes))[1] == b"x"
    payload, sizes = join_values([b"p", b"qq"])
    await good.ok("mset", payload, keys=["m1", "m2"], sizes=sizes)
    header, body = await good.ok("mget", keys=["m2", "m1"], timeout=5)
    assert (header["sizes"], body) == ([2, 1], b"qqp")
    await good.ok("append", b"-tail", key="a")
    assert (await good.ok("check", keys=["a", "m1"]))[0]["value"] is True
    assert (await good.ok("del", key="m1"))[0]["value"] is True
    assert (await good.ok("nkeys"))[0]["value"] == 4  # a, n, c, m2
    waiting = good.send("wait", keys=["late"], timeout=20)
    other = await RawClient.connect(port, job="train")
    await other.ok("set", b"!", key="late")
    assert (await asyncio.wait_for(waiting, 10))[0]["ok"] is True

    # Well-formed but bad requests get an error reply; the connection stays usable.
    header, _ = await good.call("frobnicate", key="a")
    assert header["err"] == ERR_UNKNOWN_OP
    header, _ = await good.call("set", b"v", key=["not", "a", "string"])
    assert header["err"] == ERR_INVALID
    header, _ = await good.call("set", b"x" * 70000, key="huge")
    assert header["err"] == ERR_TOO_LARGE and "huge" in header["msg"] and "65536" in header["msg"]

    # Wrong and missing tokens are refused with a reason; the server logs and counts them.
    for token in ("wrong-token", None):
        with pytest.raises(AuthenticationError):
            await RawClient.connect(port, token=token)

    # Garbage bytes before the handshake.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET / HTTP/1.1\r\n\r\n" + os.urandom(64))
    await wait_closed_by_server(reader)
    writer.close()
    # A gigabyte length prefix in place of a hello.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(MAGIC + pack_prefix(1 << 30, 1 << 40))
    await wait_closed_by_server(reader)
    writer.close()
    # A gigabyte payload announced by an authenticated client: closed, not allocated.
    bad = await RawClient.connect(port, job="train")
    bad.writer.write(pack_prefix(20, 1 << 30) + b"\x81\xa2op\xa3set" + b"\0" * 12)
    await asyncio.wait_for(asyncio.shield(bad.closed), 10)
    # Garbage after an authenticated handshake (an undecodable header).
    bad = await RawClient.connect(port, job="train")
    bad.writer.write(pack_prefix(8, 0) + b"\xc1" * 8)
    await asyncio.wait_for(asyncio.shield(bad.closed), 10)
    # A request without an id cannot be answered: closed.
    bad = await RawClient.connect(port, job="train")
    bad.writer.writelines(encode_frame({"op": "get", "key": "a"}))
    await asyncio.wait_for(asyncio.shield(bad.closed), 10)
    # A truncated frame: the client hangs up mid-payload.
    bad = await RawClient.connect(port, job="train")
    bad.writer.writelines(encode_frame({"op": "set", "id": 1, "key": "t"}, b"y" * 1000)[:1])
    bad.writer.write(b"y" * 10)
    await asyncio.sleep(0.1)
    await bad.close()
    await wait_for_log(coord, r"truncated")

    # Hundreds of half-open connections: memory stays bounded and everyone else is served.
    rss_before = rss_kib(coord)
    half_open = []
    for i in range(300):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(MAGIC[: 1 + i % 7] if i % 2 else MAGIC + pack_prefix(100, 0) + b"\x81")
        half_open.append(w)
    await asyncio.sleep(0.3)
    assert (await good.ok("get", key="a", timeout=5))[1] == b"v1-tail"
    growth_mib = (rss_kib(coord) - rss_before) / 1024
    assert growth_mib < 40, f"300 half-open connections grew the coordinator by {growth_mib:.1f} MiB"

    # Many concurrent clients: every add is counted exactly once.
    clients = await asyncio.gather(*(RawClient.connect(port, job="train") for _ in range(40)))

    async def adds(c: RawClient) -> None:
        for _ in range(25):
            await c.ok("add", key="counter", amount=1)

    await asyncio.gather(*(adds(c) for c in clients))
    assert (await good.ok("get", key="counter"))[1] == b"1000"

    # A rendezvous with a member lost: the other member is told at once.
    workers = [await RawClient.connect(port, job="rdzv", role="worker") for _ in range(2)]
    joins = [
        w.send("join", rank=None, world_size=2, addrs=[["127.0.0.1", 7000 + i]], host="h", timeout=10)
        for i, w in enumerate(workers)
    ]
    replies = [(await asyncio.wait_for(j, 10))[0] for j in joins]
    assert sorted(r["rank"] for r in replies) == [0, 1] and replies[0]["members"] == replies[1]["members"]
    await workers[1].close()
    event = await asyncio.wait_for(workers[0].events.get(), 10)
    assert event["ev"] == EV_MEMBER_LOST and event["rank"] == replies[1]["rank"]

    # HTTP endpoints.
    status, body = await http_get(http_port, "/healthz")
    assert status == 200
    status, body = await http_get(http_port, "/jobs")
    assert status == 401 and b"train" not in body  # with a token: only for who proved holding it
    nonce = json.loads((await http_get(http_port, "/auth"))[1])["nonce"]
    _, body = await http_get(http_port, f"/auth?nonce={nonce}&proof={page_proof(TOKEN, nonce)}")
    bearer = f"Authorization: Bearer {json.loads(body)['session']}\r\n"
    status, body = await http_get(http_port, "/jobs", bearer)
    jobs = {j["job"]: j for j in json.loads(body)["jobs"]}
    assert jobs["train"]["keys"] == 6  # a, n, c, m2, late, counter and jobs["rdzv"]["world_size"] == 2
    status, body = await http_get(http_port, "/metrics")
    metrics = body.decode()
    assert re.search(r"aiocoll_coordinator_auth_failures_total 2\.0", metrics), metrics
    assert "aiocoll_coordinator_protocol_errors_total" in metrics
    assert re.search(r'aiocoll_coordinator_operations_total\{op="add",outcome="ok"\} 10\d\d', metrics)

    # Every bad connection left a reason in the log.
    log = coord.log()
    assert "event=auth_failed" in log and "bad magic" in log and "exceeds the limit" in log
    assert "without an integer 'id'" in log and "undecodable" in log

    # SIGTERM: drain and exit 0, closing the connections it still had.
    for w in half_open:
        w.close()
    assert coord.stop(signal.SIGTERM) == 0
    assert "draining" in coord.log() and "stopped" in coord.log()
    await asyncio.wait_for(asyncio.shield(good.closed), 10)


# ---------------------------------------------------------------- durability
@pytest.mark.timeout(60)
async def test_restart_after_kill_9_with_state_dir_loses_nothing_acknowledged(
    tmp_path: Path, spawned: list[CoordinatorProcess]
) -> None:
    state_dir = tmp_path / "state"
    coord = _coordinator(tmp_path, "--state-dir", str(state_dir), name="first")
    spawned.append(coord)
    writers = await asyncio.gather(*(RawClient.connect(coord.port, job="durable") for _ in range(8)))
    acknowledged: dict[str, bytes] = {}

    async def write(c: RawClient, n: int) -> None:
        for i in range(60):
            key = f"w{n}-{i}"
            await c.ok("set", f"{n}:{i}".encode(), key=key)
            acknowledged[key] = f"{n}:{i}".encode()
            await c.ok("add", key="total", amount=1)
            await c.ok("append", b"%d," % n, key=f"log{n}")

    await asyncio.gather(*(write(c, n) for n, c in enumerate(writers)))
    await writers[0].ok("del", key="w0-0")
    del acknowledged["w0-0"]
    payload, sizes = join_values([b"A", b"BB"])
    await writers[0].ok("mset", payload, keys=["ma", "mb"], sizes=sizes)
    workers = [await RawClient.connect(coord.port, job="durable", role="worker") for _ in range(2)]
    joins = [
        w.send("join", rank=i, world_size=2, addrs=[["127.0.0.1", 9000 + i]], host="h", timeout=10)
        for i, w in enumerate(workers)
    ]
    sessions = [(await asyncio.wait_for(j, 10))[0]["session"] for j in joins]
    # Writes still in flight when the process dies may or may not land; acknowledged ones must.
    for c in writers:
        for i in range(5):
            c.send("set", b"maybe", key=f"inflight-{i}")
    coord.stop(signal.SIGKILL)

    again = _coordinator(tmp_path, "--state-dir", str(state_dir), name="second")
    spawned.append(again)
    reader = await RawClient.connect(again.port, job="durable")
    keys = list(acknowledged)
    header, body = await reader.ok("mget", keys=keys, timeout=5)
    values = body
    pos = 0
    for key, size in zip(keys, header["sizes"], strict=True):
        assert values[pos : pos + size] == acknowledged[key], key
        pos += size
    assert (await reader.ok("get", key="total"))[1] == b"480"
    for n in range(8):
        assert (await reader.ok("get", key=f"log{n}"))[1] == b"%d," % n * 60
    assert (await reader.ok("check", keys=["w0-0"]))[0]["value"] is False
    assert (await reader.ok("mget", keys=["ma", "mb"]))[1] == b"ABB"

    # Rank 0 resumes its session and hears that the coordinator restarted (after its first
    # request); a made-up session is refused.
    resumed = await RawClient.connect(
        again.port, job="durable", role="worker", extra={"session": sessions[0]}
    )
    await resumed.ok("hb")
    assert (await asyncio.wait_for(resumed.events.get(), 10))["ev"] == EV_RESTARTED
    stranger = await RawClient.connect(again.port, job="durable", role="worker", extra={"session": "f" * 32})
    await stranger.ok("hb")
    assert (await asyncio.wait_for(stranger.events.get(), 10))["ev"] == EV_SESSION_LOST
    [job] = (await reader.ok("status", job="durable"))[0]["jobs"]
    assert {m["rank"]: m["state"] for m in job["members"]} == {0: "alive", 1: "resuming"}
    assert again.stop(signal.SIGTERM) == 0


# ---------------------------------------------------------------- embedded, short timeouts
@pytest.mark.timeout(30)
async def test_embedded_coordinator_enforces_handshake_deadline_and_cap(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(connection_module, "EVICT_AFTER", 0.05)
    async with Coordinator(
        "127.0.0.1", 0, token=TOKEN, handshake_timeout=0.5, max_pending_handshakes=20
    ) as c:
        assert c.port != 0 and c.address == f"127.0.0.1:{c.port}"
        stalled = [await asyncio.open_connection("127.0.0.1", c.port) for _ in range(20)]
        await asyncio.sleep(0.3)  # silent for longer than EVICT_AFTER: they may be evicted
        stalled += [await asyncio.open_connection("127.0.0.1", c.port) for _ in range(5)]
        # Each newcomer past the cap closed one of the oldest; the rest go at the deadline.
        started = time.monotonic()
        await asyncio.gather(*(wait_closed_by_server(r) for r, _ in stalled))
        assert time.monotonic() - started < 5
        assert 'protocol_errors_total{reason="handshake_overflow"} 5.0' in c.metrics.render()[0].decode()
        client = await RawClient.connect(c.port)
        await client.ok("set", b"still", key="serving")
        for _, w in stalled:
            w.close()
        await client.close()
    assert "handshake not finished" in caplog.text and "still in their handshake" in caplog.text


@pytest.mark.timeout(30)
async def test_a_herd_past_the_handshake_cap_loses_newcomers_not_the_handshakes_under_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The oldest connections in their handshake are young (a herd, not connections left
    # hanging): each newcomer past the cap is closed at once (its client would retry), and none
    # of the handshakes under way is thrown away.
    monkeypatch.setattr(connection_module, "EVICT_AFTER", 30.0)
    async with Coordinator("127.0.0.1", 0, token=TOKEN, handshake_timeout=60, max_pending_handshakes=20) as c:
        herd = [await asyncio.open_connection("127.0.0.1", c.port) for _ in range(25)]
        await asyncio.gather(*(wait_closed_by_server(r) for r, _ in herd[20:]))
        rendered = c.metrics.render()[0].decode()
        assert 'refused_connections_total{reason="handshakes_queued"} 5.0' in rendered
        assert "handshake_overflow" not in rendered
        # The first twenty are still there; once they are gone, a new client gets in.
        assert all(not r.at_eof() for r, _ in herd[:20])
        for _, w in herd:
            w.close()
        for _ in range(1000):  # until the coordinator sees them go (10 s at most)
            if not c._handshaking:
                break
            await asyncio.sleep(0.01)
        client = await RawClient.connect(c.port)
        await client.ok("set", b"in", key="after the herd")
        await client.close()


@pytest.mark.timeout(30)
async def test_sessions_of_a_round_of_many_connections_keep_the_beat_interval_its_replies_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two connections against a rate of one beat a second: each session, the one that joined a
    # host's ranks and the one that joined one rank, beats every 2 s instead of every second.
    from aiocoll.client.control.session import CoordinatorSession
    from aiocoll.server import _rendezvous

    monkeypatch.setattr(_rendezvous, "BEATS_PER_SECOND", 1)
    async with Coordinator("127.0.0.1", 0, token=TOKEN) as c:
        a, b = [
            await CoordinatorSession.connect("127.0.0.1", c.port, token=TOKEN, job="beats", timeout=10)
            for _ in range(2)
        ]
        await asyncio.gather(
            a.join_host([0, 1], 3, [[("127.0.0.1", 9000)], [("127.0.0.1", 9001)]], "h0"),
            b.join(2, 3, [("127.0.0.1", 9002)], "h1"),
        )
        assert a._beat_interval == b._beat_interval == 2.0
        beats = b.start_beats(lambda full: None)  # the beat thread keeps the same pace
        assert beats._interval == 2.0
        for session in (a, b):
            await session.aclose()


@pytest.mark.timeout(30)
async def test_embedded_coordinator_declares_silent_member_lost() -> None:
    async with Coordinator("127.0.0.1", 0, token=TOKEN, heartbeat_timeout=1.0) as c:
        a = await RawClient.connect(c.port, job="hb", role="worker")
        b = await RawClient.connect(c.port, job="hb", role="worker")
        ja = a.send("join", rank=0, world_size=2, addrs=[], host="a", timeout=5)
        jb = b.send("join", rank=1, world_size=2, addrs=[], host="b", timeout=5)
        await asyncio.wait_for(asyncio.gather(ja, jb), 10)
        for _ in range(12):  # a heartbeats, b stays silent
            await a.ok("hb")
            await asyncio.sleep(0.25)
            if not a.events.empty():
                break
        event = a.events.get_nowait()
        assert event["ev"] == EV_MEMBER_LOST and event["rank"] == 1 and "silent" in event["reason"]
        await asyncio.wait_for(asyncio.shield(b.closed), 5)  # the silent session is closed too
        await a.close()


@pytest.mark.timeout(30)
async def test_embedded_restart_on_state_dir_resumes_sessions_and_loses_the_absent(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    async with Coordinator("127.0.0.1", 0, token=TOKEN, state_dir=state) as c:
        ws = [await RawClient.connect(c.port, job="g", role="worker") for _ in range(3)]
        joins = [
            w.send("join", rank=i, world_size=3, addrs=[], host=str(i), timeout=5) for i, w in enumerate(ws)
        ]
        sessions = [(await asyncio.wait_for(j, 10))[0]["session"] for j in joins]
        await ws[0].ok("set", b"kept", key="k")
    async with Coordinator("127.0.0.1", 0, token=TOKEN, state_dir=state, resume_grace=0.5) as c:
        r0 = await RawClient.connect(c.port, job="g", role="worker", extra={"session": sessions[0]})
        assert (await r0.ok("get", key="k"))[1] == b"kept"
        assert (await asyncio.wait_for(r0.events.get(), 5))["ev"] == EV_RESTARTED
        # Losses found together are told in one event that names every rank.
        lost_event = await asyncio.wait_for(r0.events.get(), 5)
        assert lost_event["ev"] == EV_MEMBER_LOST and set(lost_event["ranks"]) == {1, 2}
        assert lost_event["count"] == 2 and lost_event["rank"] in (1, 2)
        assert r0.events.empty()
        # The broken round lets a new generation join the same job.
        fresh = [await RawClient.connect(c.port, job="g", role="worker") for _ in range(2)]
        replies = await asyncio.wait_for(
            asyncio.gather(
                *(f.send("join", rank=None, world_size=2, addrs=[], host="n", timeout=5) for f in fresh)
            ),
            10,
        )
        assert {r[0]["round"] for r in replies} == {1}


@pytest.mark.timeout(30)
async def test_snapshots_taken_while_serving_keep_journal_and_snapshot_consistent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiocoll.server import CoordinatorState
    from aiocoll.server._journal import Journal

    # Snapshot after every group commit, so snapshots race with concurrent mutations.
    monkeypatch.setattr(Journal, "snapshot_due", lambda self: True)
    state = str(tmp_path / "state")
    async with Coordinator("127.0.0.1", 0, token=TOKEN, state_dir=state) as c:
        clients = await asyncio.gather(*(RawClient.connect(c.port, job="snap") for _ in range(6)))

        async def work(cl: RawClient, n: int) -> None:
            for i in range(40):
                await cl.ok("append", b"%d." % i, key=f"log{n}")
                await cl.ok("add", key="count", amount=1)

        await asyncio.gather(*(work(cl, n) for n, cl in enumerate(clients)))
        # Read the directory while the coordinator still runs: what a kill -9 now would leave.
        # A kill freezes both files at one instant; reading them one after the other does not,
        # so a read that a snapshot's installation (still running after the last reply: one
        # follows every commit here) overtook between the two files is taken again.
        snapshot_file = tmp_path / "state" / "snapshot"

        def snapshot_identity() -> tuple[int, int] | None:
            try:
                st = snapshot_file.stat()
            except FileNotFoundError:
                return None
            return st.st_ino, st.st_mtime_ns

        for _ in range(200):
            before = snapshot_identity()
            reader = Journal(state)
            snap, records = reader.load()
            reader.close()
            if snapshot_identity() == before:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the snapshot kept changing for 2 s after the last reply")
        recovered = CoordinatorState(clock=time.monotonic)
        recovered.restore(snap, records)
        kv = recovered.jobs["snap"].kv
        assert kv["count"] == b"240"
        expected = b"".join(b"%d." % i for i in range(40))
        assert all(kv[f"log{n}"] == expected for n in range(6))
        assert (tmp_path / "state" / "snapshot").is_file()


@pytest.mark.timeout(30)
async def test_client_that_never_reads_its_replies_is_closed_and_others_are_served(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import aiocoll.server._connection as shell

    monkeypatch.setattr(shell, "WRITE_STALL_TIMEOUT", 0.5)
    async with Coordinator("127.0.0.1", 0, token=TOKEN) as c:
        good = await RawClient.connect(c.port)
        await good.ok("set", b"z" * (1 << 20), key="big")
        # A client that pipelines 150 gets of 1 MiB and never reads a byte of the replies: fewer
        # bytes than the bound on replies waiting for a client (c.max_output_bytes), so it is the
        # stall timeout that closes it, however late a loaded machine runs the timer.
        assert 150 * (1 << 20) < c.max_output_bytes
        reader, writer = await asyncio.open_connection("127.0.0.1", c.port)
        hs = ClientHandshake(TOKEN, role="store", job="job")
        writer.write(hs.start())
        while not hs.done:
            writer.write(hs.receive_data(await reader.read(4096)))
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        writer.transport.pause_reading()
        for i in range(150):
            writer.write(request_frames("get", i + 1, key="big")[0])
        # Everyone else is served meanwhile.
        for _ in range(10):
            assert (await good.ok("get", key="big"))[1][:1] == b"z"
            await asyncio.sleep(0.1)
        for _ in range(200):  # up to 10 s: the stall timeout is 0.5 s
            if "has not read its replies" in caplog.text:
                break
            await asyncio.sleep(0.05)
        assert "has not read its replies" in caplog.text
        writer.close()
        await good.close()


@pytest.mark.timeout(40)
async def test_second_sigterm_exits_at_once_while_a_drain_is_stuck(
    tmp_path: Path, spawned: list[CoordinatorProcess]
) -> None:
    coord = _coordinator(tmp_path)
    spawned.append(coord)
    good = await RawClient.connect(coord.port)
    await good.ok("set", b"z" * (1 << 20), key="big")
    # A client that asks for 100 MiB of replies and reads none: the drain cannot flush them. Fewer
    # than the coordinator's bound on a connection's unread replies (2 * max_payload + 64 MiB):
    # past it the connection is closed, and then nothing holds the drain up. How many requests one
    # read takes depends on the machine's load, so all of them must fit under that bound.
    reader, writer = await asyncio.open_connection("127.0.0.1", coord.port)
    hs = ClientHandshake(TOKEN, role="store", job="job")
    writer.write(hs.start())
    while not hs.done:
        writer.write(hs.receive_data(await asyncio.wait_for(reader.read(4096), 10)))
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    writer.transport.pause_reading()
    for i in range(100):
        writer.write(request_frames("get", i + 1, key="big")[0])
    await writer.drain()
    await good.ok("get", key="big")  # the coordinator has read the pipelined requests by now

    coord.proc.send_signal(signal.SIGTERM)
    await wait_for_log(coord, "draining")
    await asyncio.sleep(0.5)
    assert coord.proc.poll() is None  # still draining: the stuck client holds it up to 5 s
    started = time.monotonic()
    coord.proc.send_signal(signal.SIGTERM)
    status = await asyncio.to_thread(coord.proc.wait, 10)
    assert status == 128 + signal.SIGTERM
    assert time.monotonic() - started < 3  # at once, not after the drain deadline
    assert "second signal (SIGTERM): exiting at once" in coord.log()
    writer.close()
    await good.close()
