"""The coordinator's quorum part (issue 20): the lighthouse of per-step fault tolerance. At each
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

The quorum id changes only when the membership changes: another set of (replica, incarnation),
or a replica asking for a fresh group (``renew``: its last step failed). Replicas keep their
process group while it stays the same.

The previous quorum (id, members, their steps and the number of the ask that formed it) is the
part's only durable data, kept in the job's key space under ``QUORUM_KEY`` through the key-value
part, so the journal and snapshots carry it unchanged: after a coordinator restart a replica
that sends its ask again (the session re-sends it on the new link) gets the reply of the quorum
that ask already formed, and the replicas still gathering form the next one with the same id
when nothing changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgpack

from aiocoll.protocol._coordinator import ERR_INVALID, ERR_TIMEOUT

from ._kv import KeyValue
from ._model import Conn, Effects, Job, Refused, fmt_timeout, timeout_field

__all__ = ["DEFAULT_JOIN_TIMEOUT", "MAX_REPLICAS", "QUORUM_KEY", "Quorum", "heal_plan"]

log = logging.getLogger("aiocoll.server")

QUORUM_KEY = "aiocoll/quorum"  # the previous quorum of a job, msgpack (see Quorum._persist)
DEFAULT_JOIN_TIMEOUT = 10.0
MAX_REPLICAS = 4096
MAX_NAME_CHARS = 256


def heal_plan(steps: list[int]) -> list[int]:
    """For each member (by index), the index of the member it receives the state from, or -1.

    Members behind the most advanced step heal from the up-to-date ones, spread round-robin so
    that several healing at once do not all load one source. When no member has committed a step
    (all at 0: a job starting), every member but the first takes the first one's state, so the
    replicas start from one initial model.
    """
    top = max(steps)
    fresh = [i for i, s in enumerate(steps) if s == top]
    if top == 0:
        fresh = fresh[:1]
    plan = [-1] * len(steps)
    k = 0
    for i in range(len(steps)):
        if i not in fresh:
            plan[i] = fresh[k % len(fresh)]
            k += 1
    return plan


class Ask:
    """One replica's quorum request, waiting for its quorum to form."""

    __slots__ = (
        "ask",
        "conn",
        "host",
        "join_timeout",
        "min_replicas",
        "renew",
        "replica",
        "req_id",
        "started",
        "step",
        "uid",
        "waiting",
    )

    def __init__(self, conn: Conn, req_id: int, started: float, fields: tuple[Any, ...]) -> None:
        self.conn = conn
        self.req_id = req_id
        self.started = started
        (
            self.replica,
            self.uid,
            self.step,
            self.ask,
            self.host,
            self.min_replicas,
            self.join_timeout,
            self.renew,
        ) = fields
        self.waiting = True  # the timer protocol (_model.Effects.push_timer)


class _Tick:
    """A forming quorum's next decision time (a timer item; superseded ones stop waiting)."""

    __slots__ = ("jq", "waiting")

    def __init__(self, jq: JobQuorum) -> None:
        self.jq = jq
        self.waiting = True


class JobQuorum:
    """One job's quorum state: the asks gathering, the previous quorum, who was seen where."""

    __slots__ = ("asks", "first_at", "gone", "job", "last", "next_id", "seen", "tick")

    def __init__(self, job: Job) -> None:
        self.job = job
        self.asks: dict[str, Ask] = {}
        self.first_at = 0.0
        # The previous quorum: {"id", "members": [[replica, uid, step, host, ask], ...]}, or None.
        self.last: dict[str, Any] | None = None
        self.next_id = 1
        self.seen: dict[str, Conn] = {}  # replica -> the connection it last asked on (still open)
        self.gone: dict[str, str] = {}  # replica -> why it is gone (its connection closed)
        self.tick: _Tick | None = None
        raw = job.kv.get(QUORUM_KEY)
        if raw is not None:
            record = msgpack.unpackb(bytes(raw), raw=False)
            self.last = {"id": record["id"], "members": record["members"]}
            self.next_id = record["next"]


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
        self._by_conn: dict[int, list[tuple[JobQuorum, str]]] = {}  # conn id -> (job, replica)

    def handlers(self) -> dict[str, Any]:
        return {"quorum": self.op_quorum}

    def _of(self, job: Job) -> JobQuorum:
        jq = self.jobs.get(job.name)
        if jq is None or jq.job is not job:
            jq = self.jobs[job.name] = JobQuorum(job)
        return jq

    # ------------------------------------------------------------------ requests
    def op_quorum(self, conn: Conn, req_id: int, h: dict[str, Any], payload: memoryview) -> None:
        fields = (
            _text(h.get("replica"), "replica"),
            _text(h.get("uid"), "uid", 64),
            _count(h.get("step"), "step", 0, 1 << 62),
            _count(h.get("ask"), "ask", 0, 1 << 62),
            _text(h.get("host") or "?", "host"),
            _count(h.get("min_replicas", 1), "min_replicas", 1, MAX_REPLICAS),
            timeout_field(h.get("join_timeout", DEFAULT_JOIN_TIMEOUT)),
            h.get("renew") is True,
        )
        timeout = timeout_field(h.get("timeout"))
        now = self.fx.started
        jq = self._of(conn.job)
        a = Ask(conn, req_id, now, fields)
        if a.join_timeout is None:
            raise Refused(ERR_INVALID, "quorum: 'join_timeout' must be a number of seconds")
        last = jq.last
        if last is not None and not a.renew:
            for m in last["members"]:
                if m[0] == a.replica and m[1] == a.uid and m[4] == a.ask and m[2] == a.step:
                    # This ask formed the previous quorum already: its reply was lost with a link
                    # (a coordinator restart); the same answer again.
                    self._note(jq, a.replica, conn)
                    self.fx.reply(conn, req_id, "quorum", now, self._reply(req_id, last, a.replica, []))
                    return
        others = jq.asks
        if others:
            first = next(iter(others.values()))
            if (a.min_replicas, a.join_timeout) != (first.min_replicas, first.join_timeout):
                raise Refused(
                    ERR_INVALID,
                    f"quorum: replica {a.replica!r} asked with min_replicas={a.min_replicas}, "
                    f"join_timeout={a.join_timeout:g} but replica {first.replica!r} with "
                    f"min_replicas={first.min_replicas}, join_timeout={first.join_timeout:g}; give every "
                    f"replica's Manager the same settings",
                )
        old = others.pop(a.replica, None)
        if old is not None:
            old.waiting = False  # its connection is open: a closed one's asks were dropped
            self.fx.fail(
                old.conn.id,
                old.req_id,
                "quorum",
                now,
                ERR_INVALID,
                f"quorum: replaced by a newer ask of replica {a.replica!r} (from {conn.peer})",
            )
        elif len(others) >= MAX_REPLICAS:
            raise Refused(
                ERR_INVALID, f"quorum: job {conn.job.name!r} already has {MAX_REPLICAS} replicas asking"
            )
        if not others:
            jq.first_at = now
        others[a.replica] = a
        self._note(jq, a.replica, conn)
        if timeout is not None:
            self.fx.push_timer(now + timeout, a, self._expire_ask)
        self._consider(jq, now)

    def _note(self, jq: JobQuorum, replica: str, conn: Conn) -> None:
        """``replica`` was heard on ``conn``: it is there, and gone when that connection closes."""
        jq.gone.pop(replica, None)
        if jq.seen.get(replica) is not conn:
            jq.seen[replica] = conn
            self._by_conn.setdefault(conn.id, []).append((jq, replica))

    # ------------------------------------------------------------------ deciding
    def _absent(self, jq: JobQuorum, replica: str, now: float) -> str | None:
        """Why ``replica`` (of the previous quorum, not asking) is not waited for; None: wait."""
        why = jq.gone.get(replica)
        if why is not None:
            return why
        conn = jq.seen.get(replica)
        if conn is None:
            return None  # not seen since this coordinator started: maybe still coming
        silent = now - conn.last_seen
        limit = self.heartbeat_timeout()
        if silent > limit:
            return f"its connection ({conn.peer}) was silent for {silent:.1f}s (heartbeat timeout {limit:g}s)"
        return None

    def _consider(self, jq: JobQuorum, now: float) -> None:
        """Form the job's quorum if it may form now; otherwise arm the next decision time."""
        if jq.tick is not None:
            jq.tick.waiting = False
            jq.tick = None
        asks = jq.asks
        if not asks:
            return
        first = next(iter(asks.values()))
        if len(asks) < first.min_replicas:
            return  # only another ask can change that (or the asks' own timeouts)
        waited: list[str] = []
        left: list[list[str]] = []
        last = jq.last
        if last is not None:
            for m in last["members"]:
                if m[0] in asks:
                    continue
                why = self._absent(jq, m[0], now)
                if why is None:
                    waited.append(m[0])
                else:
                    left.append([m[0], m[3], why])
            if not waited:
                self._form(jq, left, now)
                return
        window = jq.first_at + first.join_timeout
        if now >= window:
            for r in waited:
                assert last is not None
                host = next(m[3] for m in last["members"] if m[0] == r)
                left.append([r, host, f"did not ask within the join window ({first.join_timeout:g}s)"])
            self._form(jq, left, now)
            return
        due = window
        limit = self.heartbeat_timeout()
        for r in waited:
            conn = jq.seen.get(r)
            if conn is not None:
                due = min(due, conn.last_seen + limit + 0.001)
        jq.tick = _Tick(jq)
        self.fx.push_timer(due, jq.tick, self._expire_tick)

    def _expire_tick(self, tick: _Tick) -> None:
        tick.waiting = False
        if tick.jq.tick is tick:
            tick.jq.tick = None
            self._consider(tick.jq, self.fx.clock())

    def _expire_ask(self, a: Ask) -> None:
        a.waiting = False
        jq = self._of(a.conn.job)
        if jq.asks.get(a.replica) is not a:
            return
        del jq.asks[a.replica]
        now = self.fx.clock()
        asked = [a, *sorted(jq.asks.values(), key=lambda other: other.replica)]
        named = ", ".join(f"{other.replica} (host {other.host})" for other in asked)
        detail = f"{len(asked)} of at least {a.min_replicas} replicas asked ({named})"
        if jq.last is not None:
            waited = [
                f"{m[0]} (host {m[3]})"
                for m in jq.last["members"]
                if m[0] not in jq.asks and m[0] != a.replica
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

    def _form(self, jq: JobQuorum, left: list[list[str]], now: float) -> None:
        asks = sorted(jq.asks.values(), key=lambda a: a.replica)
        jq.asks = {}
        last = jq.last
        ident = [[a.replica, a.uid] for a in asks]
        same = last is not None and ident == [m[:2] for m in last["members"]]
        if same and not any(a.renew for a in asks):
            assert last is not None
            qid = last["id"]
        else:
            qid = jq.next_id
            jq.next_id += 1
        record = {"id": qid, "members": [[a.replica, a.uid, a.step, a.host, a.ask] for a in asks]}
        jq.last = record
        self._persist(jq)
        steps = [a.step for a in asks]
        log.info(
            "job=%s event=quorum id=%d members=%s steps=%s left_out=%s heal=%s",
            jq.job.name,
            qid,
            [a.replica for a in asks],
            steps,
            [entry[0] for entry in left],
            heal_plan(steps),
        )
        for a in asks:
            a.waiting = False
            self.fx.reply(
                a.conn, a.req_id, "quorum", a.started, self._reply(a.req_id, record, a.replica, left)
            )

    def _persist(self, jq: JobQuorum) -> None:
        assert jq.last is not None
        value = msgpack.packb({"id": jq.last["id"], "next": jq.next_id, "members": jq.last["members"]})
        self.kv._put(jq.job, QUORUM_KEY, value)

    @staticmethod
    def _reply(req_id: int, record: dict[str, Any], replica: str, left: list[list[str]]) -> dict[str, Any]:
        members = record["members"]
        steps = [m[2] for m in members]
        return {
            "id": req_id,
            "ok": True,
            "quorum_id": record["id"],
            "members": [[m[0], m[2], m[3]] for m in members],
            "index": next(i for i, m in enumerate(members) if m[0] == replica),
            "max_step": max(steps),
            "heal": heal_plan(steps),
            "left": left,
        }

    # ------------------------------------------------------------------ connections
    def disconnect(self, conn: Conn, reason: str) -> None:
        """A connection closed: its asks are dropped, and the replicas it spoke for are gone."""
        entries = self._by_conn.pop(conn.id, None)
        if not entries:
            return
        now = self.fx.clock()
        touched: list[JobQuorum] = []
        for jq, replica in entries:
            if jq.seen.get(replica) is not conn:
                continue  # it asked again on another connection since
            del jq.seen[replica]
            jq.gone[replica] = f"its connection ({conn.peer}) closed: {reason}"
            a = jq.asks.get(replica)
            if a is not None and a.conn is conn:
                a.waiting = False
                del jq.asks[replica]
            if jq not in touched:
                touched.append(jq)
        for jq in touched:
            if not jq.seen and not jq.asks:
                # Nobody of this job is here: forget it (its durable record stays in the key
                # space, read again when a replica next asks).
                if self.jobs.get(jq.job.name) is jq:
                    del self.jobs[jq.job.name]
                if jq.tick is not None:
                    jq.tick.waiting = False
                continue
            self._consider(jq, now)
