"""The session's link to the coordinator, kept up: connecting with backoff, and reconnecting by
itself when the link drops, for as long as the session's timeout allows.

May import foundations only (protocol, _errors, _deadline) and client/control/_connection.py. The session
(session.py) owns one; what a new link must carry first (the mutations nobody awaits, sent again)
is the session's, through ``on_new_link``.

Authentication failures and "this is not a coordinator" are not retried: they raise at once,
saying what to do. What a failed attempt means (retry, after what pause, or give up saying why)
is decided in one place, ``ConnectTries``, for this keeper and for the blocking store client
(client/control/_blocking_store.py) alike.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from aiocoll._deadline import Deadline
from aiocoll._errors import AuthenticationError, DistError, ProtocolError, StoreError, chain
from aiocoll._net import host_port
from aiocoll.protocol import ClientHandshake
from aiocoll.protocol._handshake import SilentServer

from ._connection import CoordinatorLink, EventCallback, SettleCallback, open_link

__all__ = [
    "EV_COORDINATOR_LOST",
    "EV_RECONNECTED",
    "SILENCE",
    "SILENT_ATTEMPTS",
    "ConnectTries",
    "CoordinatorUnreachable",
    "LinkKeeper",
]

log = logging.getLogger("aiocoll.client")

# Events the session makes up itself (the coordinator's own are in protocol._coordinator).
EV_RECONNECTED = "reconnected"  # a new link is up after a drop
EV_COORDINATOR_LOST = "coordinator_lost"  # reconnecting ran out of time; "reason" says why

_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0
# One connect + handshake attempt; a paused or black-holed coordinator costs at most this.
_ATTEMPT_TIMEOUT = 10.0
# A coordinator sends its challenge in the loop turn that reads the hello, ahead of any queued
# work, so a server that accepts the connection and then says nothing for SILENCE seconds on
# SILENT_ATTEMPTS attempts in a row is something else (a torch TCPStore reads the hello and waits
# for more, forever). Measured here: 9,000 connections opened at once from one process against
# one coordinator, on two cores that two other processes kept busy: every hello answered within
# 2.2 s (median 1.7 s; 3,000 connections: 0.5 s). Longer than the 5 s after which the
# coordinator's own HTTP port answers bytes it cannot parse, so that port is named for what it is.
SILENCE = 6.0
SILENT_ATTEMPTS = 2
# A first connection that has found no coordinator for this long says so once (the timeout of a
# rendezvous may be half an hour, and a silent wait that long looks like a hang).
STILL_TRYING_AFTER = 5.0


class CoordinatorUnreachable(DistError):
    """No coordinator answered at host:port within the timeout (refused, unreachable, silent)."""


class ConnectTries:
    """What one connect loop learned from its failed attempts, and what it does next: retry after
    a pause (backoff with full jitter), or give up with an error that says why.

    Connection refusals, resets and timeouts are retried (a coordinator that is starting up
    refuses connections) until the deadline. A handshake verdict (AuthenticationError,
    ProtocolError) is raised as it is: it names the address and what to do, and retrying will not
    change it. On a first connection, a server that accepted and sent nothing for SILENCE seconds,
    SILENT_ATTEMPTS times in a row, is not a coordinator: ProtocolError. Once a coordinator has
    answered at this address, silence is that coordinator frozen or overloaded (stopped, paused by
    a debugger): reconnecting keeps trying until the deadline, with no silence limit.

    Args:
        host, port: where the coordinator should be. first: no coordinator answered this client
            at this address yet. still_trying: on a first connection, called once (with the
            failed attempts' last error) when no coordinator answered for STILL_TRYING_AFTER
            seconds and trying goes on.

    Attributes:
        silence: the silence limit each attempt passes to the opener (None: none).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        first: bool,
        still_trying: Callable[[str], None] | None = None,
    ) -> None:
        self.address = host_port(host, port)
        self.port = port
        self.silence = SILENCE if first else None
        self.attempts = 0
        self.silent = 0  # attempts in a row the server accepted and never answered
        self.last: BaseException | None = None
        self._delay = _BACKOFF_FIRST
        self._still_trying = still_trying if first else None
        self._began = time.monotonic()

    def attempt_time(self, deadline: Deadline) -> float:
        """Start an attempt: the seconds it may take."""
        self.attempts += 1
        remaining = deadline.remaining()
        return _ATTEMPT_TIMEOUT if remaining is None else max(min(remaining, _ATTEMPT_TIMEOUT), 0.05)

    def failed(self, exc: BaseException, deadline: Deadline) -> float:
        """The last attempt failed with ``exc``: the seconds to pause before the next one.

        Raises:
            AuthenticationError, ProtocolError: ``exc`` itself, or ProtocolError when the server
                was silent SILENT_ATTEMPTS times in a row. CoordinatorUnreachable: the deadline
                passed.
        """
        if isinstance(exc, (AuthenticationError, ProtocolError)):
            raise exc
        if isinstance(exc, SilentServer):
            self.silent += 1
            if self.silent >= SILENT_ATTEMPTS:
                raise ProtocolError(
                    f"{self.address} accepted the connection but did not answer aiocoll's handshake "
                    f"within {SILENCE:g}s, {self.silent} times in a row: it is not an aiocoll "
                    f"coordinator (a torch TCPStore, such as torchrun's on MASTER_PORT, behaves like "
                    f"this). Use the address of an aiocoll coordinator: the one `aiocoll coordinator "
                    f"--port P` serves, or launch the script with `aiocoll run`, which starts one"
                ) from None
        else:
            self.silent = 0
        self.last = exc
        remaining = deadline.remaining()
        if remaining is not None and remaining <= 0:
            last = self.last
            raise chain(
                CoordinatorUnreachable(
                    f"no aiocoll coordinator answered at {self.address} within {deadline.timeout:.3g}s "
                    f"({self.attempts} attempt{'s' if self.attempts > 1 else ''}; last: "
                    f"{str(last) or type(last).__name__}). Check that the coordinator runs there "
                    f"(aiocoll coordinator --port {self.port}) and that host and port are right, or "
                    f"raise the timeout"
                ),
                last,
            )
        if self._still_trying is not None and time.monotonic() - self._began >= STILL_TRYING_AFTER:
            tell, self._still_trying = self._still_trying, None
            until = "" if remaining is None else f" for {remaining:.0f}s more (the timeout)"
            tell(
                f"no aiocoll coordinator has answered at {self.address} for "
                f"{time.monotonic() - self._began:.0f}s ({self.attempts} attempts; last: "
                f"{str(exc) or type(exc).__name__}); trying{until}. Check that it runs there "
                f"(aiocoll coordinator --port {self.port})"
            )
        pause = random.uniform(0, self._delay)
        self._delay = min(self._delay * 2, _BACKOFF_MAX)
        return pause if remaining is None else min(pause, remaining)


class LinkKeeper:
    """One session's current link, and its reconnection.

    Args:
        host, port, job: where and for which job. timeout: how long (re)connecting may try.
        handshake: makes the hello for each attempt (it carries the session's ids).
        on_event: the coordinator's events, and the keeper's own (EV_RECONNECTED,
            EV_COORDINATOR_LOST). on_settle, next_id: handed to each link (CoordinatorLink).
        on_new_link: called with a new link after a reconnect, before anyone else may use it.
        describe: the session's name for log lines (its rank, once it has one).
    """

    def __init__(
        self,
        host: str,
        port: int,
        job: str,
        *,
        timeout: Callable[[], float | None],
        handshake: Callable[[], ClientHandshake],
        on_event: EventCallback,
        on_settle: SettleCallback,
        next_id: Callable[[], int],
        on_new_link: Callable[[CoordinatorLink], None],
        rank: Callable[[], int | None],
    ) -> None:
        self.host = host
        self.port = port
        self.job = job
        self._timeout = timeout
        self._handshake = handshake
        self._on_event = on_event
        self._on_settle = on_settle
        self._next_id = next_id
        self._on_new_link = on_new_link
        self._rank = rank
        self.link: CoordinatorLink | None = None
        self.changed = asyncio.Event()  # set (and replaced) each time the link comes or goes
        self.fatal: BaseException | None = None  # reconnecting gave up: why
        self.closed = False
        self.server_info: dict[str, Any] = {}
        self._answered = False  # a coordinator at this address completed a handshake with us
        self._reconnect_task: asyncio.Task[None] | None = None
        self._retiring: CoordinatorLink | None = None  # kept open until its replacement is up

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    async def connect(self, deadline: Deadline) -> CoordinatorLink:
        """One link, authenticated, trying until the deadline (backoff with full jitter).

        Raises:
            CoordinatorUnreachable: nothing answered in time. AuthenticationError, ProtocolError:
                not retried (another token, not a coordinator).
        """
        tries = ConnectTries(self.host, self.port, first=not self._answered, still_trying=self._still_trying)
        while True:
            attempt_time = tries.attempt_time(deadline)
            try:
                link, info = await open_link(
                    self.host,
                    self.port,
                    self._handshake(),
                    on_event=self._on_event,
                    on_lost=self._lost,
                    timeout=attempt_time,
                    next_id=self._next_id,
                    on_settle=self._on_settle,
                    silence=tries.silence,
                )
                if link.closed:
                    raise ConnectionResetError(
                        f"the coordinator at {self.address} closed the link right after the handshake"
                    )
                self.server_info = info
                self._answered = True
                return link
            except (OSError, asyncio.TimeoutError, AuthenticationError, ProtocolError) as exc:
                pause = tries.failed(exc, deadline)
            if self.closed:
                raise StoreError(f"session to the coordinator at {self.address} was closed while connecting")
            await asyncio.sleep(pause)

    def _still_trying(self, why: str) -> None:
        log.warning("job=%s rank=%s event=coordinator_not_answering %s", self.job, self._rank(), why)

    def _publish(self, link: CoordinatorLink | None) -> None:
        self.link = link
        self.changed.set()
        self.changed = asyncio.Event()

    def _lost(self, link: CoordinatorLink, exc: BaseException | None) -> None:
        if link is not self.link:
            return
        self._publish(None)
        if self.closed:
            return
        log.warning(
            "job=%s rank=%s event=coordinator_link_lost address=%s reason=%s; reconnecting",
            self.job,
            self._rank(),
            self.address,
            exc or "closed by the coordinator",
        )
        self._reconnect_task = asyncio.ensure_future(self._reconnect())

    def replace(self, link: CoordinatorLink, why: str) -> None:
        """Connect anew because ``link`` stopped answering, and close it only once the new link
        is up: a coordinator that was stalled, not gone, still finds this session connected when it
        wakes and moves it to the new link, instead of reading a closed connection as the member
        lost and then refusing its resume."""
        if link is not self.link or self.closed:
            return
        self._publish(None)  # new requests wait for the new link
        self._retiring = link
        log.warning(
            "job=%s rank=%s event=coordinator_link_replaced address=%s reason=%s; connecting anew "
            "before closing it",
            self.job,
            self._rank(),
            self.address,
            why,
        )
        self._reconnect_task = asyncio.ensure_future(self._reconnect())

    def _retire(self) -> None:
        old, self._retiring = self._retiring, None
        if old is not None:
            old.close()

    async def _reconnect(self) -> None:
        try:
            link = await self.connect(Deadline(self._timeout()))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._retire()
            if self.closed:
                return
            self.fatal = exc
            log.error(
                "job=%s rank=%s event=coordinator_lost address=%s reason=%s",
                self.job,
                self._rank(),
                self.address,
                exc,
            )
            self.changed.set()
            self._on_event({"ev": EV_COORDINATOR_LOST, "reason": str(exc)})
            return
        if self.closed:
            link.close()
            return
        self._on_new_link(link)  # before anyone else may write to it: what must go first, goes first
        self._publish(link)
        self._retire()  # after the new link's hello named our session: its close loses nobody
        log.info("job=%s rank=%s event=reconnected address=%s", self.job, self._rank(), self.address)
        self._on_event({"ev": EV_RECONNECTED})

    def ready(self) -> CoordinatorLink | None:
        """The link, when it is open and may take a request now; else None."""
        link = self.link
        if link is None or not link.can_send or self.closed or self.fatal is not None:
            return None
        return link

    async def usable(
        self, deadline: Deadline, op: str, timeout_error: Callable[[], BaseException]
    ) -> CoordinatorLink:
        """The link, waiting for a reconnect (or for a paused transport) while the deadline allows.

        Raises:
            StoreError: the session is closed. CoordinatorUnreachable: reconnecting gave up.
            What ``timeout_error()`` makes: the deadline passed first.
        """
        while True:
            if self.closed:
                raise StoreError(f"{op}: the session to the coordinator at {self.address} is closed")
            if self.fatal is not None:
                raise CoordinatorUnreachable(
                    f"{op}: lost the coordinator at {self.address}: {self.fatal}"
                ) from self.fatal
            link = self.link
            if link is not None:
                if link.closed:
                    self._lost(link, None)
                    continue
                if link.can_send:
                    return link
                waiting: Coroutine[Any, Any, object] = link.wait_writable()  # paused: wait to drain
            else:
                waiting = self.changed.wait()
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                waiting.close()
                raise timeout_error()
            try:
                await asyncio.wait_for(waiting, remaining)
            except asyncio.TimeoutError:
                raise timeout_error() from None

    def close(self) -> None:
        """Close the link and stop reconnecting. Twice is fine."""
        if self.closed:
            return
        self.closed = True
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None:
            task.cancel()
        link, self.link = self.link, None
        if link is not None:
            link.close()
        self._retire()
        self.changed.set()
