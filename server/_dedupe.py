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

__all__ = ["CLIENT_SWEEP_INTERVAL", "AlreadyAnswered", "Client", "Dedupe"]

log = logging.getLogger("aiocoll.server")

# Forgotten clients' memory is looked for this often (it holds no deadline anyone waits on).
CLIENT_SWEEP_INTERVAL = 30.0


class AlreadyAnswered(Exception):
    """A numbered mutation sent again: it was carried out, and this is what it answered."""

    def __init__(self, value: Any, payload: bytes | bytearray) -> None:
        super().__init__("already answered")
        self.value = value
        self.payload = payload


class Client:
    """What the coordinator remembers of one client of one job: the replies of its numbered
    mutations above ``floor`` (its latest ack), so that re-sent ones are not applied twice."""

    __slots__ = ("attached", "floor", "last_seen", "replies")

    def __init__(self, floor: int, now: float) -> None:
        self.floor = floor
        # rid -> (the reply's value or None, its payload): what protocol._store's reply carries.
        self.replies: dict[int, tuple[Any, bytes | bytearray]] = {}
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
        conn.client = client
        client.attached += 1
        client.last_seen = now

    def detach(self, conn: Conn, now: float) -> None:
        if conn.cid is not None:
            client = conn.job.clients.get(conn.cid)
            if client is not None:
                client.attached -= 1
                client.last_seen = now

    def check(self, conn: Conn, op: str, rid: int, ack: object) -> Client:
        """Check numbered mutation ``rid`` of a connection that carries a client id; returns its
        client's record, ready for ``remember``.

        Raises:
            AlreadyAnswered: it was carried out before (a re-send); the exception holds the answer.
            Refused: a malformed ``ack``, or a number outside the window.
        """
        if type(ack) is not int or not 0 <= ack < rid:
            raise Refused(
                ERR_INVALID, f"'rid' and 'ack' must be integers with 0 <= ack < rid, got {rid!r}, {ack!r}"
            )
        # attach() set it: kept while a connection carries it. Its ``last_seen`` is what
        # detach() wrote: only a client with no connection is ever swept.
        client: Client = conn.client
        replies = client.replies
        if rid in replies:
            client.forget_through(ack)
            self.resends_answered += 1
            log.info(
                "job=%s event=resent_request_answered op=%s rid=%d peer=%s", conn.job.name, op, rid, conn.peer
            )
            raise AlreadyAnswered(*replies[rid])
        floor = client.floor
        if rid <= floor:
            raise Refused(
                ERR_INVALID,
                f"request number {rid} of this client was already acknowledged (ack {floor}); "
                f"a client must not re-send a request it had the reply to",
            )
        if ack > floor:  # the client has more replies: forget them
            if len(replies) == 1 and ack in replies:
                # The common case, one mutation awaited at a time: the reply it acknowledges is
                # the only one kept (forget_through, without its call and scan).
                client.floor = floor = ack
                replies.clear()
            else:
                client.forget_through(ack)
                floor = ack
        if rid - floor > DEDUPE_WINDOW:
            raise Refused(
                ERR_INVALID,
                f"request number {rid} is more than {DEDUPE_WINDOW} beyond the client's acknowledged "
                f"{floor}: a client may have at most {DEDUPE_WINDOW} mutations awaiting their reply",
            )
        return client

    def remember(
        self, conn: Conn, client: Client, rid: int, value: Any, payload: bytes | bytearray, j: int
    ) -> None:
        """Keep the answer of numbered mutation ``rid`` and, when durable, wrap its journal
        records (from index ``j`` on) into one ``req`` record with it."""
        client.replies[rid] = (value, payload)
        fx = self.fx
        if not fx.durable:
            return
        records = fx.journal[j:]
        del fx.journal[j:]
        assert conn.cid is not None
        fx.journal.append(
            ["req", conn.job.name, conn.cid, rid, client.floor, _reply_map(value), bytes(payload), records]
        )

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
            [cid, c.floor, [[rid, _reply_map(v), bytes(p)] for rid, (v, p) in c.replies.items()]]
            for cid, c in job.clients.items()
            if c.replies
        ]

    @staticmethod
    def restore(job: Job, clients: list[Any], now: float) -> None:
        for cid, floor, replies in clients:
            client = job.clients[cid] = Client(floor, now)
            for rid, header, payload in replies:
                client.replies[rid] = (header.get("value"), payload)

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
        client.replies[rid] = (header.get("value"), payload)


def _reply_map(value: Any) -> dict[str, Any]:
    """A kept reply as the journal and snapshots write it (the form they have always had)."""
    return {"ok": True} if value is None else {"ok": True, "value": value}
