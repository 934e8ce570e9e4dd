"""The coordinator's exactly-once part: what it remembers of each client (hello ``cid``) of each job,
so that a numbered mutation (``rid``) sent again after a reconnect or a restart is answered with
its first reply instead of being carried out twice. Sans-IO; imports _model and aiocoll
foundations only.

A numbered mutation's journal records are wrapped, with its reply, in one ``req`` record, so a
crash can never keep the mutation but lose the memory of it (docs/COORDINATOR.md,
"Exactly-once mutations").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiocoll.protocol._coordinator import CID_BYTES, DEDUPE_WINDOW, ERR_INVALID

from ._model import Conn, Effects, Job, Record, Refused

__all__ = ["CLIENT_SWEEP_INTERVAL", "Client", "Dedupe"]

log = logging.getLogger("aiocoll.server")

# Forgotten clients' memory is looked for this often (it holds no deadline anyone waits on).
CLIENT_SWEEP_INTERVAL = 30.0


class Client:
    """What the coordinator remembers of one client of one job: the replies of its numbered
    mutations above ``floor`` (its latest ack), so that re-sent ones are not applied twice."""

    __slots__ = ("attached", "floor", "last_seen", "replies")

    def __init__(self, floor: int, now: float) -> None:
        self.floor = floor
        self.replies: dict[int, tuple[Any, bytes]] = {}
        self.attached = 0  # open connections that carry this cid
        self.last_seen = now

    def forget_through(self, ack: int) -> None:
        """Drop replies the client has confirmed receiving (rid <= ack)."""
        if ack <= self.floor:
            return
        self.floor = ack
        replies = self.replies
        # Rids mostly arrive in order, so the oldest entries come first; a re-sent one that came
        # late is found by the full scan, done only when the window fills.
        while replies:
            rid = next(iter(replies))
            if rid > ack:
                break
            del replies[rid]
        if len(replies) >= DEDUPE_WINDOW:
            for rid in [r for r in replies if r <= ack]:
                del replies[rid]


class Dedupe:
    """The clients of every job, and the check every numbered mutation passes through.

    Args:
        fx: where decisions go. client_ttl: seconds a client's memory is kept once it has no
            connection.
    """

    def __init__(self, fx: Effects, *, client_ttl: float) -> None:
        self.fx = fx
        self.client_ttl = client_ttl
        self.resends_answered = 0  # re-sent mutations answered from memory (for tests and logs)
        self._next_sweep = fx.clock() + CLIENT_SWEEP_INTERVAL

    def attach(self, conn: Conn, cid: object, now: float) -> None:
        """A connection carrying client id ``cid`` (CID_BYTES bytes; anything else is ignored)."""
        if type(cid) is not bytes or len(cid) != CID_BYTES:
            return
        conn.cid = cid
        clients = conn.job.clients
        client = clients.get(cid)
        if client is None:
            client = clients[cid] = Client(0, now)
        client.attached += 1
        client.last_seen = now

    def detach(self, conn: Conn, now: float) -> None:
        if conn.cid is not None:
            client = conn.job.clients.get(conn.cid)
            if client is not None:
                client.attached -= 1
                client.last_seen = now

    def check(
        self,
        conn: Conn,
        req_id: int,
        op: str,
        rid: object,
        ack: object,
        answer: Callable[[dict[str, Any], bytes], None],
    ) -> Client | None:
        """Check a numbered mutation. A re-sent one is answered from memory through
        ``answer(header, payload)`` and None is returned; otherwise its client's record, ready
        for ``remember``.

        Raises:
            Refused: no client id, malformed numbers, or a number outside the window.
        """
        if conn.cid is None:
            raise Refused(ERR_INVALID, "'rid' needs a client id: send 'cid' in the hello")
        if type(rid) is not int or type(ack) is not int or not 0 <= ack < rid:
            raise Refused(
                ERR_INVALID, f"'rid' and 'ack' must be integers with 0 <= ack < rid, got {rid!r}, {ack!r}"
            )
        job = conn.job
        client: Client = job.clients[conn.cid]  # made by attach(), kept while a connection carries it
        client.last_seen = self.fx.started
        stored = client.replies.get(rid)
        if stored is not None:
            client.forget_through(ack)
            header, payload = stored
            self.resends_answered += 1
            log.info(
                "job=%s event=resent_request_answered op=%s rid=%d peer=%s", job.name, op, rid, conn.peer
            )
            answer(header, payload)
            return None
        if rid <= client.floor:
            raise Refused(
                ERR_INVALID,
                f"request number {rid} of this client was already acknowledged (ack {client.floor}); "
                f"a client must not re-send a request it had the reply to",
            )
        if rid - max(ack, client.floor) > DEDUPE_WINDOW:
            raise Refused(
                ERR_INVALID,
                f"request number {rid} is more than {DEDUPE_WINDOW} beyond the client's acknowledged "
                f"{max(ack, client.floor)}: a client may have at most {DEDUPE_WINDOW} mutations awaiting "
                f"their reply",
            )
        client.forget_through(ack)
        return client

    def remember(self, conn: Conn, client: Client, req_id: int, rid: int, n: int, j: int) -> None:
        """Keep the reply of numbered mutation ``rid`` (the outbox's frames from ``n`` on hold
        it) and wrap its journal records (from ``j`` on) into one ``req`` record."""
        fx = self.fx
        outbox = fx.outbox
        # The reply is normally the last frame; replies to waiters the mutation woke come before it.
        i = len(outbox) - 1
        while i >= n:
            c, h, p = outbox[i]
            if c == conn.id and type(h) is dict and h.get("id") == req_id:
                break
            i -= 1
        else:
            return  # mutations answer at once, so this does not happen; nothing to remember then
        if h.get("ok") is not True:
            return
        body = p if type(p) is bytes else bytes(p)
        if not fx.durable:
            # Kept as sent, "id" included (the hot path: no copy); a re-sent request is answered
            # with the id replaced, and nothing else reads it.
            client.replies[rid] = (h, body)
            return
        kept = dict(h)
        del kept["id"]
        client.replies[rid] = (kept, body)
        records = fx.journal[j:]
        del fx.journal[j:]
        assert conn.cid is not None
        fx.journal.append(["req", conn.job.name, conn.cid, rid, client.floor, kept, body, records])

    def sweep(self, jobs: dict[str, Job], now: float) -> None:
        """Drop the memory of clients that have had no connection for ``client_ttl``."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + CLIENT_SWEEP_INTERVAL
        ttl = self.client_ttl
        for job in jobs.values():
            gone = [c for c, cl in job.clients.items() if cl.attached <= 0 and now - cl.last_seen > ttl]
            for cid in gone:
                del job.clients[cid]

    # -- persistence
    @staticmethod
    def snapshot(job: Job) -> list[Any]:
        return [
            [cid, c.floor, [[rid, h, p] for rid, (h, p) in c.replies.items()]]
            for cid, c in job.clients.items()
            if c.replies
        ]

    @staticmethod
    def restore(job: Job, clients: list[Any], now: float) -> None:
        for cid, floor, replies in clients:
            client = job.clients[cid] = Client(floor, now)
            for rid, header, payload in replies:
                client.replies[rid] = (header, payload)

    @staticmethod
    def apply(job: Job, rec: Record, now: float, apply_record: Callable[[Record], None]) -> None:
        """Replay a ``req`` record: its mutation's own records, then the memory of its reply."""
        _, _, cid, rid, ack, header, payload, records = rec
        for sub in records:
            apply_record(sub)
        client = job.clients.get(cid)
        if client is None:
            client = job.clients[cid] = Client(0, now)
        client.forget_through(ack)
        client.replies[rid] = (header, payload)
