"""The store requests' compact wire form: operation codes, the positional header of each request
and reply, and the one encoder of a request frame. Imports only _errors and _framing; no I/O. The
coordinator (aiocoll.server) and its clients (the async session, the blocking client) share it.

Store requests are the coordinator's hot path (thousands per second per client), so their header
is a msgpack *array* rather than a map: no field names to write, hash or look up. Every other
request (join, hb, leave, status, table, progress) keeps the map header that
``protocol._coordinator`` describes. Each operation has exactly one form.

    request header                          payload             reply header       reply payload
    [SET,    id, ack, key]                  value               (none: see below)
    [APPEND, id, ack, key]                  value               (none)
    [MSET,   id, ack, keys, sizes]          values              (none)
    [ADD,    id, ack, key, amount]          -                   [id, OK, value]
    [CAS,    id, ack, key, len(expected)]   expected+desired    [id, OK]           value now stored
    [DEL,    id, ack, key]                  -                   [id, OK, existed]
    [GET,    id, key, timeout]              -                   [id, OK]           value (waits)
    [WAIT,   id, keys, timeout]             -                   [id, OK]
    [MGET,   id, keys, timeout]             -                   [id, OK, sizes]    values (waits)
    [CHECK,  id, keys]                      -                   [id, OK, bool]
    [NKEYS,  id]                            -                   [id, OK, count]
    [SYNC,   id]                            -                   [id, OK]
    any refusal                                                 [id, ERROR, err, msg, keys]

``timeout`` is seconds, or None for no limit. ``err`` is one of the ERR_* codes of
protocol._coordinator.

Ids. A client numbers its requests 1, 2, 3, ... for the whole session: a request sent again on a
new connection (after a reconnect) keeps its id. When the hello carried a client id (``cid``),
the id of a mutation (SET, APPEND, MSET, ADD, CAS, DEL) is also its number for exactly-once
handling, and ``ack`` says that every mutation with a smaller or equal id has been settled
(answered, or known applied), so the coordinator may forget their replies.

Replies in order, and the mutations that have none. The coordinator carries out one connection's
requests in the order they arrive, and a reply (or a refusal) says so for everything before it.
SET, APPEND and MSET are therefore never answered when they succeed: any later reply on the same
connection, whatever its request, tells the client they were applied (with ``--state-dir``: that
they are on disk, since no reply leaves before the records it follows are). A refused one is
answered with its refusal. SYNC exists for a client that has nothing else to ask: its reply is
the acknowledgement of everything sent before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._framing import PREFIX

__all__ = [
    "ADD",
    "APPEND",
    "CAS",
    "CHECK",
    "DEL",
    "ERROR",
    "GET",
    "MGET",
    "MSET",
    "MUTATIONS",
    "NKEYS",
    "NO_REPLY",
    "OK",
    "OP_NAMES",
    "SET",
    "SYNC",
    "WAIT",
    "encode_request",
]

SET, GET, ADD, CAS, WAIT, CHECK, DEL, NKEYS, MGET, MSET, APPEND, SYNC = range(1, 13)
OP_NAMES: dict[int, str] = {
    SET: "set",
    GET: "get",
    ADD: "add",
    CAS: "cas",
    WAIT: "wait",
    CHECK: "check",
    DEL: "del",
    NKEYS: "nkeys",
    MGET: "mget",
    MSET: "mset",
    APPEND: "append",
    SYNC: "sync",
}
# Operations that change the store: numbered for exactly-once handling, with ``ack`` third.
MUTATIONS = frozenset({SET, ADD, CAS, DEL, MSET, APPEND})
# Mutations answered only when refused (a later reply acknowledges them).
NO_REPLY = frozenset({SET, MSET, APPEND})
# Operations that may wait for keys (their timeout is the coordinator's to keep).
WAITING = frozenset({GET, WAIT, MGET})

OK = 0
ERROR = 1

_pack_prefix = PREFIX.pack


def encode_request(pack: Any, header: Sequence[Any], payload: bytes | bytearray | memoryview = b"") -> bytes:
    """One request frame as bytes: prefix, ``header`` packed by ``pack`` (a msgpack Packer's
    ``pack``, so the caller reuses one), payload. Payloads are copied: a store value is small
    next to what a syscall costs, and one buffer is one ``send``."""
    head = pack(header)
    if payload:
        return b"".join((_pack_prefix(len(head), len(payload)), head, payload))
    return _pack_prefix(len(head), 0) + head
