"""The coordinator conversation, after the handshake: operation names, field names, error codes,
and helpers to pack several values into one payload. Imports only _errors; no I/O.

This module is the single source of truth shared by the coordinator (aiocoll.server) and its
clients (aiocoll.client). Every frame is ``header`` (msgpack) + ``payload`` (raw bytes). The store
requests (set, get, add, cas, wait, check, del, nkeys, mget, mset, append, sync) have a compact
positional header described in protocol._store; the requests below have a map header.

Requests (client -> coordinator), header ``{"op": OP, "id": int, ...}``:

    op        fields                                       payload            reply fields / payload
    join      rank (int|None), world_size, addrs           -                  rank, world_size, round,
              ([[host, port], ...]), host (host identity),                    session, members: [{rank,
              timeout                                                         addrs, host}] by rank
    join      members ([[rank|None, addrs, host], ...],    -                  ranks, sessions (in the
              at most MAX_MEMBERS_PER_JOIN), world_size,                      order named), world_size,
              timeout: a host's ranks over one connection                     round; no table
    hb        -                                            -                  -
    leave     -                                            -                  -
    status    job (str|None: all jobs)                     -                  jobs: [{job, world_size,
                                                                              round, complete, keys,
                                                                              members: [{rank, host,
                                                                              alive, last_seen,
                                                                              progress}] (at most 256),
                                                                              members_total,
                                                                              members_alive,
                                                                              held_back_by, summary,
                                                                              progress_reports}]
    progress  ops, seqs, busy (see "Progress" below)        -                  -
    quorum    replica, uid, step, ask, host, min_replicas,  -                  quorum_id, members:
              join_timeout, renew, timeout, replica_rank,                     [[replica, step, host]]
              replica_size (default 0, 1): a replica's                        (by replica), hosts:
              rank at a step boundary (server/_quorum.py,                     [[host of each rank]],
              docs/FAULT_TOLERANCE.md)                                        index, max_step, heal:
                                                                              [source index or -1],
                                                                              left: [[replica, host,
                                                                              why]]

join may carry ``table_in_payload: True``: the reply then has no "members" field; its payload is
the msgpack encoding of that same list (a 10,000-member table is ~0.5 MB, so a client may decode it
lazily, and the coordinator encodes it once for every member), and its header carries that
encoding's ``table_digest`` (as below; added later: a client computes it when it is absent).

join may instead carry ``table_ref: True`` (added after table_in_payload; a coordinator that does
not know it answers as if it were absent, with "members"): the reply then carries neither
"members" nor a payload but ``table_digest`` (16 bytes, BLAKE2b of the table's msgpack encoding,
digest_size 16) and ``table_size`` (bytes). A client that already holds a table with that digest
(another session of the same process joined the same round) uses it; otherwise it asks for it:

    op        fields                                       payload            reply fields / payload
    table     round (int)                                  -                  table_digest; payload =
                                                                              the table (msgpack), as
                                                                              with table_in_payload

``table`` answers only for the job's current completed round; for any other round it fails with
ERR_RENDEZVOUS (the table was replaced: join again). Every role may read it. With ``ranks:
[first, end]`` it answers only the rows of ranks first..end-1 (what a member's links need: a
many-member join's reply has no table), as a msgpack list in the payload.

``timeout`` is seconds (float) or None (wait forever, bounded by the connection's life).
Keys are str (1..MAX_KEY_BYTES UTF-8 bytes); values are bytes up to the coordinator's limit.

Replies (coordinator -> client): ``{"id": same, "ok": True, ...}`` or
``{"id": same, "ok": False, "err": ERR_*, "msg": human text, "keys": [...]}``.

Events (coordinator -> worker, unsolicited, no "id"): ``{"ev": EV_*, ...}``:
    member_lost   rank, reason,       members of this job's current round dropped or went silent;
                  round (ranks,       those found together come in one event: rank is the first,
                  count)              count how many, ranks up to LOST_RANKS_PER_EVENT of them
    restarted     -                   sent right after a resume: the coordinator restarted
    session_lost  reason              the hello's session could not be resumed
    mismatch      group, seq, ranks,  the members' progress reports disagree at (group, seq): every
                  msg                 member of the group fails that operation with MismatchError
    behind        group, seq, ranks,  members of the group that have not called seq yet while
                  msg                 others wait there (named in a CollectiveTimeout later)
    refused       peer, reason        sent to the members waiting in a forming round when a worker
                                      connection that named this job failed authentication (a wrong
                                      token): informational only, since nothing an unauthenticated
                                      peer says may fail anyone's rendezvous

Sessions and liveness: a connection with role ROLE_WORKER that has joined is a member's session.
The worker sends ``hb`` every HEARTBEAT_INTERVAL seconds, or every ``beat`` seconds when its join
reply names a longer interval (a round of thousands of connections: at most a third of the
heartbeat timeout); any request counts as a heartbeat. The
coordinator declares the member lost when its connection closes without ``leave`` or when it has
been silent for HEARTBEAT_TIMEOUT seconds, and sends ``member_lost`` to every other member of the
job at once. After a coordinator restart (state restored from --state-dir) members have
RESUME_GRACE seconds to reconnect: a client that reconnects sends the hello extra field
``session`` (the id it got in the join reply as ``session``) and the coordinator re-attaches it.

Beats (role ROLE_BEAT): a joined worker opens a second connection whose hello
carries its membership ``session`` and the role "beat". It may send only ``hb`` and ``progress``.
A worker process beats on it from a thread of its own, so a member whose event loop is busy (a long
CPU step) stays alive; a frozen or dead process falls silent on both connections and is declared
lost as before. The beat connection never takes over the member's main connection (events go to
the main one) and its closing declares nothing: only silence on both does. The ``hb`` reply on a
beat connection carries ``want: True`` when the coordinator asks for a full progress report.

Progress (``progress`` on a beat connection): sent only when an operation of this rank has been
pending longer than the worker's threshold (AIOCOLL_PROGRESS_AFTER, default 1 s), when such a
report must be withdrawn (``ops`` empty), or when the coordinator asked (``want``). Fields:
``ops`` a list of {g: group id, n: the group's global ranks, s: seq (-1 for point-to-point),
sig: {kind, root, dtype, count, op} as the operation's messages carry them, st: "running" |
"waiting", w: ranks waited for, age: seconds pending}; ``seqs`` {group id: next seq} for every
group; ``done`` recent completed collectives [[g, s, sig], ...]; ``busy`` seconds the event loop
has not run (None when it runs). The coordinator compares the members' signatures at the same
(group, seq) and sends EV_MISMATCH, or EV_BEHIND naming the members that have not reached it.

Exactly-once mutations: a client may send the hello extra field ``cid`` (CID_BYTES random bytes,
one per client session); the id of each of its store mutations is then also its number, and
``ack`` in the store header says every mutation with a smaller or equal id is settled, so the
coordinator may forget those replies (protocol._store). The coordinator remembers the reply of
every numbered mutation above the client's ack, journaled in the same record as the mutation, so
a request re-sent after a reconnect (or a coordinator restart with --state-dir) with the same cid
and id gets the first reply again and is not applied twice. A client keeps at most DEDUPE_WINDOW
numbered mutations above its ack; a request beyond that, or one at or below an ack already given,
is refused with ERR_INVALID.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import ProtocolError

__all__ = [
    "CID_BYTES",
    "DEDUPE_WINDOW",
    "ERR_INTERNAL",
    "ERR_INVALID",
    "ERR_RENDEZVOUS",
    "ERR_TIMEOUT",
    "ERR_TOO_LARGE",
    "ERR_UNKNOWN_OP",
    "EV_MEMBER_LOST",
    "EV_RESTARTED",
    "EV_SESSION_LOST",
    "EV_MISMATCH",
    "EV_BEHIND",
    "EV_REFUSED",
    "EV_STACK",
    "HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT",
    "LOST_RANKS_PER_EVENT",
    "MAX_KEY_BYTES",
    "CONTROL_OPS",
    "OPS",
    "STORE_OPS",
    "RESUME_GRACE",
    "SHORT_KEY_LENGTHS",
    "ROLE_ADMIN",
    "ROLE_BEAT",
    "ROLE_STORE",
    "ROLE_WORKER",
    "join_values",
    "split_values",
]

ROLE_WORKER = "worker"  # joins a rendezvous, keeps a session with heartbeats
ROLE_STORE = "store"  # a plain store client (connect_store): no membership
ROLE_ADMIN = "admin"  # `aiocoll status`: read-only views across jobs
ROLE_BEAT = "beat"  # a joined worker's second connection: heartbeats and progress from a thread

# Every operation's name (the store's are sent by code, protocol._store.OP_NAMES; the names are
# what role permissions, metrics and messages use).
STORE_OPS = frozenset(
    {"set", "get", "add", "cas", "wait", "check", "del", "nkeys", "mget", "mset", "append", "sync"}
)
CONTROL_OPS = frozenset({"join", "hb", "leave", "status", "table", "progress", "quorum", "stacks", "stack"})
OPS = STORE_OPS | CONTROL_OPS

ERR_TIMEOUT = "timeout"  # a waiting get/wait/mget ran out; "keys" names the missing keys
ERR_INVALID = "invalid"  # wrong-typed key or value, bad field
ERR_TOO_LARGE = "too_large"  # value or key above the coordinator's limits
ERR_RENDEZVOUS = "rendezvous"  # duplicate/out-of-range rank, world-size disagreement, ...
ERR_UNKNOWN_OP = "unknown_op"
ERR_INTERNAL = "internal"

EV_MEMBER_LOST = "member_lost"
EV_RESTARTED = "restarted"
# Sent instead of EV_RESTARTED when a hello's ``session`` cannot be re-attached (unknown session,
# or the member was already declared lost); "reason" says why. The member is no longer part of
# its job's round: the worker should fail its process group rather than wait.
EV_SESSION_LOST = "session_lost"
EV_MISMATCH = "mismatch"
EV_BEHIND = "behind"
EV_REFUSED = "refused"
# Pushed on a member's beat connection: answer with ``stack`` (its Python stack now) naming "q".
EV_STACK = "stack"

HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT = 10.0
RESUME_GRACE = 30.0
MAX_KEY_BYTES = 4096
# The lengths of a str that is surely at most MAX_KEY_BYTES in UTF-8 (4 bytes a character): the
# hot store operations take such a key without encoding it (``len(key) in ...``, one C test).
SHORT_KEY_LENGTHS = range(1, MAX_KEY_BYTES // 4 + 1)
CID_BYTES = 16
DEDUPE_WINDOW = 1024
# A member_lost event names at most this many ranks (``count`` says how many were lost).
LOST_RANKS_PER_EVENT = 1024


def join_values(values: Sequence[bytes | bytearray | memoryview]) -> tuple[bytes, list[int]]:
    """Concatenate values into one payload; returns (payload, sizes)."""
    sizes = [len(v) for v in values]
    return b"".join(values), sizes


def split_values(payload: bytes | bytearray | memoryview, sizes: object) -> list[bytes]:
    """Inverse of join_values, validating ``sizes`` from an untrusted header.

    Raises:
        ProtocolError: when sizes is not a list of non-negative ints summing to len(payload).
    """
    if not isinstance(sizes, list) or not all(isinstance(s, int) and s >= 0 for s in sizes):
        raise ProtocolError("'sizes' must be a list of non-negative integers")
    if sum(sizes) != len(payload):
        raise ProtocolError(f"'sizes' add up to {sum(sizes)} bytes but the payload has {len(payload)}")
    mv = memoryview(payload)
    out, pos = [], 0
    for size in sizes:
        out.append(bytes(mv[pos : pos + size]))
        pos += size
    return out
