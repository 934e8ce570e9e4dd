"""Probe a running aiocoll coordinator the way a user of the container image would.

Run by scripts/check_container.sh *inside* the image (with the image's own Python and its
installed aiocoll), in the network namespace where the image's default command is serving.
Checks: the handshake with the right token and a set/get/add round trip; a wrong token refused
(by the client's check of the coordinator's proof, and by the coordinator for a forged proof);
a job of two ranks (two processes of the image's own aiocoll) rendezvousing through the
coordinator and all-reducing; /healthz, /metrics and /jobs over HTTP (/jobs after proving the
token as the web page does: docs/COORDINATOR.md); `aiocoll status` from the image. Prints one
PASS/FAIL line per check and exits 1 if any failed. Standard library and aiocoll only (the ranks
use numpy, which the image installs).

    python _container_probe.py --port 29500 --http-port 29501 --token SECRET
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import os
import subprocess
import sys
import urllib.request
from typing import Any

from aiocoll._errors import AuthenticationError
from aiocoll.protocol import (
    HANDSHAKE_MAX_HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ClientHandshake,
    FrameDecoder,
    encode_frame,
    encode_header,
    pack_prefix,
)
from aiocoll.protocol._coordinator import ROLE_STORE
from aiocoll.testing.store_frames import as_map, request_frames

HOST = "127.0.0.1"
JOB = "container-check"
failures: list[str] = []


def report(ok: bool, what: str, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {what}" + (f"  ({detail})" if detail else ""), flush=True)
    if not ok:
        failures.append(what)


async def connect(port: int, token: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10)
    handshake = ClientHandshake(token, role=ROLE_STORE, job=JOB)
    writer.write(handshake.start())
    while not handshake.done:
        data = await asyncio.wait_for(reader.read(65536), 10)
        if not data:
            writer.close()
            raise ConnectionError("closed during the handshake")
        try:
            writer.write(handshake.receive_data(data))
        except BaseException:
            writer.close()
            raise
    return reader, writer


async def store_request(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    decoder: FrameDecoder,
    op: str,
    req_id: int,
    payload: bytes = b"",
    **fields: Any,
) -> tuple[dict[str, Any], bytes]:
    """A store request in its compact form; its reply read back as a map (a set's is the SYNC's
    behind it, or its refusal)."""
    frames, sync = request_frames(op, req_id, payload, **fields)
    writer.write(frames)
    while True:
        data = await asyncio.wait_for(reader.read(65536), 10)
        if not data:
            raise ConnectionError(f"closed instead of answering {op}")
        for frame in decoder.feed(data):
            header = frame.header
            if type(header) is list and header[0] in (req_id, sync):
                if header[0] == sync:
                    return {"id": req_id, "ok": True}, b""
                return as_map(op, header), bytes(frame.payload)


async def check_store(port: int, token: str) -> None:
    try:
        reader, writer = await connect(port, token)
    except Exception as exc:
        report(False, "handshake with the container's token", repr(exc))
        return
    report(True, "handshake with the container's token")
    decoder = FrameDecoder(lists=True)
    try:
        rq = store_request
        reply, _ = await rq(reader, writer, decoder, "set", 1, b"hello", key="greeting")
        report(bool(reply.get("ok")), "set greeting=hello", str(reply))
        reply, value = await rq(reader, writer, decoder, "get", 2, key="greeting", timeout=5)
        ok = bool(reply.get("ok")) and value == b"hello"
        report(ok, "get greeting returns hello", f"{reply} {value!r}")
        reply, _ = await rq(reader, writer, decoder, "add", 3, key="n", amount=5)
        reply2, _ = await rq(reader, writer, decoder, "add", 4, key="n", amount=2)
        ok = reply.get("value") == 5 and reply2.get("value") == 7
        report(ok, "add n 5 then 2 gives 5, 7", f"{reply} {reply2}")
    except Exception as exc:
        report(False, "store round trip", repr(exc))
    finally:
        writer.close()


async def check_wrong_token(port: int) -> None:
    try:
        _, writer = await connect(port, "not-the-token")
    except AuthenticationError as exc:
        report(True, "a wrong token is refused", str(exc)[:80])
        return
    except Exception as exc:  # a plain close also keeps the intruder out
        report(True, "a wrong token is refused", f"connection closed: {exc!r}"[:80])
        return
    writer.close()
    report(False, "a wrong token is refused", "the handshake succeeded")


async def check_server_refuses_a_forged_proof(port: int) -> None:
    """A client that does not hold the token answers the challenge with a made-up proof: the
    coordinator must refuse it (and serve it nothing), whatever the client does with its own check."""
    what = "the coordinator refuses a client that cannot prove the token"
    reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 10)
    try:
        hello = encode_header(
            {"t": "hello", "v": PROTOCOL_VERSION, "role": ROLE_STORE, "job": JOB, "nonce": os.urandom(32)}
        )
        writer.write(MAGIC + pack_prefix(len(hello), 0) + hello)
        decoder = FrameDecoder(max_header=HANDSHAKE_MAX_HEADER, max_payload=0)
        kinds: list[str] = []
        while "challenge" not in kinds:
            data = await asyncio.wait_for(reader.read(65536), 10)
            if not data:
                report(False, what, "closed before sending a challenge")
                return
            kinds += [str(f.header.get("t")) for f in decoder.feed(data)]
        auth = encode_header({"t": "auth", "proof": os.urandom(32)})
        writer.write(pack_prefix(len(auth), 0) + auth)
        # Then try a request anyway: it must not be answered.
        writer.writelines(encode_frame({"op": "nkeys", "id": 1}))
        after: list[dict[str, Any]] = []
        while True:
            try:
                data = await asyncio.wait_for(reader.read(65536), 10)
            except ConnectionError:
                break
            if not data:
                break
            after += [f.header for f in decoder.feed(data)]
        welcomed = any(h.get("t") == "welcome" or "id" in h for h in after)
        report(not welcomed, what, f"then: {[h.get('t') for h in after]} and the connection closed")
    except Exception as exc:
        report(False, what, repr(exc))
    finally:
        writer.close()


def http_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    request = urllib.request.Request(f"http://{HOST}:{port}{path}", headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read()


def http_session(port: int, token: str) -> dict[str, str]:
    """The Authorization header /jobs wants from a coordinator with a token: answer /auth's nonce
    with hex HMAC-SHA256(token, "aiocoll page|" + nonce), as the web page does."""
    nonce = json.loads(http_get(port, "/auth")[2])["nonce"]
    proof = hmac.new(token.encode(), b"aiocoll page|" + nonce.encode(), hashlib.sha256).hexdigest()
    session = json.loads(http_get(port, f"/auth?nonce={nonce}&proof={proof}")[2])["session"]
    return {"Authorization": f"Bearer {session}"}


def check_http(port: int, token: str) -> None:
    for path in ("/healthz", "/metrics", "/jobs"):
        try:
            headers = http_session(port, token) if path == "/jobs" else None
            status, content_type, body = http_get(port, path, headers)
        except Exception as exc:
            report(False, f"GET {path}", repr(exc))
            continue
        detail = f"{status} {content_type}, {len(body)} bytes"
        if path == "/healthz":
            report(status == 200, "GET /healthz answers 200", detail)
        elif path == "/metrics":
            text = body.decode("utf-8", "replace")
            ok = status == 200 and "aiocoll_coordinator_operations_total" in text and 'op="set"' in text
            report(ok, "GET /metrics has aiocoll_coordinator_ operation counters", detail)
        else:
            try:
                ok = status == 200 and JOB in json.dumps(json.loads(body))
            except ValueError:
                ok = False
            report(ok, f"GET /jobs is JSON naming job {JOB!r}", detail)


# One rank of the job: joins the coordinator at tcp://HOST:PORT (it answers there, so no rank
# starts one of its own), all-reduces its rank + 1 and prints the sum.
RANK_SCRIPT = """
import asyncio, sys
import numpy as np
import aiocoll

async def main():
    pg = await aiocoll.init_process_group(sys.argv[1], rank=int(sys.argv[2]), world_size=2, timeout=60)
    x = np.full(3, pg.rank + 1.0)
    await pg.all_reduce(x)
    print("SUM", x.tolist(), pg.size, flush=True)
    await pg.destroy()

asyncio.run(main())
"""


def check_job(port: int, token: str) -> None:
    env = {**os.environ, "AIOCOLL_TOKEN": token, "AIOCOLL_JOB": "container-job"}
    url = f"tcp://{HOST}:{port}"
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, url, str(rank)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    outputs = []
    for proc in ranks:
        try:
            out, _ = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        outputs.append(out)
    ok = all(p.returncode == 0 for p in ranks) and all("SUM [3.0, 3.0, 3.0] 2" in o for o in outputs)
    report(
        ok,
        "a job of two ranks rendezvouses through the coordinator and all-reduces",
        " | ".join(o.strip().replace("\n", " / ")[-160:] for o in outputs),
    )


def check_status_cli(port: int, token: str) -> None:
    env = {**os.environ, "AIOCOLL_TOKEN": token}
    cmd = ["aiocoll", "status", "--coordinator", f"{HOST}:{port}", "--job", JOB]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
    except Exception as exc:
        report(False, "aiocoll status from the image", repr(exc))
        return
    report(
        out.returncode == 0 and JOB in out.stdout,
        "aiocoll status from the image lists the job",
        (out.stdout + out.stderr).strip().replace("\n", " | ")[:160],
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=29500)
    parser.add_argument("--http-port", type=int, default=29501)
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    asyncio.run(check_store(args.port, args.token))
    asyncio.run(check_wrong_token(args.port))
    asyncio.run(check_server_refuses_a_forged_proof(args.port))
    check_job(args.port, args.token)
    check_http(args.http_port, args.token)
    check_status_cli(args.port, args.token)
    print(f"probe: {len(failures)} check(s) failed" if failures else "probe: every check passed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
