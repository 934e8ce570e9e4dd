"""The store client without I/O (as h11 is an HTTP client without sockets): each operation's
request (its checks, its compact frame) and what its reply means, and the bookkeeping: request
ids, the mutations not yet settled, the window of exactly-once numbers, and the first failure of
a mutation that nobody waits for. Bytes and replies in, frames and results out. The async
session (session.py) and the blocking client (_blocking_store.py) are its two drivers: they own
the socket, the waiting and the reconnecting, and nothing of what a store operation means.

May import foundations only (protocol, stores, _errors).

Settling. A mutation is settled once its reply arrived, or, for the mutations the coordinator
answers only when it refuses them (SET, APPEND, MSET), once the reply to a request sent after it
on the same link did: the coordinator carries out a connection's requests in the order they
arrive (protocol._store). That is the order of sending, not of ids: after a reconnect, requests
are sent again in whatever order their callers get to it, and a read takes a new id, so the core
numbers what each link carried (``mutation``, ``request``, ``resent``, ``reconnected``: the
caller sends the frame next, before any other) and settles by that. Unsettled mutations are what
a reconnect sends again, and what ``ack`` (the id at and below which every mutation is settled)
holds back. Their number stays within DEDUPE_WINDOW: the coordinator keeps only that many
replies per client.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from typing import Any

import msgpack

from aiocoll._errors import DistError, ProtocolError, RendezvousError, StoreError, StoreTimeout
from aiocoll.protocol import PREFIX
from aiocoll.protocol._coordinator import (
    DEDUPE_WINDOW,
    ERR_INVALID,
    ERR_RENDEZVOUS,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    join_values,
    split_values,
)
from aiocoll.protocol._store import (
    ADD,
    APPEND,
    CAS,
    CHECK,
    DEL,
    ERROR,
    GET,
    MGET,
    MSET,
    MUTATIONS,
    NKEYS,
    OK,
    OP_NAMES,
    SET,
    SYNC,
    WAIT,
    encode_request,
)
from aiocoll.stores._base import Value, check_amount, check_key, check_keys, pair_values, to_value

__all__ = ["MIN_REPLY_TIME", "REPLY_GRACE", "SYNC_AFTER", "Request", "StoreCore", "Unsettled", "requests"]

log = logging.getLogger("aiocoll.client")
_pack_prefix = PREFIX.pack

# Unanswered SET/APPEND/MSET this many, a SYNC goes out to settle them: the window (DEDUPE_WINDOW)
# never fills while a client streams sets, and a reconnect has little to send again.
SYNC_AFTER = DEDUPE_WINDOW // 2


# A waiting request is answered by the coordinator when its timeout runs out; the client's own
# bound comes this much later, so that normally the coordinator's answer (naming keys) wins.
REPLY_GRACE = 5.0
# Requests that do not wait still get at least this long for their answer.
MIN_REPLY_TIME = 1.0


def _body(header: list[Any], body: bytes) -> bytes:
    return body


def _number(header: list[Any], body: bytes) -> int:
    return int(header[2])


def _truth(header: list[Any], body: bytes) -> bool:
    return bool(header[2])


def _nothing(header: list[Any], body: bytes) -> None:
    return None


class Request:
    """One store operation, checked and ready to number: its compact code, the header fields
    that follow its id (and ``ack``, for a mutation), its payload, the keys an error about it
    names, whether the coordinator holds it until keys exist (``waits``: its remaining time is
    appended), and ``result``, what a successful reply means."""

    __slots__ = ("code", "fields", "keys", "payload", "result", "waits")

    def __init__(
        self,
        code: int,
        fields: list[Any],
        payload: bytes,
        keys: Sequence[str],
        result: Any = _nothing,
        waits: bool = False,
    ) -> None:
        self.code = code
        self.fields = fields
        self.payload = payload
        self.keys = keys
        self.result = result
        self.waits = waits

    @property
    def op(self) -> str:
        return OP_NAMES[self.code]


def _multi_get_result(count: int) -> Any:
    def result(header: list[Any], body: bytes) -> list[bytes]:
        values = split_values(body, header[2] if len(header) > 2 else None)
        if len(values) != count:
            raise ProtocolError(f"the coordinator answered mget of {count} keys with {len(values)} values")
        return values

    return result


class requests:
    """Each store operation's request, its arguments checked (ValueError, TypeError name the
    key): what both drivers send. SET, APPEND and MSET expect no reply (protocol._store)."""

    @staticmethod
    def set(key: str, value: Value) -> Request:
        key = check_key(key)
        return Request(SET, [key], value if type(value) is bytes else to_value(key, value), (key,))

    @staticmethod
    def append(key: str, value: Value) -> Request:
        key = check_key(key)
        return Request(APPEND, [key], to_value(key, value), (key,))

    @staticmethod
    def multi_set(keys: Sequence[str], values: Sequence[Value]) -> Request:
        names, raw = pair_values(keys, values)
        payload, sizes = join_values(raw)
        return Request(MSET, [names, sizes], payload, names)

    @staticmethod
    def get(key: str) -> Request:
        key = check_key(key)
        return Request(GET, [key], b"", (key,), _body, True)

    @staticmethod
    def add(key: str, amount: int) -> Request:
        key = check_key(key)
        return Request(ADD, [key, check_amount(key, amount)], b"", (key,), _number)

    @staticmethod
    def compare_set(key: str, expected: Value, desired: Value) -> Request:
        key = check_key(key)
        old = to_value(key, expected, "expected value")
        new = to_value(key, desired, "desired value")
        return Request(CAS, [key, len(old)], old + new, (key,), _body)

    @staticmethod
    def wait(keys: Sequence[str]) -> Request:
        names = check_keys(keys)
        return Request(WAIT, [names], b"", names, _nothing, True)

    @staticmethod
    def check(keys: Sequence[str]) -> Request:
        names = check_keys(keys)
        return Request(CHECK, [names], b"", names, _truth)

    @staticmethod
    def delete_key(key: str) -> Request:
        key = check_key(key)
        return Request(DEL, [key], b"", (key,), _truth)

    @staticmethod
    def num_keys() -> Request:
        return Request(NKEYS, [], b"", (), _number)

    @staticmethod
    def multi_get(keys: Sequence[str]) -> Request:
        names = check_keys(keys)
        return Request(MGET, [names], b"", names, _multi_get_result(len(names)), True)

    @staticmethod
    def sync() -> Request:
        return Request(SYNC, [], b"", ())


# A mutation sent and not yet settled, as a plain tuple (one is made per set):
# (op, frame, keys, timeout, replied) — its frame is sent again after a reconnect, in order, when
# nobody awaits it (``replied`` false; someone awaiting it sends it again itself); ``keys`` and
# ``timeout`` are what an error about it names.
Unsettled = tuple[int, bytes, Sequence[str], "float | None", bool]


class StoreCore:
    """One session's ids and unsettled mutations.

    Args:
        job, address: named in error messages. numbered: the session sent a client id (its
            mutations are handled exactly once); without one, ``ack`` is still sent and ignored.
    """

    def __init__(self, job: str, address: str) -> None:
        self.job = job
        self.address = address
        self.last_id = 0
        # In id order (ids only grow): a dict keeps insertion order, so the first is the oldest.
        self.unsettled: dict[int, Unsettled] = {}
        self.no_reply_unsettled = 0
        self.sync_in_flight = 0  # the id of a SYNC sent for the window, 0 when none
        self.deferred: BaseException | None = None  # the first refusal nobody awaited
        self.pack = msgpack.Packer(use_bin_type=True).pack
        # What the current link carried, in the order it carried it: each request's place, by
        # id, and the mutations' (place, id), oldest first, until a later reply settles them.
        self._sent = 0
        self._place: dict[int, int] = {}
        self._mutations_sent: collections.deque[tuple[int, int]] = collections.deque()

    # -- numbering
    def next_id(self) -> int:
        self.last_id += 1
        return self.last_id

    def ack(self) -> int:
        """The id at and below which every mutation of this session is settled."""
        return next(iter(self.unsettled), self.last_id + 1) - 1

    def window_open(self) -> bool:
        """Whether one more mutation may be numbered (the coordinator keeps DEDUPE_WINDOW replies)."""
        unsettled = self.unsettled  # empty (one mutation awaited at a time): open
        return not unsettled or self.last_id + 1 - next(iter(unsettled)) < DEDUPE_WINDOW

    def mutation(
        self,
        op: int,
        fields: list[Any],
        payload: bytes,
        keys: Sequence[str],
        timeout: float | None,
        replied: bool,
    ) -> tuple[int, bytes]:
        """Number a mutation and encode it: returns (its id, its frame). ``fields`` are what
        follows ``ack`` in its header; ``timeout`` is what a timeout message about it quotes.
        The caller has checked ``window_open``."""
        unsettled = self.unsettled
        # The ack, before this one is numbered (as ``ack()``, without its call).
        ack = next(iter(unsettled)) - 1 if unsettled else self.last_id
        req_id = self.last_id = self.last_id + 1
        head = self.pack([op, req_id, ack, *fields])
        frame = b"".join((_pack_prefix(len(head), len(payload)), head, payload))
        unsettled[req_id] = (op, frame, keys, timeout, replied)
        if not replied:
            self.no_reply_unsettled += 1
        place = self._sent = self._sent + 1  # the caller sends it next
        self._place[req_id] = place
        self._mutations_sent.append((place, req_id))
        return req_id, frame

    def request(self, header: list[Any], payload: bytes = b"") -> tuple[int, bytes]:
        """Number a request that is not a mutation (``header`` without its id: [code, fields...])
        and encode it; the caller sends it next. Returns (its id, its frame)."""
        req_id = self.last_id = self.last_id + 1
        header.insert(1, req_id)
        if self._mutations_sent:
            # Its reply settles the mutations sent before it; with none waiting to be settled
            # its place would settle nothing (those sent later come after it), so it takes none.
            place = self._sent = self._sent + 1
            self._place[req_id] = place
        return req_id, encode_request(self.pack, header, payload)

    def encode(self, req: Request, req_id: int, seconds: float, remaining: float) -> tuple[int, bytes, float]:
        """Number ``req`` (a request that has a reply), sent next on the current link: returns
        (its id, its frame, how long to wait for its reply). ``req_id``: the number of a
        mutation sent before on a link that dropped (it keeps it), else 0. ``seconds``: the
        whole timeout it was given; ``remaining``: what is left of it."""
        code = req.code
        if code in MUTATIONS:
            if req_id:
                self.resent(req_id)
                frame = self.unsettled[req_id][1]
            else:
                req_id, frame = self.mutation(code, req.fields, req.payload, req.keys, seconds, True)
            return req_id, frame, max(remaining, MIN_REPLY_TIME)
        if req.waits:
            req_id, frame = self.request([code, *req.fields, remaining], req.payload)
            return req_id, frame, remaining + REPLY_GRACE
        req_id, frame = self.request([code, *req.fields], req.payload)
        return req_id, frame, max(remaining, MIN_REPLY_TIME)

    def outcome(self, req: Request, header: list[Any], body: bytes, seconds: float) -> Any:
        """What ``req``'s reply means: its result, or (raised) the refusal it carries."""
        if header[1] == OK:
            return req.result(header, body)
        raise self.error(req.op, header, req.keys, seconds)

    def resent(self, req_id: int) -> None:
        """An awaited mutation is sent again (on a new link) by its caller, next."""
        place = self._sent = self._sent + 1
        self._place[req_id] = place
        self._mutations_sent.append((place, req_id))

    def wants_sync(self) -> bool:
        """Whether enough unanswered mutations piled up that a SYNC should settle them."""
        return self.no_reply_unsettled >= SYNC_AFTER and not self.sync_in_flight

    def sync_frame(self) -> tuple[int, bytes]:
        """A SYNC request (its id, its frame), sent next: its reply settles everything sent
        before it."""
        return self.request([SYNC])

    # -- replies
    def settle(self, header: list[Any], payload: bytes) -> Unsettled | None:
        """A compact reply arrived: settle every mutation sent before its request on this link
        (and its request). Returns the mutation the reply is about when it was one that nobody
        awaited (its refusal is kept as ``deferred``), else None.

        Raises:
            ProtocolError: a reply header that is not [id, status, ...].
        """
        try:
            req_id, status = header[0], header[1]
        except (IndexError, TypeError):
            raise ProtocolError(f"the coordinator sent a malformed reply header {header!r:.200}") from None
        if type(req_id) is not int or (status != OK and status != ERROR):
            raise ProtocolError(f"the coordinator sent a malformed reply header {header!r:.200}")
        if req_id == self.sync_in_flight:
            self.sync_in_flight = 0
        place = self._place.pop(req_id, None)
        sent = self._mutations_sent
        if place is None or not sent:  # the common reply: nothing sent before it waits
            return None
        unsettled = self.unsettled
        about = None
        while sent and sent[0][0] <= place:
            _, rid = sent.popleft()
            self._place.pop(rid, None)
            entry = unsettled.pop(rid, None)
            if entry is not None and not entry[4]:
                self.no_reply_unsettled -= 1
                if rid == req_id:
                    about = entry
        if about is not None and status == ERROR and self.deferred is None:
            self.deferred = self.error(OP_NAMES.get(about[0], "?"), header, about[2], about[3])
            log.error("job=%s event=set_refused reason=%s", self.job, self.deferred)
        return about

    def lost_frames(self) -> list[bytes]:
        """The frames of the unsettled mutations nobody awaits, in order."""
        return [entry[1] for entry in self.unsettled.values() if not entry[4]]

    def reconnected(self) -> list[bytes]:
        """A new link: what to send first on it, in order (the unsettled mutations nobody
        awaits; the coordinator answers from its memory those it had carried out). Nothing
        sent on the old link will be answered there any more (a SYNC neither)."""
        self.sync_in_flight = 0
        self._sent = 0
        self._place.clear()
        self._mutations_sent.clear()
        frames = []
        for req_id, entry in self.unsettled.items():
            if not entry[4]:
                frames.append(entry[1])
                self._sent += 1
                self._place[req_id] = self._sent
                self._mutations_sent.append((self._sent, req_id))
        return frames

    def unsettled_keys(self, most: int = 8) -> list[str]:
        """The keys of (at most ``most``) unsettled mutations nobody awaits, for messages."""
        keys: list[str] = []
        for entry in self.unsettled.values():
            if not entry[4]:
                keys.extend(k for k in entry[2] if k not in keys)
                if len(keys) >= most:
                    return keys[:most]
        return keys

    def forget(self, req_id: int) -> bytes | None:
        """An awaited mutation's caller gave up (timed out, cancelled): from now on it is one
        nobody awaits, settled by a later reply or sent again after a reconnect. Returns its
        frame when the current link has not carried it (the caller sends it now, after
        ``resent``, or the next link carries it), else None."""
        entry = self.unsettled.get(req_id)
        if entry is None or not entry[4]:
            return None
        self.unsettled[req_id] = (entry[0], entry[1], entry[2], entry[3], False)
        self.no_reply_unsettled += 1
        return None if req_id in self._place else entry[1]

    def raise_deferred(self) -> None:
        """Raise the refusal of a mutation nobody awaited, if one came (once)."""
        exc, self.deferred = self.deferred, None
        if exc is not None:
            raise exc

    def take_deferred(self) -> BaseException | None:
        exc, self.deferred = self.deferred, None
        return exc

    # -- errors
    def window_timeout(self, op: str, keys: Sequence[str], timeout: float | None) -> StoreTimeout:
        """A mutation that found no room in the window (DEDUPE_WINDOW unsettled) in time."""
        waited = "" if timeout is None else f" after {timeout:.3g}s"
        return StoreTimeout(
            list(keys),
            timeout,
            f"{self.describe(op, keys)} timed out{waited}: earlier mutations of this client were still "
            f"not acknowledged by the coordinator at {self.address}",
        )

    def flush_timeout(self, seconds: float) -> StoreTimeout:
        """``flush`` got no acknowledgement of the sets in time."""
        keys = self.unsettled_keys()
        return StoreTimeout(
            keys,
            seconds,
            f"flush (job {self.job!r}): {self.no_reply_unsettled} set(s) of key(s) {keys!r} still "
            f"not acknowledged by the coordinator at {self.address} after {seconds:.3g}s",
        )

    def describe(self, op: str, keys: Sequence[str]) -> str:
        if not keys:
            return f"{op} (job {self.job!r})"
        return f"{op} of key(s) {list(keys)[:8]!r} (job {self.job!r})"

    def timeout_message(self, keys: Sequence[str], timeout: float | None) -> str:
        waited = f" after {timeout:.3g}s" if timeout is not None else ""
        return (
            f"timed out{waited} waiting for store key(s) {list(keys)!r} of job {self.job!r} at the "
            f"coordinator {self.address}"
        )

    def timed_out(
        self, op: str, timeout: float | None, waits: bool, keys: Sequence[str], unreachable: bool
    ) -> BaseException:
        """The error for a request that got no answer in ``timeout`` seconds."""
        why = (
            f"the coordinator at {self.address} was unreachable (the session kept reconnecting)"
            if unreachable
            else f"the coordinator at {self.address} did not answer"
        )
        waited = "no limit" if timeout is None else f"{timeout:.3g}s"
        if op == "join":
            return RendezvousError(f"join (job {self.job!r}) did not complete within {waited}: {why}")
        if waits and not unreachable:
            return StoreTimeout(keys, timeout, self.timeout_message(keys, timeout))
        return StoreTimeout(keys, timeout, f"{self.describe(op, keys)} timed out after {waited}: {why}")

    def error(
        self, op: str, reply: list[Any] | dict[str, Any], keys: Sequence[str], timeout: float | None
    ) -> BaseException:
        """The exception for a refusal: compact ([id, ERROR, err, msg, keys]) or a map."""
        if isinstance(reply, dict):
            err, msg, missing = reply.get("err"), reply.get("msg", "no reason given"), reply.get("keys")
        else:
            err = reply[2] if len(reply) > 2 else None
            msg = reply[3] if len(reply) > 3 else "no reason given"
            missing = reply[4] if len(reply) > 4 else None
        msg = str(msg)
        if err == ERR_TIMEOUT:
            names = [k for k in missing if isinstance(k, str)] if isinstance(missing, list) else list(keys)
            return StoreTimeout(names, timeout, self.timeout_message(names, timeout))
        if err == ERR_RENDEZVOUS or op == "join":
            return RendezvousError(msg)
        if err in (ERR_INVALID, ERR_TOO_LARGE):
            return StoreError(msg)
        return DistError(f"the coordinator at {self.address} failed {op} ({err}): {msg}")
