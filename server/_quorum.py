"""The coordinator's quorum part: the lighthouse of per-step fault tolerance. At each
step boundary every replica of a job asks for a quorum; this part gathers the asks, decides when
the quorum forms and who is in it, who must first receive the state from whom, and tells each
replica. Sans-IO; imports _model, _kv and aiocoll foundations only.

A forming quorum (one per job) forms:

- at once, when every replica of the previous quorum that is still there has asked and at least
  ``min_replicas`` asked. A replica is *gone* when its connection closed, or when that connection
  was silent for the heartbeat timeout (the clients beat every second); replicas that asked
  meanwhile and were not in the previous quorum (new, restarted) are admitted;
- or when ``join_timeout`` has passed since the first ask and at least ``min_replicas`` asked
  (the previous quorum's replicas that did not ask are left out). A job's first quorum, and the
  first after a coordinator restart that lost the connections, always waits for this window.
  Never apart from the previous quorum, though: a quorum without one of its processes at its
  step (only new, restarted or returning replicas, or ones whose heal there failed) does not
  form while one of its replicas is there (seen alive by this coordinator): that one is in its
  step and may commit it, and the two would commit the same steps differently. The window
  starts again until it asks or is gone.

When every replica asking is behind the previous quorum's step (restarted, new, or left out
earlier), they wait for any replica that may hold that step: one of the previous quorum not known
gone (also one not seen since a coordinator restart), or any replica whose connection is open.
Once none is left, the job's state is lost: a quorum of them would commit steps the job has
committed already with other parameters, so their asks are refused, saying so.

A replica may be several ranks (``replica_size``, each asking with its ``replica_rank``: one
model copy sharded or data-parallel inside it). It counts as having asked only when all its ranks
asked (the same ``replica_size``; a disagreement is refused), and as gone when any of them is:
it is then left out whole. The asks of its other ranks that were in a quorum with the lost one
fail, naming it, once they waited their ``replace_timeout`` (0: at once; the replica restarts
whole) for a new process of the lost rank (same replica name and rank, a new incarnation); when
one asks in time, the replica counts again. A replica whose ranks hold different steps (one
replaced, or a heal that failed on some) counts as torn: it heals, and is a source for no one.
Every rank of a replica gets the same reply; the quorum's members are replicas, the reply's
``hosts`` names each one's ranks' hosts (``uids`` their incarnations), and each rank's reply
carries its replica's *generation*: a number that changes whenever the set of processes that
train together as that replica may have changed (a rank replaced, the replica back after it was
left out, or a failure inside it), so that its ranks make their own group (one job per
generation) again.

The quorum id changes only when the membership changes: another set of (replica, incarnation),
or a replica asking for a fresh group (``renew``: its last step failed). Replicas keep their
process group while it stays the same.

The previous quorum (id, members, their steps and the number of the ask that formed it), and each
replica of several ranks' generation and ranks of the last quorum it was in, are the part's only
durable data, kept in the job's key space under ``QUORUM_KEY`` through the key-value
part, so the journal and snapshots carry it unchanged: after a coordinator restart a replica
that sends its ask again (the session re-sends it on the new link) gets the reply of the quorum
that ask already formed, and the replicas still gathering form the next one with the same id
when nothing changed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import msgpack

from aiocoll.protocol._coordinator import ERR_INVALID, ERR_RENDEZVOUS, ERR_TIMEOUT

from ._kv import KeyValue
from ._model import Conn, Effects, EncodedHeader, Job, Refused, fmt_timeout, timeout_field

__all__ = ["DEFAULT_JOIN_TIMEOUT", "MAX_REPLICAS", "QUORUM_KEY", "Quorum", "heal_plan"]

Key = tuple[str, int]  # (replica, replica_rank): one rank of a replica

log = logging.getLogger("aiocoll.server")

QUORUM_KEY = "aiocoll/quorum"  # the previous quorum of a job, msgpack (see Quorum._persist)
DEFAULT_JOIN_TIMEOUT = 10.0
MAX_REPLICAS = 4096
MAX_NAME_CHARS = 256


def heal_plan(steps: list[int]) -> dict[int, int]:
    """Who receives the state from whom: ``{member index: index of its source}``, for the
    members that heal only (none: an empty map).

    Members behind the most advanced step heal from the up-to-date ones, spread round-robin so
    that several healing at once do not all load one source. When no member has committed a step
    (all at 0: a job starting), every member but the first takes the first one's state, so the
    replicas start from one initial model. A step of -1 is a torn state (a heal into the
    replica's own arrays failed midway): never a source; when every member is torn, nobody can
    heal. Only the healing members are named, so that a step where every replica is up to date
    (nearly every step) costs nothing per member in the replies.
    """
    top = max(steps)
    if top < 0:
        return {}
    fresh = [i for i, s in enumerate(steps) if s == top]
    if top == 0:
        fresh = fresh[:1]
    elif len(fresh) == len(steps):
        return {}
    if top:
        behind = [i for i, s in enumerate(steps) if s != top]
    else:
        behind = [i for i in range(len(steps)) if i != fresh[0]]
    n = len(fresh)
    return {i: fresh[k % n] for k, i in enumerate(behind)}


def shards(member: list[Any]) -> list[list[Any]]:
    """A previous quorum's member record's ranks, each ``[uid, step, host, ask]``.

    A one-rank replica's record is ``[replica, uid, step, host, ask]``; a replica of several ranks
    adds their list as a sixth field (the first five are its rank 0's).
    """
    if len(member) > 5:
        return list(member[5])
    return [[member[1], member[2], member[3], member[4]]]


class Ask:
    """One replica's quorum request, waiting for its quorum to form."""

    __slots__ = (
        "ask",
        "conn",
        "generation",
        "host",
        "inside",
        "join_timeout",
        "known",
        "min_replicas",
        "renew",
        "replace_armed",
        "replace_timeout",
        "replica",
        "replica_rank",
        "replica_size",
        "req_id",
        "restore",
        "started",
        "step",
        "uid",
        "waiting",
    )

    def __init__(self, conn: Conn, req_id: int, started: float, h: dict[str, Any]) -> None:
        """Read and check request ``h``; the fields a one-rank replica leaves out take their
        defaults without a check (they are valid).

        Raises:
            Refused: a field is missing or out of its range, naming it.
        """
        self.conn = conn
        self.req_id = req_id
        self.started = started
        get = h.get
        self.replica = _text(get("replica"), "replica")
        self.uid = _text(get("uid"), "uid", 64)
        self.step = _count(get("step"), "step", 0, 1 << 62)
        self.ask = _count(get("ask"), "ask", 0, 1 << 62)
        self.host = _text(get("host") or "?", "host")
        self.min_replicas = _count(get("min_replicas", 1), "min_replicas", 1, MAX_REPLICAS)
        join = timeout_field(get("join_timeout", DEFAULT_JOIN_TIMEOUT))
        if join is None:
            raise Refused(ERR_INVALID, "quorum: 'join_timeout' must be a number of seconds")
        self.join_timeout = join
        self.renew = get("renew") is True
        # its state is a checkpoint of ``step`` (Manager.restore): it may take the job back there
        self.restore = get("restore") is True
        if get("torn") is True:
            self.step = -1  # a torn state: behind everyone, a source for no one
        self.known = _count(h["known"], "known", 0, 1 << 62) if "known" in h else 0
        self.inside = get("inside") is True
        if "replica_size" in h or "replica_rank" in h:
            self.replica_rank = _count(get("replica_rank", 0), "replica_rank", 0, MAX_REPLICAS - 1)
            self.replica_size = _count(get("replica_size", 1), "replica_size", 1, MAX_REPLICAS)
            if self.replica_rank >= self.replica_size:
                raise Refused(
                    ERR_INVALID,
                    f"quorum: replica {self.replica!r} asked with replica_rank={self.replica_rank}, not "
                    f"below its replica_size={self.replica_size}",
                )
        else:
            self.replica_rank, self.replica_size = 0, 1
        self.replace_timeout = _replace_timeout(h["replace_timeout"]) if "replace_timeout" in h else 0.0
        self.generation = _count(h["generation"], "generation", 0, 1 << 62) if "generation" in h else 0
        self.replace_armed = False  # a wake-up is set for the end of its wait for a replaced rank
        self.waiting = True  # the timer protocol (_model.Effects.push_timer)


class _Wake:
    """A timer item that only makes the job's quorum be considered again."""

    __slots__ = ("jq", "waiting")

    def __init__(self, jq: JobQuorum) -> None:
        self.jq = jq
        self.waiting = True


class _Tick:
    """A forming quorum's next decision time (a timer item; superseded ones stop waiting)."""

    __slots__ = ("jq", "waiting")

    def __init__(self, jq: JobQuorum) -> None:
        self.jq = jq
        self.waiting = True


class JobQuorum:
    """One job's quorum state: the asks gathering, the previous quorum, who was seen where."""

    __slots__ = (
        "asks",
        "by_name",
        "first_at",
        "generation",
        "gone",
        "incomplete",
        "job",
        "last",
        "lost",
        "next_id",
        "pending",
        "ranks_of",
        "seen",
        "tick",
        "top",
    )

    def __init__(self, job: Job) -> None:
        self.job = job
        self.asks: dict[str, dict[int, Ask]] = {}  # replica -> its ranks' asks, by replica_rank
        self.first_at = 0.0
        # The previous quorum: {"id", "members": [[replica, uid, step, host, ask], ...]}, or None.
        self.last: dict[str, Any] | None = None
        self.top = -1  # the previous quorum's step (its members' highest)
        # Asks were refused because no replica holding that step was left: asks behind it are
        # refused at once until a quorum forms again (a holder, back, may still ask).
        self.lost = False
        self.next_id = 1
        self.seen: dict[Key, Conn] = {}  # a replica's rank -> the connection it last asked on (open)
        self.gone: dict[Key, str] = {}  # a replica's rank -> why it is gone (its connection closed)
        self.tick: _Tick | None = None
        # a replica of several ranks -> its ranks ([uid, step, host, ask]) in the last quorum it was in
        self.ranks_of: dict[str, list[list[Any]]] = {}
        self.generation: dict[str, int] = {}  # a replica of several ranks -> its generation
        # Kept as asks come and go, so that an ask costs the same with 10 replicas or 4,000:
        self.incomplete: set[str] = set()  # replicas some but not all of whose ranks asked
        self.by_name: dict[str, list[Any]] = {}  # the previous quorum's members by replica
        self.pending: dict[str, list[Any]] = {}  # ... of them, those not (all ranks) asking now
        raw = job.kv.get(QUORUM_KEY)
        if raw is not None:
            record = msgpack.unpackb(bytes(raw), raw=False)
            self.set_last({"id": record["id"], "members": record["members"]})
            self.next_id = record["next"]
            for m in record["members"]:
                if len(m) > 5:
                    self.ranks_of[m[0]] = m[5]
            for name, (generation, ranks) in record.get("replicas", {}).items():
                self.generation[name] = generation
                self.ranks_of[name] = ranks

    def set_last(self, record: dict[str, Any]) -> None:
        """The quorum just formed (or read back) becomes the previous one, which the next waits for."""
        self.last = record
        self.top = max(m[2] for m in record["members"])
        self.lost = False
        self.by_name = by_name = {m[0]: m for m in record["members"]}
        asks = self.asks
        if not asks:  # (just formed from every ask there was): all of them are waited for
            self.pending = dict(by_name)
        else:
            self.pending = {name: m for name, m in by_name.items() if not _complete(asks.get(name, {}))}

    def recount(self, name: str) -> None:
        """Replica ``name``'s asks changed: whether it is complete, and still waited for."""
        ranks = self.asks.get(name)
        done = _complete(ranks or {})
        if ranks and not done:
            self.incomplete.add(name)
        else:
            self.incomplete.discard(name)
        member = self.by_name.get(name)
        if member is None:
            return
        if done:
            self.pending.pop(name, None)
        elif name not in self.pending:
            self.pending[name] = member
            if self.tick is not None:  # waited for again: the next decision time is recomputed
                self.tick.waiting = False
                self.tick = None


def _rank_of(a: Ask) -> int:
    return a.replica_rank


def _complete(ranks: dict[int, Ask]) -> bool:
    """Whether every rank of a replica asked."""
    return bool(ranks) and len(ranks) == next(iter(ranks.values())).replica_size


def _text(value: object, what: str, limit: int = MAX_NAME_CHARS) -> str:
    if type(value) is not str or not 0 < len(value) <= limit:
        raise Refused(
            ERR_INVALID, f"quorum: {what!r} must be a string of 1..{limit} characters, got {value!r}"
        )
    return value


def _count(value: object, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:
        raise Refused(ERR_INVALID, f"quorum: {what!r} must be an integer in {low}..{high}, got {value!r}")
    return value


def _replace_timeout(value: object) -> float:
    """An ask's ``replace_timeout``: seconds (None: no limit but the ask's own timeout)."""
    seconds = timeout_field(value, "replace_timeout")
    return math.inf if seconds is None else seconds


# A reply's own fields, encoded around the shared ones: the map's first byte (a fixmap of n
# entries), and the keys, packed once.
_FIXMAP = [bytes((0x80 | n,)) for n in range(16)]
_ID, _INDEX, _GENERATION = (msgpack.packb(k) for k in ("id", "index", "generation"))
_pack = msgpack.Packer().pack  # (the coordinator runs on one thread)
# A shared part up to this size is joined to each reply's own head (one buffer to write).
_JOIN_SHARED = 1024


class _Replies:
    """The replies to one quorum's asks: what they share is encoded once, not once per replica.

    A replica that says it holds the group of this very quorum (``known``), formed again with
    the same members, gets the reply without the member list (it has it): with many replicas
    that list is most of the bytes the coordinator would write. The heal plan names only the
    members that heal, so that such a reply does not grow with the quorum.
    """

    def __init__(
        self,
        record: dict[str, Any],
        left: list[list[str]],
        generation: dict[str, int],
        *,
        same: bool = False,
    ) -> None:
        members = record["members"]
        self.generation = generation
        steps = [m[2] for m in members]
        self.qid = record["id"]
        self.same = same
        self.max_step = max(steps)
        self.heal = heal_plan(steps)
        self._index: dict[str, int] | None = None
        self._record = record
        self._left = left
        self._full: tuple[int, bytes] | None = None
        self._compact: tuple[int, bytes] | None = None

    def index(self, replica: str) -> int:
        """Replica ``replica``'s index among the members."""
        if self._index is None:
            self._index = {m[0]: i for i, m in enumerate(self._record["members"])}
        return self._index[replica]

    def _shared(self, full: bool) -> tuple[int, bytes]:
        """The fields every reply shares: their count, and their entries encoded (no map head)."""
        fields: dict[str, Any] = {"ok": True, "quorum_id": self.qid}
        if full:
            members = self._record["members"]
            fields["members"] = [[m[0], m[2], m[3]] for m in members]
            fields["hosts"] = [[r[2] for r in shards(m)] for m in members]
            # each member's incarnation: the replicas linked in an earlier group may form the
            # next one over those links when they are the same processes (aiocoll/ft.py)
            fields["uids"] = [m[1] for m in members]
        fields.update(max_step=self.max_step, heal=self.heal, left=self._left)
        return len(fields), msgpack.packb(fields)[1:]

    def reply(self, req_id: int, index: int, replica: str, known: int) -> EncodedHeader:
        """The reply to ask ``req_id`` of ``replica`` (member ``index``), which holds the group
        of quorum ``known``."""
        if self.same and known == self.qid:
            shared = self._compact
            if shared is None:
                shared = self._compact = self._shared(False)
        else:
            shared = self._full
            if shared is None:
                shared = self._full = self._shared(True)
        entries, tail = shared
        head = _ID + _pack(req_id) + _INDEX + _pack(index)
        generation = self.generation.get(replica)
        if generation is None:
            head = _FIXMAP[entries + 2] + head
        else:  # a replica of several ranks: its ranks' own group
            head = _FIXMAP[entries + 3] + head + _GENERATION + _pack(generation)
        if len(tail) <= _JOIN_SHARED:
            return EncodedHeader((head + tail,))
        return EncodedHeader((head, tail))


class Quorum:
    """The quorums of every job.

    Args:
        fx: where decisions go. kv: the key-value part, which keeps the durable record.
        heartbeat_timeout: the silence after which a replica's connection counts as gone
            (the coordinator's liveness setting).
    """

    def __init__(self, fx: Effects, kv: KeyValue, *, heartbeat_timeout: Callable[[], float]) -> None:
        self.fx = fx
        self.kv = kv
        self.heartbeat_timeout = heartbeat_timeout
        self.jobs: dict[str, JobQuorum] = {}
        self._by_conn: dict[int, list[tuple[JobQuorum, Key]]] = {}  # conn id -> (job, replica's rank)
        # Jobs whose every replica left this coordinator (their quorum state forgotten): the
        # previous quorum's replicas, read back from the key space, are known gone, not "not
        # seen since a restart" (replicas behind would wait for them until their timeout)
        self._emptied: set[str] = set()

    def handlers(self) -> dict[str, Any]:
        return {"quorum": self.op_quorum}

    def _of(self, job: Job) -> JobQuorum:
        jq = self.jobs.get(job.name)
        if jq is None or jq.job is not job:
            jq = self.jobs[job.name] = JobQuorum(job)
            if job.name in self._emptied:
                self._emptied.discard(job.name)
                for m in jq.by_name.values():
                    for rank in range(len(shards(m))):
                        jq.gone[(m[0], rank)] = "it left, with every other replica of the job"
        return jq

    # ------------------------------------------------------------------ requests
    def op_quorum(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        now = self.fx.started
        a = Ask(conn, req_id, now, h)
        timeout = timeout_field(h.get("timeout"))
        jq = self._of(conn.job)
        key = (a.replica, a.replica_rank)
        last = jq.last
        m = jq.by_name.get(a.replica) if not a.renew else None
        if last is not None and m is not None and (len(m[5]) if len(m) > 5 else 1) == a.replica_size:
            uid, step, _, ask = m[5][a.replica_rank] if len(m) > 5 else m[1:5]
            if uid == a.uid and ask == a.ask and step == a.step:
                # This ask formed the previous quorum already: its reply was lost with a link
                # (a coordinator restart); the same answer again.
                self._note(jq, key, conn)
                again = _Replies(last, [], jq.generation)
                self.fx.reply(
                    conn, req_id, "quorum", now, again.reply(req_id, again.index(a.replica), a.replica, 0)
                )
                return
        others = jq.asks
        mine = others.get(a.replica)
        if mine is None:
            mine = {}
        for other in mine.values():
            if other.replica_size != a.replica_size and other.replica_rank != a.replica_rank:
                raise Refused(
                    ERR_INVALID,
                    f"quorum: rank {a.replica_rank} of replica {a.replica!r} (host {a.host}) asked with "
                    f"replica_size={a.replica_size} but its rank {other.replica_rank} (host {other.host}) "
                    f"with replica_size={other.replica_size}; give every rank of a replica the same "
                    f"replica_size",
                )
        if others:
            first = next(iter(next(iter(others.values())).values()))
            if (
                a.min_replicas != first.min_replicas
                or a.join_timeout != first.join_timeout
                or a.replica_size != first.replica_size
            ):
                raise Refused(
                    ERR_INVALID,
                    f"quorum: replica {a.replica!r} asked with min_replicas={a.min_replicas}, "
                    f"join_timeout={a.join_timeout:g}, replica_size={a.replica_size} but replica "
                    f"{first.replica!r} with min_replicas={first.min_replicas}, join_timeout="
                    f"{first.join_timeout:g}, replica_size={first.replica_size}; give every replica's "
                    f"Manager the same settings",
                )
        complete_before = len(others) - len(jq.incomplete)
        old = mine.pop(a.replica_rank, None)
        if old is not None:
            old.waiting = False  # its connection is open: a closed one's asks were dropped
            self.fx.fail(
                old.conn.id,
                old.req_id,
                "quorum",
                now,
                ERR_INVALID,
                f"quorum: replaced by a newer ask of replica {a.replica!r} rank {a.replica_rank} "
                f"(from {conn.peer})",
            )
        elif a.replica not in others and len(others) >= MAX_REPLICAS:
            raise Refused(
                ERR_INVALID, f"quorum: job {conn.job.name!r} already has {MAX_REPLICAS} replicas asking"
            )
        others[a.replica] = mine
        mine[a.replica_rank] = a
        jq.recount(a.replica)
        if complete_before == 0 and len(others) > len(jq.incomplete):
            # The join window runs from the first replica whose ranks all asked: ranks that wait
            # for a fellow rank (starting, or replaced) do not start it.
            jq.first_at = now
        self._note(jq, key, conn)
        if timeout is not None:
            self.fx.push_timer(now + timeout, a, self._expire_ask)
        self._consider(jq, now)

    def _note(self, jq: JobQuorum, key: Key, conn: Conn) -> None:
        """A replica's rank was heard on ``conn``: it is there, and gone when that connection closes."""
        jq.gone.pop(key, None)
        if jq.seen.get(key) is not conn:
            jq.seen[key] = conn
            self._by_conn.setdefault(conn.id, []).append((jq, key))

    # ------------------------------------------------------------------ deciding
    def _absent(self, jq: JobQuorum, key: Key, now: float) -> str | None:
        """Why a replica's rank (of the previous quorum, not asking) is not waited for; None: wait."""
        why = jq.gone.get(key)
        if why is not None:
            return why
        conn = jq.seen.get(key)
        if conn is None:
            return None  # not seen since this coordinator started: maybe still coming
        silent = now - conn.last_seen
        limit = self.heartbeat_timeout()
        if silent > limit:
            return f"its connection ({conn.peer}) was silent for {silent:.1f}s (heartbeat timeout {limit:g}s)"
        return None

    def _missing(self, jq: JobQuorum, m: list[Any], now: float) -> tuple[list[Key], list[str] | None]:
        """A previous member's ranks that have not asked, and why it is left out (None: wait).

        ``[replica, host, why]``: the first of its ranks that is gone, named.
        """
        asked = jq.asks.get(m[0], {})
        ranks = shards(m)
        missing = []
        for rank, (_, _, host, _) in enumerate(ranks):
            if rank in asked:
                continue
            missing.append((m[0], rank))
            why = self._absent(jq, (m[0], rank), now)
            if why is not None:
                if len(ranks) > 1:
                    why = f"its rank {rank} of {len(ranks)} (host {host}) is gone: {why}"
                return missing, [m[0], host, why]
        return missing, None

    def _waited(self, jq: JobQuorum, now: float) -> bool:
        """Whether a replica of the previous quorum that has not asked is still waited for.

        Stops at the first one: while replicas ask, that is almost always the first looked at.
        """
        return any(self._missing(jq, m, now)[1] is None for m in jq.pending.values())

    def _untick(self, jq: JobQuorum) -> None:
        if jq.tick is not None:
            jq.tick.waiting = False
            jq.tick = None

    def _consider(self, jq: JobQuorum, now: float) -> None:
        """Form the job's quorum if it may form now; otherwise arm the next decision time.

        Costs the same for each ask however many replicas there are (counts and the set of
        previous members not asking are kept as asks come and go), except when a quorum forms.
        """
        if jq.incomplete:
            for name in [n for n in jq.incomplete if n in jq.ranks_of]:
                self._fail_rest(jq, name, now)
        asks = jq.asks
        if not asks:
            self._untick(jq)
            return
        if jq.lost and self._behind(jq) is not None:
            self._settle(jq, now)
            return
        first = next(iter(next(iter(asks.values())).values()))
        if len(asks) - len(jq.incomplete) < first.min_replicas:
            self._untick(jq)
            return  # only another ask can change that (or the asks' own timeouts)
        if jq.last is not None and not self._waited(jq, now):
            if self._behind(jq) is None or not self._may_hold(jq, now):
                self._settle(jq, now)
                return
        window = jq.first_at + first.join_timeout
        if now >= window:
            if not self._apart(jq, now):
                self._settle(jq, now)
                return
            jq.first_at, window = now, now + first.join_timeout  # a new window for them
        if jq.tick is not None:
            return  # armed no later than needed: asks and heartbeats only move the time on
        due = window
        limit = self.heartbeat_timeout()
        for m in jq.pending.values():
            missing, why = self._missing(jq, m, now)
            if why is not None:
                continue
            for key in missing:
                conn = jq.seen.get(key)
                if conn is not None:
                    due = min(due, conn.last_seen + limit + 0.001)
        jq.tick = _Tick(jq)
        self.fx.push_timer(due, jq.tick, self._expire_tick)

    def _apart(self, jq: JobQuorum, now: float) -> bool:
        """Whether the quorum that would form now would train apart from the previous one.

        That is when none of its processes took part in the previous quorum at that quorum's
        step (its replicas are new, restarted, came back, or failed to heal there: they hold
        nothing to go on from) while a replica of the previous quorum is still there, known
        alive on this coordinator: that one is in the middle of its step and may commit it. The
        two would commit the same steps with other results (a restarted replica, at step 0, would
        even train from its initial state), so the join window starts again: the new replicas wait
        for it until it asks (it joins them; those behind heal from it) or is gone. A quorum that
        keeps one of the previous quorum's processes at its step may leave the rest out: that
        process ended the step, so the step is decided for every member, and it holds the state
        the others heal from. Members not seen since this coordinator started (a restart) are
        not known alive and hold nothing up past the window, unless every replica asking is
        behind that step (``_may_hold``).
        """
        last = jq.last
        if last is None:
            return False
        if self._behind(jq) is not None:
            return self._may_hold(jq, now)
        top = jq.top
        by_name = jq.by_name
        for name, ranks in jq.asks.items():
            m = by_name.get(name)
            if m is None or name in jq.incomplete:
                continue
            steps = {a.step for a in ranks.values()}
            if len(steps) > 1 or steps.pop() < top:
                continue  # behind that step (its heal there failed): it holds no state to go on from
            before = shards(m)
            if any(rank < len(before) and a.uid == before[rank][0] for rank, a in ranks.items()):
                return False  # a process of the previous quorum, up to date, is in it
        for m in jq.pending.values():
            missing, why = self._missing(jq, m, now)
            if why is None and any(key in jq.seen for key in missing):
                return True
        return False

    def _behind(self, jq: JobQuorum) -> int | None:
        """The previous quorum's step when every replica asking is behind it, else None.

        Only replicas with a whole state count (a torn one is behind everyone; a quorum of torn
        ones alone has nobody to heal from, which their Managers say). The previous quorum's
        replicas asked at that step: the job has committed every step before it.
        """
        if jq.last is None:
            return None
        top, best = jq.top, -1
        for ranks in jq.asks.values():  # (nearly always the first one asked holds it)
            for a in ranks.values():
                if a.step >= top:
                    return None
                best = max(best, a.step)
        return top if best >= 0 else None

    def _may_hold(self, jq: JobQuorum, now: float) -> bool:
        """Whether a replica that may hold the job's state is there and has not asked.

        A replica of the previous quorum not known gone (alive, or not seen since this
        coordinator started), or any replica of the job whose connection is open and not silent
        (one left out of the previous quorum may hold its step). Asked only while every replica
        asking is behind: they wait for such a one rather than train from an older state.
        """
        if any(self._missing(jq, m, now)[1] is None for m in jq.pending.values()):
            return True
        limit = self.heartbeat_timeout()
        asks = jq.asks
        return any(
            rank not in asks.get(name, {}) and now - conn.last_seen <= limit
            for (name, rank), conn in jq.seen.items()
        )

    def _settle(self, jq: JobQuorum, now: float) -> None:
        """Form the quorum that may form now, unless the job's state is lost: then refuse its asks.

        Lost: every replica asking is behind the previous quorum's step, and none of that
        quorum's replicas at that step is left (gone, or restarted: a new process asks under its
        name). A quorum of those asking would commit steps the job has committed already with
        other parameters, and each replica's ``step`` would go back, silently: a restarted
        replica would train on from its initial state. Nothing can heal them, so every ask
        fails, saying what was lost and what to do.
        """
        top = self._behind(jq)
        if top is None:
            self._form(jq, now)
            return
        last = jq.last
        assert last is not None
        asked = [a for ranks in jq.asks.values() for a in ranks.values()]
        if any(a.restore for a in asked):
            # A replica restored from a checkpoint asks to take the job back to that step: the
            # quorum goes on from the highest step any of its replicas holds.
            log.warning(
                "job=%s event=quorum_restored committed=%d from=%d replicas=%s",
                jq.job.name,
                top,
                max(a.step for a in asked),
                sorted({a.replica for a in asked if a.restore})[:16],
            )
            self._form(jq, now)
            return
        held = []
        for m in last["members"]:
            if m[2] != top:
                continue
            why = self._missing(jq, m, now)[1]
            held.append(f"{m[0]} (host {m[3]}): " + (why[2] if why is not None else "restarted"))
        asked.sort(key=lambda a: a.replica)
        best = max(a.step for a in asked)
        named = ", ".join(
            f"{a.replica}{f' rank {a.replica_rank}' if a.replica_size > 1 else ''} (host {a.host}) at step "
            f"{a.step}"
            for a in asked
        )
        detail = (
            f"job {jq.job.name!r} has committed steps 0..{top - 1}, and no replica that holds them is left "
            f"(quorum {last['id']}: {'; '.join(held)}). The replicas asking hold step {best} at most "
            f"({named}): trained on, they would commit steps {best}..{top - 1} again with other "
            f"parameters. The job's state is lost: start it again from a checkpoint (load it, then "
            f"Manager.restore(step) before start_step), or under a new job name (Manager(job=...))"
        )
        log.warning(
            "job=%s event=quorum_refused committed=%d best=%d held_by=%s", jq.job.name, top, best, held
        )
        self._untick(jq)
        jq.lost = True
        for a in asked:
            rank = f" rank {a.replica_rank}" if a.replica_size > 1 else ""
            self._refuse(a, f"quorum: replica {a.replica!r}{rank} (host {a.host}, step {a.step}): {detail}")
        names = list(jq.asks)
        jq.asks.clear()
        for name in names:
            jq.recount(name)

    def _refuse(self, a: Ask, msg: str) -> None:
        """Fail ask ``a``: its replica's rank may not train now; ``msg`` says why and what to do."""
        a.waiting = False
        self.fx.fail(a.conn.id, a.req_id, "quorum", a.started, ERR_RENDEZVOUS, msg)

    def _fail_rest(self, jq: JobQuorum, name: str, now: float) -> None:
        """Fail the asks of a replica's ranks whose fellow rank of its last quorum is gone.

        They cannot train without it. Each waits first for a new process of the lost rank, up to
        its ``replace_timeout`` from when it asked (0: none; the replica restarts whole).
        Ranks of a new incarnation (not in a quorum with the lost one) are not failed: they wait
        for their other ranks.
        """
        ranks = jq.ranks_of.get(name)
        asked = jq.asks[name]
        if ranks is None or len(ranks) != next(iter(asked.values())).replica_size:
            return
        why = None
        for rank, (_, _, host, _) in enumerate(ranks):
            if rank not in asked:
                gone = self._absent(jq, (name, rank), now)
                if gone is not None:
                    why = f"its rank {rank} of {len(ranks)} (host {host}) is gone: {gone}"
                    break
        if why is None:
            return
        for rank, a in list(asked.items()):
            if a.uid != ranks[rank][0]:
                continue
            due = a.started + a.replace_timeout
            if now < due:
                if not a.replace_armed and due < math.inf:
                    a.replace_armed = True
                    self.fx.push_timer(due, _Wake(jq), self._wake)
                continue
            del asked[rank]
            if a.replace_timeout > 0:
                waited = f"; no new process of it asked within its replace_timeout ({a.replace_timeout:g}s)"
            else:
                waited = " (replace_timeout 0: the replica restarts whole)"
            self._refuse(
                a,
                f"quorum: replica {name!r} of job {jq.job.name!r} is left out of the next quorum: "
                f"{why}{waited}. Its rank {rank} (host {a.host}) cannot train without it: restart the "
                f"lost rank (the same replica name and replica_rank) within replace_timeout, or the "
                f"replica (all its ranks); it heals from a live one",
            )
        if not asked:
            del jq.asks[name]
        jq.recount(name)

    def _wake(self, wake: _Wake) -> None:
        wake.waiting = False
        self._consider(wake.jq, self.fx.clock())

    def _expire_tick(self, tick: _Tick) -> None:
        tick.waiting = False
        if tick.jq.tick is tick:
            tick.jq.tick = None
            self._consider(tick.jq, self.fx.clock())

    def _expire_ask(self, a: Ask) -> None:
        a.waiting = False
        jq = self._of(a.conn.job)
        mine = jq.asks.get(a.replica, {})
        if mine.get(a.replica_rank) is not a:
            return
        del mine[a.replica_rank]
        if not mine:
            del jq.asks[a.replica]
        jq.recount(a.replica)
        now = self.fx.clock()
        asked = [a, *sorted((o for r in jq.asks.values() for o in r.values()), key=lambda o: o.replica)]
        named = ", ".join(
            f"{o.replica}{f' rank {o.replica_rank}' if o.replica_size > 1 else ''} (host {o.host})"
            for o in asked
        )
        replicas = len({o.replica for o in asked})
        detail = f"{replicas} of at least {a.min_replicas} replicas asked ({named})"
        if a.replica_size > 1:
            detail += (
                f"; replica {a.replica!r} has {a.replica_size} ranks, of which "
                f"{sorted({a.replica_rank, *mine})} asked"
            )
        if jq.last is not None:
            waited = [
                f"{m[0]} (host {m[3]})"
                for m in jq.last["members"]
                if not _complete(jq.asks.get(m[0], {})) and m[0] != a.replica
            ]
            if waited:
                detail += f"; waited for replicas of quorum {jq.last['id']}: {', '.join(waited)}"
        self.fx.fail(
            a.conn.id,
            a.req_id,
            "quorum",
            a.started,
            ERR_TIMEOUT,
            f"quorum: no quorum formed for replica {a.replica!r} of job {a.conn.job.name!r} within "
            f"{fmt_timeout(now - a.started)}: {detail}. Start more replicas, or lower min_replicas",
        )
        self._consider(jq, now)

    def _form(self, jq: JobQuorum, now: float) -> None:
        self._untick(jq)
        left: list[list[str]] = []  # previous members left out: [replica, host, why]
        late: list[list[str]] = []
        for m in jq.pending.values():
            why = self._missing(jq, m, now)[1]
            if why is not None:
                left.append(why)
            else:
                join = next(iter(next(iter(jq.asks.values())).values())).join_timeout
                late.append([m[0], m[3], f"did not ask within the join window ({join:g}s)"])
        left += late
        asks, incomplete = jq.asks, jq.incomplete
        complete = sorted(asks) if not incomplete else sorted(n for n in asks if n not in incomplete)
        last, before = jq.last, jq.by_name
        # The same quorum again: the same replicas (both lists are in name order), each with the
        # same incarnations of its ranks, and none asking for a fresh group.
        same = last is not None and len(complete) == len(last["members"])
        members: list[list[Any]] = []
        groups: list[list[Ask]] = []
        for name in complete:
            ranks = asks.pop(name)
            if len(ranks) == 1:
                (a,) = g = list(ranks.values())
                member: list[Any] = [name, a.uid, a.step, a.host, a.ask]
                if same:
                    prev = before.get(name)
                    same = prev is not None and len(prev) == 5 and prev[1] == a.uid and not a.renew
            else:
                g = sorted(ranks.values(), key=_rank_of)
                a = g[0]
                steps = {r.step for r in g}
                # ranks at different steps (one replaced, a heal that failed on some): not one model
                step = steps.pop() if len(steps) == 1 else -1
                member = [name, a.uid, step, a.host, a.ask, [[r.uid, r.step, r.host, r.ask] for r in g]]
                if same:
                    prev = before.get(name)
                    same = (
                        prev is not None
                        and [r[0] for r in shards(prev)] == [r.uid for r in g]
                        and not any(r.renew for r in g)
                    )
                self._generation(jq, g)
                jq.ranks_of[name] = member[5]
            members.append(member)
            groups.append(g)
        if same:
            assert last is not None
            qid = last["id"]
        else:
            qid = jq.next_id
            jq.next_id += 1
        record = {"id": qid, "members": members}
        jq.set_last(record)
        self._persist(jq)
        replies = _Replies(record, left, jq.generation, same=same)
        log.info(
            "job=%s event=quorum id=%d members=%d left_out=%s max_step=%d heal=%s",
            jq.job.name,
            qid,
            len(members),
            [entry[0] for entry in left],
            replies.max_step,
            replies.heal,
        )
        reply, answer = self.fx.reply, replies.reply
        for index, g in enumerate(groups):
            for a in g:
                a.waiting = False
                reply(a.conn, a.req_id, "quorum", a.started, answer(a.req_id, index, a.replica, a.known))

    def _generation(self, jq: JobQuorum, ranks: list[Ask]) -> None:
        """A replica of several ranks enters a quorum: a new generation when its processes may
        not share a working group of their own any more.

        That is: another set of processes (a rank replaced, or the replica restarted), the
        replica not in the previous quorum (left out meanwhile), or a rank that saw its
        replica's own group fail. Never lower than a generation any of its ranks knows, so that
        a coordinator that lost its state does not hand out one used before.
        """
        name = ranks[0].replica
        known = max(jq.generation.get(name, 0), *(a.generation for a in ranks))
        before = jq.ranks_of.get(name)
        changed = (
            before is None
            or [r[0] for r in before] != [a.uid for a in ranks]
            or name not in jq.by_name
            or any(a.inside for a in ranks)
        )
        jq.generation[name] = known + 1 if changed else known

    def _persist(self, jq: JobQuorum) -> None:
        assert jq.last is not None
        replicas = {name: [jq.generation.get(name, 0), ranks] for name, ranks in jq.ranks_of.items()}
        value = msgpack.packb(
            {"id": jq.last["id"], "next": jq.next_id, "members": jq.last["members"], "replicas": replicas}
        )
        self.kv._put(jq.job, QUORUM_KEY, value)

    # ------------------------------------------------------------------ connections
    def disconnect(self, conn: Conn, reason: str) -> None:
        """A connection closed: its asks are dropped, and the replicas' ranks it spoke for are gone."""
        entries = self._by_conn.pop(conn.id, None)
        if not entries:
            return
        now = self.fx.clock()
        touched: list[JobQuorum] = []
        for jq, key in entries:
            if jq.seen.get(key) is not conn:
                continue  # it asked again on another connection since
            del jq.seen[key]
            jq.gone[key] = f"its connection ({conn.peer}) closed: {reason}"
            mine = jq.asks.get(key[0], {})
            a = mine.get(key[1])
            if a is not None and a.conn is conn:
                a.waiting = False
                del mine[key[1]]
                if not mine:
                    del jq.asks[key[0]]
                jq.recount(key[0])
            if jq not in touched:
                touched.append(jq)
        for jq in touched:
            if not jq.seen and not jq.asks:
                # Nobody of this job is here: forget it (its durable record stays in the key
                # space, read again when a replica next asks).
                if self.jobs.get(jq.job.name) is jq:
                    del self.jobs[jq.job.name]
                    self._emptied.add(jq.job.name)
                if jq.tick is not None:
                    jq.tick.waiting = False
                continue
            self._consider(jq, now)
