"""The beat thread: heartbeats and progress reports that do not depend on the event loop.

May import foundations only (aiocoll.protocol, aiocoll._errors); never the public surface. Blocking
sockets on a thread of its own; it shares nothing with the loop but the report callable.

Why a thread with its own connection: liveness is not responsiveness. A worker whose event loop
is busy for longer than the heartbeat timeout (a long CPU step on the loop thread) is alive and
must stay a member; a frozen (SIGSTOP) or dead process falls silent on both of its connections and
is still declared lost within the timeout. The thread authenticates with the job's token like any
connection (hello role ROLE_BEAT, with the member's session id, covered by the proofs), and may
only send ``hb``, ``progress`` and ``stack``: when the coordinator pushes EV_STACK (`aiocoll
status --stacks`, the web page), it answers with this process's Python stack
(client/_stacks.py) at once, between two looks at the report, whatever the event loop does.
Each heartbeat's reply carries the coordinator's wall clock, a sample for this process's estimate
of its clock offset (client/_clock.py).
The CPython thread switch interval (5 ms) lets it run while the loop thread computes in
Python; C code that holds the GIL for seconds would starve it too.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from aiocoll._errors import AuthenticationError, ProtocolError
from aiocoll.protocol import ClientHandshake, FrameDecoder, encode_frame
from aiocoll.protocol._coordinator import EV_STACK, HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, ROLE_BEAT

from .._clock import ClockEstimate, estimate
from .._stacks import current_stack
from ._blocking import connect_blocking

__all__ = ["BeatThread"]

log = logging.getLogger("aiocoll.client.beat")

_CONNECT_TIMEOUT = 5.0
_REPLY_TIMEOUT = HEARTBEAT_TIMEOUT / 2
_BACKOFF_MAX = 2.0
_MAX_REPLY = 64 * 1024

Report = Callable[[bool], "dict[str, Any] | None"]


class BeatThread:
    """Beats for one member on a connection of its own, and sends its progress reports.

    Args:
        host, port: the coordinator. token: the shared secret. job: the job id.
        session: the member's session id (from the join reply). rank: for log lines.
        report: ``report(full)`` returns a progress report's fields, or None (ProgressTracker.report).
        interval: seconds between heartbeats. check_every: seconds between looks at ``report``.
        stack: this process's stack (client/_stacks.py). clock: where the heartbeats' samples
            of the coordinator's clock go (client/_clock.py; default: this process's estimate).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | bytes | None,
        job: str,
        session: str,
        rank: int,
        report: Report,
        interval: float = HEARTBEAT_INTERVAL,
        check_every: float = 0.5,
        stack: Callable[[], list[dict[str, Any]]] = current_stack,
        clock: ClockEstimate | None = None,
    ) -> None:
        self._address = (host, port)
        self._token = token
        self._job = job
        self._session = session
        self._rank = rank
        self._report = report
        self._stack = stack
        self._clock = clock if clock is not None else estimate()
        self._asked: list[Any] = []  # stack requests pushed by the coordinator, not yet answered
        self._interval = interval
        self._check_every = min(check_every, interval)
        self._stopping = threading.Event()
        self._sock: socket.socket | None = None
        self._next_id = 0
        self.beats = 0
        self._thread = threading.Thread(target=self._run, name=f"aiocoll-beat-rank{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and close the connection (the coordinator declares nothing for it)."""
        self._stopping.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        # Called on the event loop: wait briefly, never long (a thread stuck connecting to a dead
        # coordinator ends by itself; it is a daemon and beats for nobody once stopping is set).
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=0.5)

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopping.is_set():
            try:
                sock, decoder = self._connect()
            except (OSError, ProtocolError, AuthenticationError) as exc:
                log.debug("rank %d: beat connection failed: %s; retrying", self._rank, exc)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
                continue
            self._sock = sock
            answered = self.beats
            try:
                self._beat(sock, decoder)
            except (OSError, ProtocolError, TimeoutError) as exc:
                if not self._stopping.is_set():
                    log.debug("rank %d: beat connection lost: %s; reconnecting", self._rank, exc)
            finally:
                self._sock = None
                sock.close()
            # Back off afresh only after a connection that carried beats: one the coordinator
            # closes right after the handshake (it no longer counts this member) is retried ever
            # more slowly, not ten times a second.
            if self.beats > answered:
                backoff = 0.1
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, _BACKOFF_MAX)

    def _connect(self) -> tuple[socket.socket, FrameDecoder]:
        handshake = ClientHandshake(
            self._token, role=ROLE_BEAT, job=self._job, extra={"session": self._session}
        )
        sock = connect_blocking(self._address, handshake, _CONNECT_TIMEOUT)
        sock.settimeout(_REPLY_TIMEOUT)
        return sock, FrameDecoder(max_header=_MAX_REPLY, max_payload=0)

    def _beat(self, sock: socket.socket, decoder: FrameDecoder) -> None:
        last_beat = 0.0
        want = False
        while not self._stopping.is_set():
            wait = self._check_every if last_beat and not want and not self._asked else 0.0
            # Sleep until the next look, or until the coordinator pushes a stack request.
            if wait > 0 and select.select([sock], [], [], wait)[0]:
                self._take_events(sock, decoder)
            if self._stopping.is_set():
                return
            while self._asked:  # answered without waiting for the reply (read and dropped later)
                query = self._asked.pop(0)
                self._send(sock, {"op": "stack", "q": query, "frames": self._stack()})
            report = self._report(want)
            now = time.monotonic()
            if report is not None:
                reply = self._request(sock, decoder, {"op": "progress", **report})
                want = False
                if not reply.get("ok", False):
                    log.debug("rank %d: progress report refused: %s", self._rank, reply.get("msg"))
            elif now - last_beat >= self._interval:
                reply = self._heartbeat(sock, decoder)
                want = reply.get("want") is True
            else:
                continue
            last_beat = now
            self.beats += 1

    def _heartbeat(self, sock: socket.socket, decoder: FrameDecoder) -> dict[str, Any]:
        """One heartbeat. Its reply carries the coordinator's wall clock: a sample of this host's
        clock offset (client/_clock.py)."""
        sent = time.time()
        reply = self._request(sock, decoder, {"op": "hb"})
        received = time.time()
        coordinator = reply.get("t")
        if isinstance(coordinator, (int, float)) and not isinstance(coordinator, bool):
            self._clock.sample(sent, float(coordinator), received)
        return reply

    def _send(self, sock: socket.socket, header: dict[str, Any]) -> int:
        self._next_id += 1
        req_id = header["id"] = self._next_id
        sock.sendall(b"".join(bytes(p) for p in encode_frame(header)))
        return req_id

    def _request(self, sock: socket.socket, decoder: FrameDecoder, header: dict[str, Any]) -> dict[str, Any]:
        req_id = self._send(sock, header)
        reply: dict[str, Any] | None = None
        while reply is None:
            data = sock.recv(65536)
            if not data:
                raise ConnectionResetError("the coordinator closed the beat connection")
            # Every frame of the read is handled: a stack request pushed right after the reply
            # can arrive in the same read, and the decoder does not hand it out again.
            for frame in decoder.feed(data):
                if reply is None and frame.header.get("id") == req_id:
                    reply = frame.header
                else:
                    self._on_event(frame.header)
        return reply

    def _take_events(self, sock: socket.socket, decoder: FrameDecoder) -> None:
        """Read what the coordinator pushed (the socket is readable: this does not block)."""
        data = sock.recv(65536)
        if not data:
            raise ConnectionResetError("the coordinator closed the beat connection")
        for frame in decoder.feed(data):
            self._on_event(frame.header)

    def _on_event(self, header: dict[str, Any]) -> None:
        if header.get("ev") == EV_STACK and len(self._asked) < 16:
            self._asked.append(header.get("q"))
