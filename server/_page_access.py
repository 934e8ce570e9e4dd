"""Who may see the coordinator's jobs over HTTP (the page at ``/`` and ``/jobs``).

Without a token, everyone who can reach the HTTP port: the page says so. With one, a client
proves it holds the token without ever sending it: ``GET /auth`` gives a fresh single-use nonce,
the client answers ``GET /auth?nonce=N&proof=P`` with P = hex HMAC-SHA256(token, PROOF_LABEL +
N) and gets a session value, short-lived (SESSION_SECONDS), that ``/jobs`` requires as
``Authorization: Bearer VALUE``. The page computes the proof in its own JavaScript (page/hmac.js;
the browser's crypto.subtle exists only on https or localhost). The label keeps these proofs
apart from the coordinator protocol's handshake proofs, which HMAC other messages with the
same token, so neither can stand in for the other.

A bearer value rather than a cookie: cookies are shared by every port of a host, so another
service on the coordinator's machine would receive a cookie; the page keeps the value in its own
tab (sessionStorage, which is per origin, port included). Nonces and sessions are bounded in
number (the oldest go first), so a flood of /auth requests costs fixed memory.

Sans-IO: time comes from an injected clock. Imports the protocol's token encoding and the
standard library only.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
from collections.abc import Callable

from aiocoll.protocol._handshake import token_bytes

__all__ = ["NONCE_SECONDS", "PROOF_LABEL", "SESSION_SECONDS", "PageAccess", "page_proof"]

PROOF_LABEL = b"aiocoll page|"
NONCE_SECONDS = 30.0  # how long a nonce may be answered
SESSION_SECONDS = 600.0  # how long a session value opens /jobs (the page proves again after)
MAX_NONCES = 256  # nonces not yet answered; beyond, the oldest is forgotten
MAX_SESSIONS = 256  # sessions alive; beyond, the oldest ends


def page_proof(token: str | bytes | None, nonce: str) -> str:
    """The proof that answers ``nonce``: hex HMAC-SHA256(token, PROOF_LABEL + nonce)."""
    return hmac.new(token_bytes(token), PROOF_LABEL + nonce.encode("utf-8"), hashlib.sha256).hexdigest()


class PageAccess:
    """The nonces handed out and the sessions granted by one coordinator's HTTP port.

    Args:
        token: the coordinator's token; None or empty: no token, everything is open.
        clock: monotonic seconds.
    """

    def __init__(self, token: str | bytes | None, clock: Callable[[], float]) -> None:
        self._key = token_bytes(token)
        self._clock = clock
        self._nonces: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._sessions: collections.OrderedDict[str, float] = collections.OrderedDict()

    @property
    def open(self) -> bool:
        """True when the coordinator has no token: everyone may look."""
        return not self._key

    def challenge(self) -> str:
        """A fresh nonce, answerable once within NONCE_SECONDS."""
        nonce = secrets.token_hex(16)
        _put(self._nonces, nonce, self._clock(), NONCE_SECONDS, MAX_NONCES)
        return nonce

    def answer(self, nonce: str, proof: str) -> str | None:
        """Check ``proof`` for ``nonce`` (which is used up either way); a new session value when
        it holds, None when the nonce is unknown or expired or the proof is wrong."""
        now = self._clock()
        expires = self._nonces.pop(nonce, None)
        if expires is None or expires < now or not self._key:
            return None
        expected = hmac.new(self._key, PROOF_LABEL + nonce.encode("utf-8"), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), proof.lower().encode("utf-8", "replace")):
            return None
        session = secrets.token_urlsafe(32)
        _put(self._sessions, session, now, SESSION_SECONDS, MAX_SESSIONS)
        return session

    def admits(self, authorization: str | None) -> bool:
        """Whether a request with this Authorization header may see the jobs."""
        if self.open:
            return True
        scheme, _, value = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not value:
            return False
        expires = self._sessions.get(value.strip())
        if expires is None:
            return False
        if expires < self._clock():
            del self._sessions[value.strip()]
            return False
        return True


def _put(
    entries: collections.OrderedDict[str, float], key: str, now: float, lifetime: float, most: int
) -> None:
    """Add ``key``, valid for ``lifetime`` from ``now``, after dropping the entries whose time ran
    out (all have the same lifetime, so they are in order of expiry); beyond ``most`` entries,
    the oldest go."""
    while entries:
        first, expires = next(iter(entries.items()))
        if expires >= now:
            break
        del entries[first]
    entries[key] = now + lifetime
    while len(entries) > most:
        entries.popitem(last=False)
