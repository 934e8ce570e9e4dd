"""The coordinator's key-value part: each job's keys, the requests waiting for keys, and the store
operations (set, get, add, cas, wait, check, del, nkeys, mget, mset, append, sync), in their
compact form (protocol._store). Sans-IO: decisions go into the shared Effects. Imports _model and
aiocoll foundations only.

Every mutation goes through ``_put``/``_delete``/``_append``, live and on replay, so a restored
key space equals the one that acknowledged the journal's records.
"""

from __future__ import annotations

from typing import Any

from aiocoll.protocol._coordinator import (
    ERR_INVALID,
    ERR_TIMEOUT,
    ERR_TOO_LARGE,
    SHORT_KEY_LENGTHS,
)
from aiocoll.protocol._store import ADD, APPEND, CAS, CHECK, DEL, GET, MGET, MSET, NKEYS, OK, SET, SYNC, WAIT

from ._model import (
    DONE,
    PARKED,
    Answer,
    Conn,
    Effects,
    Job,
    Record,
    Refused,
    StoreHandler,
    fmt_timeout,
    key_field,
    timeout_field,
)

__all__ = ["DEFAULT_MAX_KEYS_PER_JOB", "DEFAULT_MAX_VALUE_BYTES", "MAX_KEYS_PER_REQUEST", "KeyValue"]

DEFAULT_MAX_VALUE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_KEYS_PER_JOB = 1_000_000
MAX_KEYS_PER_REQUEST = 100_000
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class Waiter:
    """A get/wait/mget waiting for keys; completed by a set or expired by the clock."""

    __slots__ = ("conn", "deadline", "done", "keys", "op", "req_id", "started", "timeout")

    def __init__(
        self,
        conn: Conn,
        req_id: int,
        op: str,
        keys: list[str],
        deadline: float | None,
        started: float,
        timeout: float | None,
    ) -> None:
        self.conn = conn
        self.req_id = req_id
        self.op = op
        self.keys = keys
        self.deadline = deadline
        self.started = started
        self.timeout = timeout
        self.done = False

    @property
    def waiting(self) -> bool:
        return not self.done


def _keys_field(keys: object) -> list[str]:
    if not isinstance(keys, list):
        raise Refused(ERR_INVALID, f"'keys' must be a list of strings, got {type(keys).__name__}")
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise Refused(ERR_TOO_LARGE, f"{len(keys)} keys in one request; the limit is {MAX_KEYS_PER_REQUEST}")
    for k in keys:
        key_field(k)
    return keys


class KeyValue:
    """The store operations of every job.

    Args:
        fx: where decisions go. max_value_bytes: largest value (also the result of append).
        max_keys_per_job: most keys one job may hold.
    """

    def __init__(self, fx: Effects, *, max_value_bytes: int, max_keys_per_job: int) -> None:
        self.fx = fx
        self.max_value_bytes = max_value_bytes
        self.max_keys_per_job = max_keys_per_job

    def handlers(self) -> dict[int, tuple[str, StoreHandler]]:
        """The operations this part answers, by compact code (protocol._store): (name, handler)."""
        return {
            SET: ("set", self.op_set),
            GET: ("get", self.op_get),
            ADD: ("add", self.op_add),
            CAS: ("cas", self.op_cas),
            WAIT: ("wait", self.op_wait),
            CHECK: ("check", self.op_check),
            DEL: ("del", self.op_del),
            NKEYS: ("nkeys", self.op_nkeys),
            MGET: ("mget", self.op_mget),
            MSET: ("mset", self.op_mset),
            APPEND: ("append", self.op_append),
            SYNC: ("sync", self.op_sync),
        }

    # -- limits
    def _value(self, key: str, value: bytes | bytearray | memoryview) -> None:
        if len(value) > self.max_value_bytes:
            raise Refused(
                ERR_TOO_LARGE,
                f"value of {len(value)} bytes for key {key[:256]!r} exceeds the "
                f"coordinator's limit of {self.max_value_bytes} bytes (--max-value-bytes)",
                [key],
            )

    def _room(self, job: Job, new_keys: int, key: str) -> None:
        if new_keys and len(job.kv) + new_keys > self.max_keys_per_job:
            raise Refused(
                ERR_TOO_LARGE,
                f"job {job.name!r} already holds {len(job.kv)} keys; the limit "
                f"is {self.max_keys_per_job} (delete keys or raise the limit)",
                [key],
            )

    # -- mutations (shared by live requests and replay)
    def _put(self, job: Job, key: str, value: bytes | bytearray) -> None:
        job.kv[key] = value
        if self.fx.durable:
            self.fx.journal.append(["set", job.name, key, value])
        if key in job.waiters:
            self._wake(job, key)

    def _delete(self, job: Job, key: str) -> None:
        del job.kv[key]
        if self.fx.durable:
            self.fx.journal.append(["del", job.name, key])

    def _append(self, job: Job, key: str, data: bytes) -> None:
        old = job.kv.get(key)
        job.kv[key] = data if old is None else bytes(old) + data  # never mutate: a reply may hold it
        if self.fx.durable:
            self.fx.journal.append(["append", job.name, key, data])
        if key in job.waiters:
            self._wake(job, key)

    # -- persistence (its section of a snapshot, and its journal records)
    @staticmethod
    def snapshot(job: Job) -> dict[str, bytes | bytearray]:
        return job.kv

    @staticmethod
    def restore(job: Job, kv: dict[str, bytes | bytearray]) -> None:
        job.kv.update(kv)

    def apply(self, job: Job, rec: Record) -> bool:
        """Replay a key-value record (set, del, append); False when ``rec`` is not one."""
        kind = rec[0]
        if kind == "set":
            job.kv[rec[2]] = rec[3]
        elif kind == "del":
            job.kv.pop(rec[2], None)
        elif kind == "append":
            old = job.kv.get(rec[2])
            job.kv[rec[2]] = rec[3] if old is None else bytes(old) + rec[3]
        else:
            return False
        return True

    # -- waiting
    def _wake(self, job: Job, key: str) -> None:
        for w in job.waiters.pop(key, ()):
            if w.done:
                continue
            missing = [k for k in w.keys if k not in job.kv]
            if missing:  # another key it needs is still absent (or was deleted meanwhile)
                job.waiters.setdefault(missing[0], set()).add(w)
                continue
            self._finish(w)

    def _unpark(self, w: Waiter) -> None:
        w.done = True
        conn = w.conn
        conn.waiters.discard(w)
        job = conn.job
        for k in w.keys:  # unregister from every key it was parked on
            ws = job.waiters.get(k)
            if ws is not None:
                ws.discard(w)
                if not ws:
                    del job.waiters[k]

    def _finish(self, w: Waiter) -> None:
        self._unpark(w)
        conn = w.conn
        kv = conn.job.kv
        if w.op == "get":
            self.fx.reply(conn, w.req_id, "get", w.started, [w.req_id, OK], kv[w.keys[0]])
        elif w.op == "wait":
            self.fx.reply(conn, w.req_id, "wait", w.started, [w.req_id, OK])
        else:
            values = [kv[k] for k in w.keys]
            self.fx.reply(
                conn, w.req_id, "mget", w.started, [w.req_id, OK, [len(v) for v in values]], b"".join(values)
            )

    def _park(
        self, conn: Conn, req_id: int, op: str, keys: list[str], missing: list[str], timeout: float | None
    ) -> None:
        now = self.fx.clock()
        if timeout == 0:
            raise Refused(
                ERR_TIMEOUT, f"key(s) {missing!r} of job {conn.job.name!r} do not exist (timeout 0)", missing
            )
        deadline = None if timeout is None else now + timeout
        w = Waiter(conn, req_id, op, keys, deadline, now, timeout)
        conn.waiters.add(w)
        conn.job.waiters.setdefault(missing[0], set()).add(w)
        if deadline is not None:
            self.fx.push_timer(deadline, w, self._expire)

    def _expire(self, w: Waiter) -> None:
        job = w.conn.job
        missing = [k for k in w.keys if k not in job.kv]
        if not missing:  # raced: complete instead of failing
            self._finish(w)
            return
        self._unpark(w)
        self.fx.fail(
            w.conn.id,
            w.req_id,
            w.op,
            w.started,
            ERR_TIMEOUT,
            f"{w.op}: timed out after {fmt_timeout(w.timeout)} waiting for key(s) {missing[:16]!r} of "
            f"job {job.name!r}",
            missing,
            compact=True,
        )

    def drop(self, conn: Conn) -> None:
        """Forget the waits of a connection that closed."""
        job = conn.job
        for w in conn.waiters:
            w.done = True
            for key in w.keys:
                ws = job.waiters.get(key)
                if ws is not None:
                    ws.discard(w)
                    if not ws:
                        del job.waiters[key]
        conn.waiters.clear()

    # -- operations: each returns its answer (value, payload), DONE (applied, nothing to send)
    # or PARKED (the answer comes when the keys do); a refusal raises Refused.
    def op_set(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        key = h[3]
        if type(key) is not str or len(key) not in SHORT_KEY_LENGTHS:
            key = key_field(key)  # the full check, and its error
        job = conn.job
        if len(payload) > self.max_value_bytes:
            self._value(key, payload)
        if key not in job.kv:
            self._room(job, 1, key)
        self._put(job, key, payload)
        return DONE

    def op_get(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        key = h[2]
        if type(key) is not str or len(key) not in SHORT_KEY_LENGTHS:
            key = key_field(key)
        value = conn.job.kv.get(key)
        if value is not None:
            return None, value
        self._park(conn, req_id, "get", [key], [key], timeout_field(h[3]))
        return PARKED

    def op_add(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        key, amount = h[3], h[4]
        if type(key) is not str or len(key) not in SHORT_KEY_LENGTHS:
            key = key_field(key)
        if type(amount) is not int:
            raise Refused(
                ERR_INVALID,
                f"'amount' for key {key!r} must be an integer, got {type(amount).__name__}",
                [key],
            )
        job = conn.job
        old = job.kv.get(key)
        if old is None:
            self._room(job, 1, key)
            current = 0
        else:
            try:
                # int() of ASCII bytes accepts what int() of their text does; any other byte
                # fails as decoding would
                current = int(old)
            except ValueError:
                raise Refused(
                    ERR_INVALID,
                    f"key {key!r} holds a value that is not an integer "
                    f"({bytes(old[:32])!r}), so add cannot increment it",
                    [key],
                ) from None
        value = current + amount
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise Refused(
                ERR_INVALID, f"add would take key {key!r} to {value}, outside the 64-bit range", [key]
            )
        self._put(job, key, b"%d" % value)  # its ASCII digits, as str(value) spells them
        return value, b""

    def op_cas(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        key, split = key_field(h[3]), h[4]
        if type(split) is not int or not 0 <= split <= len(payload):
            raise Refused(
                ERR_INVALID,
                f"cas on key {key!r} needs the length of the expected value "
                f"(0..{len(payload)}), got {split!r}",
                [key],
            )
        expected, desired = payload[:split], payload[split:]
        self._value(key, desired)
        job = conn.job
        current = job.kv.get(key)
        if current is None:
            if expected:
                result: bytes | bytearray = expected
            else:
                self._room(job, 1, key)
                self._put(job, key, desired)
                result = desired
        elif current == expected:
            self._put(job, key, desired)
            result = desired
        else:
            result = current
        return None, result

    def op_wait(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        keys = _keys_field(h[2])
        timeout = timeout_field(h[3])
        missing = [k for k in keys if k not in conn.job.kv]
        if not missing:
            return None, b""
        self._park(conn, req_id, "wait", keys, missing, timeout)
        return PARKED

    def op_mget(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        keys = _keys_field(h[2])
        timeout = timeout_field(h[3])
        kv = conn.job.kv
        missing = [k for k in keys if k not in kv]
        if not missing:
            values = [kv[k] for k in keys]
            return [len(v) for v in values], b"".join(values)
        self._park(conn, req_id, "mget", keys, missing, timeout)
        return PARKED

    def op_check(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        kv = conn.job.kv
        return all(k in kv for k in _keys_field(h[2])), b""

    def op_del(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        key = key_field(h[3])
        job = conn.job
        existed = key in job.kv
        if existed:
            self._delete(job, key)
        return existed, b""

    def op_nkeys(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        return len(conn.job.kv), b""

    def op_sync(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        return None, b""  # its reply is the point: everything before it on the connection was applied

    def op_mset(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        keys, sizes = _keys_field(h[3]), h[4]
        if not (
            isinstance(sizes, list)
            and len(sizes) == len(keys)
            and all(type(s) is int and s >= 0 for s in sizes)
            and sum(sizes) == len(payload)
        ):
            raise Refused(
                ERR_INVALID,
                f"mset needs one size per key ({len(keys)} keys) adding up to the "
                f"payload's {len(payload)} bytes",
                keys[:16],
            )
        job = conn.job
        for k, size in zip(keys, sizes, strict=True):
            if size > self.max_value_bytes:
                raise Refused(
                    ERR_TOO_LARGE,
                    f"value of {size} bytes for key {k[:256]!r} exceeds the "
                    f"coordinator's limit of {self.max_value_bytes} bytes (--max-value-bytes)",
                    [k],
                )
        self._room(job, len({k for k in keys if k not in job.kv}), keys[0] if keys else "")
        pos = 0
        for k, size in zip(keys, sizes, strict=True):
            self._put(job, k, payload[pos : pos + size])
            pos += size
        return DONE

    def op_append(self, conn: Conn, req_id: int, h: list[Any], payload: bytes | bytearray) -> Answer:
        key = key_field(h[3])
        job = conn.job
        old = job.kv.get(key)
        if old is None:
            self._room(job, 1, key)
            size = len(payload)
        else:
            size = len(old) + len(payload)
        if size > self.max_value_bytes:
            raise Refused(
                ERR_TOO_LARGE,
                f"append would make key {key!r} {size} bytes, above the "
                f"coordinator's limit of {self.max_value_bytes} bytes",
                [key],
            )
        self._append(job, key, bytes(payload))
        return DONE
