"""Who may see the coordinator's jobs over HTTP (server/_page_access.py): the challenge-response
with a fake clock, then the routes of a real embedded coordinator over loopback (the page's
files, /auth, /jobs, and /healthz and /metrics left open and naming no job)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiocoll.server import Coordinator
from aiocoll.server._page_access import (
    MAX_NONCES,
    NONCE_SECONDS,
    SESSION_SECONDS,
    PageAccess,
    page_proof,
)

from aiocoll._palette import ROLES

pytestmark = pytest.mark.timeout(30)

TOKEN = "page-access-token"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_proof_is_hmac_sha256_of_the_label_and_nonce_keyed_by_the_token() -> None:
    expected = hmac.new(TOKEN.encode(), b"aiocoll page|abc", hashlib.sha256).hexdigest()
    assert page_proof(TOKEN, "abc") == expected
    # The protocol handshake's proofs HMAC "server|..." and "client|...": never this message.
    assert page_proof(TOKEN, "abc") != hmac.new(TOKEN.encode(), b"abc", hashlib.sha256).hexdigest()


def test_a_right_proof_gives_a_session_that_opens_the_jobs_until_it_expires() -> None:
    clock = Clock()
    access = PageAccess(TOKEN, clock)
    assert not access.open
    assert not access.admits(None) and not access.admits("Bearer nothing")
    nonce = access.challenge()
    session = access.answer(nonce, page_proof(TOKEN, nonce).upper())  # hex in either case
    assert session is not None
    assert access.admits(f"Bearer {session}") and access.admits(f"bearer  {session} ")
    assert not access.admits(session) and not access.admits(f"Basic {session}")
    clock.now += SESSION_SECONDS + 1
    assert not access.admits(f"Bearer {session}")


def test_a_wrong_proof_a_reused_nonce_and_an_old_nonce_are_refused() -> None:
    clock = Clock()
    access = PageAccess(TOKEN, clock)
    nonce = access.challenge()
    assert access.answer(nonce, page_proof("not-the-token", nonce)) is None
    assert access.answer(nonce, page_proof(TOKEN, nonce)) is None  # used up by the wrong try
    again = access.challenge()
    assert access.answer(again, page_proof(TOKEN, again)) is not None
    assert access.answer(again, page_proof(TOKEN, again)) is None  # once only
    late = access.challenge()
    clock.now += NONCE_SECONDS + 1
    assert access.answer(late, page_proof(TOKEN, late)) is None
    assert access.answer("made-up", page_proof(TOKEN, "made-up")) is None
    assert access.answer(access.challenge(), "not hex \u00e9") is None


def test_nonces_are_bounded_the_oldest_going_first() -> None:
    access = PageAccess(TOKEN, Clock())
    first = access.challenge()
    for _ in range(MAX_NONCES):
        access.challenge()
    assert access.answer(first, page_proof(TOKEN, first)) is None
    last = access.challenge()
    assert access.answer(last, page_proof(TOKEN, last)) is not None


def test_without_a_token_everyone_may_look_and_no_session_is_given() -> None:
    for token in (None, "", b""):
        access = PageAccess(token, Clock())
        assert access.open and access.admits(None)
        nonce = access.challenge()
        assert access.answer(nonce, page_proof(token, nonce)) is None


# -- the routes of an embedded coordinator ---------------------------------------------------


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


async def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], Any]:
    status, head, body = await asyncio.to_thread(_get, port, path, headers)
    return status, head, json.loads(body) if head.get("Content-Type") == "application/json" else body


async def session_for(port: int, token: str) -> str | None:
    """What the page does: answer /auth's nonce with the proof."""
    _, _, challenge = await get(port, "/auth")
    nonce = challenge["nonce"]
    status, _, answer = await get(port, f"/auth?nonce={nonce}&proof={page_proof(token, nonce)}")
    return answer["session"] if status == 200 else None


@pytest.fixture
async def coordinator() -> AsyncIterator[Coordinator]:
    async with Coordinator("127.0.0.1", 0, token=TOKEN, http_port=0) as coord:
        coord.state.connect(1, "secret-job-name", "store", peer="127.0.0.1:1")  # a job to hide
        yield coord


async def test_jobs_show_nothing_until_the_client_proves_it_holds_the_token(coordinator: Coordinator) -> None:
    port = coordinator.http_port
    status, head, body = await get(port, "/jobs")
    assert status == 401 and "secret-job-name" not in json.dumps(body)
    assert head["WWW-Authenticate"].startswith("Bearer") and "/auth" in body["error"]
    status, _, _ = await get(port, "/jobs", {"Authorization": "Bearer forged"})
    assert status == 401
    assert await session_for(port, "wrong-token") is None
    session = await session_for(port, TOKEN)
    assert session is not None
    status, _, body = await get(port, "/jobs", {"Authorization": f"Bearer {session}"})
    assert status == 200 and body["token"] is True
    assert [job["job"] for job in body["jobs"]] == ["secret-job-name"]
    assert body["jobs"][0]["events"] == []


async def test_healthz_and_metrics_stay_open_and_name_no_job(coordinator: Coordinator) -> None:
    port = coordinator.http_port
    await session_for(port, "wrong-token")  # counted with the protocol's authentication failures
    status, _, body = await get(port, "/healthz")
    assert status == 200 and body == b"ok\n"
    status, _, body = await get(port, "/metrics")
    assert status == 200 and b"secret-job-name" not in body
    assert b"aiocoll_coordinator_auth_failures_total 1.0" in body


async def test_the_page_is_served_with_its_own_files_a_strict_policy_and_the_palette(
    coordinator: Coordinator,
) -> None:
    port = coordinator.http_port
    status, head, body = await get(port, "/")
    assert status == 200 and head["Content-Type"].startswith("text/html")
    policy = head["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert head["Referrer-Policy"] == "no-referrer"
    for name in (b"page.css", b"page.js", b"hmac.js"):
        assert name in body
        assert b"http://" not in body and b"https://" not in body  # nothing from elsewhere
    status, head, css = await get(port, "/page.css")
    assert status == 200 and head["Content-Type"].startswith("text/css")
    assert f"--lost: {ROLES['lost']};".encode() in css
    for script in ("/page.js", "/hmac.js"):
        status, head, js = await get(port, script)
        assert status == 200 and head["Content-Type"].startswith("text/javascript")
        assert b"http://" not in js and b"https://" not in js and b"innerHTML" not in js


async def test_without_a_token_the_jobs_are_open_and_say_so() -> None:
    async with Coordinator("127.0.0.1", 0, http_port=0) as coord:
        coord.state.connect(1, "open-job", "store", peer="127.0.0.1:1")
        status, _, body = await get(coord.http_port, "/jobs")
        assert status == 200 and body["token"] is False and body["jobs"][0]["job"] == "open-job"
        status, _, body = await get(coord.http_port, "/auth")
        assert status == 200 and body == {"token": False}
