"""A coordinator store client on a blocking socket, called from any thread: what
``aiocoll.sync.TCPStore`` uses, so that a torch script's store calls cost a system call or two and
no hop to an event-loop thread.

May import foundations only (protocol, stores, _errors, _deadline) and client modules without an
event loop (_store_core, _blocking).

The bookkeeping is the async session's (client/control/_store_core.py): the same compact requests, the
same promises (docs/COORDINATOR.md): a set is sent at once and not answered; any later reply
acknowledges it; a refused one is raised by the first call that starts after the refusal was
read, at the latest by ``flush`` or ``close``. A set goes out at once when the client has sent
nothing for 100 µs; the sets of a burst are held back and go out together (one ``send``) within
100 µs of the first, from a flusher thread, or sooner with this client's next request, ``flush``
or ``close``, and when the interpreter exits.

Threads. Requests are written under one lock, so frames never interleave and ids go out in
order. One thread at a time reads the socket (the one that waits for a reply and found no other
reader); it hands the replies it reads to the threads they belong to. So a thread blocked in
``get`` does not keep another from setting the key it waits for.

Reconnection. A broken connection is replaced by whichever thread finds it broken, with backoff,
for up to the client's timeout; the unsettled sets go first on the new connection, then each
waiting thread sends its request again (a mutation with its number: not applied twice).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from aiocoll._deadline import Deadline, to_seconds
from aiocoll._errors import AuthenticationError, ProtocolError, StoreError, StoreTimeout
from aiocoll._net import host_port
from aiocoll.protocol import CONTROL_READ_SIZE, ClientHandshake, FrameDecoder
from aiocoll.protocol._coordinator import CID_BYTES, ROLE_STORE
from aiocoll.protocol._store import (
    MUTATIONS,
)
from aiocoll.stores import DEFAULT_TIMEOUT
from aiocoll.stores._base import Value

from ._blocking import connect_blocking
from ._link_keeper import ConnectTries
from ._store_core import SYNC_AFTER, Request, StoreCore, requests

__all__ = ["BlockingStoreClient"]

log = logging.getLogger("aiocoll.client")
# Clients whose held-back sets go out when the interpreter exits normally.
_OPEN: weakref.WeakSet[BlockingStoreClient] = weakref.WeakSet()


@atexit.register
def _send_held_at_exit() -> None:
    for client in list(_OPEN):
        with contextlib.suppress(Exception), client._lock:
            if client._sock is not None:
                client._send_held()


_READ_SIZE = 256 * 1024
# A set within this long of the last send is held back, to go out with the rest of its burst.
_BATCH_WINDOW = 100e-6
_BATCH_BYTES = 64 * 1024
_MAX_HEADER = 16 << 20
_MAX_PAYLOAD = 512 << 20


def _set_timeval(sock: socket.socket, option: int, seconds: float) -> None:
    """A kernel-kept send or receive timeout (0: none)."""
    whole = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, int((seconds - whole) * 1e6)))


class BlockingStoreClient:
    """One connection to a coordinator's key space for ``job``, usable from any thread.

    Args:
        host, port: the coordinator. token: the shared secret. job: the key space.
        timeout: seconds for connecting and reconnecting, and the default wait of every call.

    Raises:
        CoordinatorUnreachable: nothing answered in time. AuthenticationError: another token.
        ProtocolError: not an aiocoll coordinator.
    """

    def __init__(
        self, host: str, port: int, *, token: str | bytes | None, job: str, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.host = host
        self.port = int(port)
        self.job = job
        self.timeout = float(timeout)
        self._token = token
        self._cid = os.urandom(CID_BYTES)
        self._core = StoreCore(job, host_port(host, self.port))
        # One lock for the socket's requests and the bookkeeping (taken as ``with self._lock``:
        # a C call, where the Condition's __enter__ is a Python one), and a condition on it for
        # the threads that wait while another reads.
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(
            max_header=_MAX_HEADER, max_payload=_MAX_PAYLOAD, read_size=CONTROL_READ_SIZE, lists=True
        )
        self._generation = 0  # grows with each connection: a waiter on an older one sends again
        self._reading = False  # a thread is reading the socket for everyone
        self._waiting: set[int] = set()  # ids whose threads wait while another thread reads
        self._done: dict[int, tuple[list[Any], bytes]] = {}  # replies read for other threads
        self._closed = False
        # Sets held back in a burst (see _mutate), and the thread that sends them.
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._last_send = 0.0
        self._flush_due = False
        self._flusher: threading.Thread | None = None
        self._wake_flusher = threading.Event()
        with self._lock:
            self._reconnect(Deadline(self.timeout), first=True)
        _OPEN.add(self)

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    # -- connection (callers hold self._cv)
    def _reconnect(self, deadline: Deadline, first: bool = False) -> None:
        """A new connection (the old one closed), with the unsettled sets sent first on it."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        tries = ConnectTries(self.host, self.port, first=first)
        while True:
            if self._closed:
                raise StoreError(f"the store client of {self.address} was closed")
            attempt = tries.attempt_time(deadline)
            handshake = ClientHandshake(self._token, role=ROLE_STORE, job=self.job, extra={"cid": self._cid})
            try:
                sock = connect_blocking((self.host, self.port), handshake, attempt, silence=tries.silence)
                break
            except (OSError, AuthenticationError, ProtocolError) as exc:
                pause = tries.failed(exc, deadline)
            time.sleep(pause)
        # Blocking mode, and the kernel keeps the deadlines (SO_SNDTIMEO, SO_RCVTIMEO): a Python
        # socket timeout costs a poll() before every send and recv and an ioctl each time it is
        # changed; these cost one setsockopt when a deadline's tenth of a second changes.
        sock.settimeout(None)
        _set_timeval(sock, socket.SO_SNDTIMEO, self.timeout)
        self._recv_limit = -1.0
        self._decoder = FrameDecoder(
            max_header=_MAX_HEADER, max_payload=_MAX_PAYLOAD, read_size=CONTROL_READ_SIZE, lists=True
        )
        self._sock = sock
        self._generation += 1
        self._held.clear()  # unsettled, so among what the reconnect sends first
        self._held_bytes = 0
        lost = b"".join(self._core.reconnected())
        if lost:
            sock.sendall(lost)
        # Replies already read stay in ``_done``: they answer their requests, whatever link
        # came since. The waiters of the old connection whose reply did not come send again.
        self._cv.notify_all()

    # -- requests
    def _mutate(self, req: Request) -> None:
        """SET, APPEND, MSET: not answered (see the module's docstring). Sent at once when this
        client sent nothing for _BATCH_WINDOW; else held back with the others of a burst, to go
        out together within _BATCH_WINDOW (the flusher thread), or before this client's next
        request, flush or close, or once _BATCH_BYTES are waiting."""
        core = self._core
        with self._lock:
            if core.deferred is not None:
                core.raise_deferred()
            if not core.window_open():
                self._send_held()
                self._make_room(Deadline(self.timeout), req.op, req.keys)
            _, frame = core.mutation(req.code, req.fields, req.payload, req.keys, self.timeout, False)
            if core.no_reply_unsettled >= SYNC_AFTER and not core.sync_in_flight:
                core.sync_in_flight, sync = core.sync_frame()
                frame += sync  # it settles everything before it
            now = time.monotonic()
            held = self._held
            if held or now - self._last_send < _BATCH_WINDOW:
                held.append(frame)
                self._held_bytes += len(frame)
                if self._held_bytes >= _BATCH_BYTES:
                    self._send_held()
                elif not self._flush_due:
                    self._flush_due = True
                    self._start_flusher()
                return
            self._last_send = now
            sock = self._sock
            if sock is not None:
                try:
                    sock.sendall(frame)
                    return
                except OSError:
                    pass
            # A reconnect sends the unsettled sets, this one among them, first on the new link.
            self._reconnect(Deadline(self.timeout))

    def _send_held(self, before: bytes = b"") -> bytes:
        """Holding the lock: the held-back frames, with ``before`` behind them; sent now when
        ``before`` is empty, else returned to go out in the caller's one send."""
        held = self._held
        if not held:
            return before
        frames = b"".join(held) + before
        held.clear()
        self._held_bytes = 0
        self._last_send = time.monotonic()
        if before:
            return frames
        sock = self._sock
        if sock is not None:
            try:
                sock.sendall(frames)
                return b""
            except OSError:
                pass
        self._reconnect(Deadline(self.timeout))  # they are unsettled: it sends them first
        return b""

    def _start_flusher(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name="aiocoll-store-flush", daemon=True)
            self._flusher.start()
        self._wake_flusher.set()

    def _flush_loop(self) -> None:
        """Send what a burst of sets held back, _BATCH_WINDOW after its first (the main thread
        may hold the GIL longer: the interpreter's switch interval is the bound then)."""
        while True:
            self._wake_flusher.wait()
            self._wake_flusher.clear()
            if self._closed:
                return
            time.sleep(_BATCH_WINDOW)
            with self._lock:
                self._flush_due = False
                if self._sock is not None and not self._closed:
                    try:
                        self._send_held()
                    except Exception:  # reconnecting failed: the next call raises it
                        log.exception("the store client of %s could not send its held sets", self.address)

    def _make_room(self, deadline: Deadline, op: str, keys: Sequence[str]) -> None:
        """Holding the lock: read replies until one more mutation may be numbered."""
        core = self._core
        while not core.window_open():
            if not core.sync_in_flight:
                sock = self._sock
                if sock is None:
                    self._reconnect(deadline)
                    continue
                core.sync_in_flight, frame = core.sync_frame()
                try:
                    sock.sendall(self._send_held(frame) if self._held else frame)
                except OSError:
                    self._reconnect(deadline)  # which forgets the SYNC: the loop sends another
                    continue
            if self._reading:
                if not self._cv.wait(deadline.remaining()):
                    raise self._window_timeout(deadline, op, keys)
                continue
            self._reading = True
            try:
                self._read_once(deadline.remaining(), 0)
            except TimeoutError:
                if deadline.expired():
                    raise self._window_timeout(deadline, op, keys) from None
            except OSError:
                self._reconnect(deadline)
            finally:
                self._reading = False
                self._cv.notify_all()

    def _window_timeout(self, deadline: Deadline, op: str, keys: Sequence[str]) -> StoreTimeout:
        return self._core.window_timeout(op, keys, deadline.timeout)

    def _request(self, req: Request, timeout: float | None = None) -> Any:
        """One request that has a reply; returns what its reply means (sent again on a new
        connection if needed)."""
        core = self._core
        seconds = self.timeout if timeout is None else timeout
        until = time.monotonic() + seconds
        mutation = req.code in MUTATIONS
        with self._lock:
            if core.deferred is not None:
                core.raise_deferred()
            if mutation and not core.window_open():
                self._make_room(Deadline(seconds), req.op, req.keys)
            req_id = 0
            try:
                while True:
                    sock = self._sock
                    if sock is None:
                        self._reconnect(Deadline(max(0.0, until - time.monotonic())))
                        continue
                    # Numbered as it goes out, the link's order being what settles (_store_core).
                    now = time.monotonic()
                    left = max(0.0, until - now)
                    req_id, frame, bound = core.encode(req, req_id if mutation else 0, seconds, left)
                    try:
                        sock.sendall(self._send_held(frame) if self._held else frame)
                    except OSError:
                        self._reconnect(Deadline(max(0.0, until - time.monotonic())))
                        continue
                    try:
                        reply = self._await(req_id, now + bound)
                    except TimeoutError:
                        raise core.timed_out(req.op, seconds, req.waits, req.keys, False) from None
                    if reply is not None:
                        break
                    if self._closed:
                        raise StoreError(f"{req.op}: the store client of {self.address} was closed")
            except BaseException:
                if mutation and req_id in core.unsettled:
                    self._abandon(req_id)
                raise
        return core.outcome(req, reply[0], reply[1], seconds)

    def _abandon(self, req_id: int) -> None:
        """Holding the lock: nobody awaits mutation ``req_id`` any more (see StoreCore.forget);
        one the current connection has not carried goes out now."""
        frame = self._core.forget(req_id)
        sock = self._sock
        if frame is not None and sock is not None:
            self._core.resent(req_id)
            with contextlib.suppress(OSError):  # a reconnect sends it first
                sock.sendall(self._send_held(frame) if self._held else frame)

    def _await(self, req_id: int, until: float) -> tuple[list[Any], bytes] | None:
        """Holding the lock: until request ``req_id``'s reply is read, by this thread or by the
        one reading for everyone. None: the connection was replaced; send it again.

        Raises:
            TimeoutError: ``until`` (time.monotonic) passed first.
        """
        cv = self._cv
        done = self._done
        generation = self._generation
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if self._reading:  # another thread reads: it files our reply in ``done``
                self._waiting.add(req_id)
                try:
                    cv.wait(left)
                finally:
                    self._waiting.discard(req_id)
                reply = done.pop(req_id, None)
                if reply is not None:
                    return reply
                if self._generation != generation:
                    return None
                continue
            self._reading = True
            try:
                reply = self._read_once(left, req_id)
            except TimeoutError:
                continue  # the kernel's timeout is rounded: the loop's check decides
            except OSError:
                if self._generation == generation:  # else another thread replaced it already
                    self._reconnect(Deadline(max(0.0, until - time.monotonic())))
                return None
            finally:
                self._reading = False
                if cv._waiters:  # type: ignore[attr-defined]  # someone waits: maybe for what was read
                    cv.notify_all()
            if reply is not None:
                return reply
            if self._generation != generation:  # replaced while we read: send it again
                return None

    def _read_once(self, timeout: float | None, mine: int) -> tuple[list[Any], bytes] | None:
        """Holding the lock (released while blocked in recv): read what arrives and settle it.
        Returns the reply to request ``mine`` if it came; files the others' replies in ``done``.

        Raises:
            TimeoutError: nothing arrived within ``timeout``. OSError: the connection broke.
        """
        sock = self._sock
        assert sock is not None
        cv = self._cv
        limit = 0.0 if timeout is None else max(0.1, -(-timeout // 0.1) * 0.1)  # tenths, rounded up
        if limit != self._recv_limit:
            _set_timeval(sock, socket.SO_RCVTIMEO, limit)
            self._recv_limit = limit
        cv.release()
        try:
            data = sock.recv(_READ_SIZE)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            raise TimeoutError from None
        finally:
            cv.acquire()
        if self._sock is not sock:
            return None  # another thread replaced the connection meanwhile: these bytes are the old one's
        if not data:
            raise ConnectionResetError(f"the coordinator at {self.address} closed the connection")
        settle = self._core.settle
        found = None
        for header, payload in self._decoder.feed_messages(data):
            if type(header) is not list:
                continue  # an event: a store connection has no use for one
            settle(header, payload)
            req_id = header[0]
            if req_id == mine:
                found = (header, payload)
            elif req_id in self._waiting:
                self._done[req_id] = (header, payload)
        return found

    # -- the store's operations (torch's names; the sync facade's TCPStore forwards here)
    def set(self, key: str, value: Value) -> None:
        self._mutate(requests.set(key, value))

    def append(self, key: str, value: Value) -> None:
        self._mutate(requests.append(key, value))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._mutate(requests.multi_set(keys, values))

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """The default wait of every call (torch's ``set_timeout``)."""
        seconds = to_seconds(timeout)
        if seconds is None or seconds <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self.timeout = seconds

    def get(self, key: str, timeout: float | datetime.timedelta | None = None) -> bytes:
        result: bytes = self._request(requests.get(key), to_seconds(timeout))
        return result

    def add(self, key: str, amount: int) -> int:
        result: int = self._request(requests.add(key, amount))
        return result

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        result: bytes = self._request(requests.compare_set(key, expected, desired))
        return result

    def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        self._request(requests.wait(keys), to_seconds(timeout))

    def check(self, keys: Sequence[str]) -> bool:
        result: bool = self._request(requests.check(keys))
        return result

    def delete_key(self, key: str) -> bool:
        result: bool = self._request(requests.delete_key(key))
        return result

    def num_keys(self) -> int:
        result: int = self._request(requests.num_keys())
        return result

    def multi_get(
        self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None
    ) -> list[bytes]:
        result: list[bytes] = self._request(requests.multi_get(keys), to_seconds(timeout))
        return result

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every set of this client is acknowledged (with --state-dir: on disk).

        Raises:
            StoreError, StoreTimeout: one was refused (raised once), or no answer came in time.
        """
        core = self._core
        if core.no_reply_unsettled:
            seconds = self.timeout if timeout is None else timeout
            try:
                self._request(requests.sync(), seconds)
            except StoreTimeout:
                raise core.flush_timeout(seconds) from None
        with self._lock:
            exc = core.take_deferred()
        if exc is not None:
            raise exc

    def close(self) -> None:
        """Flush (raising a refusal not yet raised), then close. Twice is fine."""
        if self._closed:
            return
        try:
            if self._sock is not None and (self._core.no_reply_unsettled or self._core.deferred is not None):
                self.flush()
        finally:
            with self._lock:
                self._closed = True
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
                self._cv.notify_all()
            self._wake_flusher.set()  # it sees the close and ends
            _OPEN.discard(self)
