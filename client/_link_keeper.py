"""The session's link to the coordinator, kept up: connecting with backoff, and reconnecting by
itself when the link drops, for as long as the session's timeout allows.

May import foundations only (protocol, _errors, _deadline) and client/_connection.py. The session
(session.py) owns one; what a new link must carry first (the mutations nobody awaits, sent again)
is the session's, through ``on_new_link``.

Authentication failures and "this is not a coordinator" are not retried: they raise at once,
saying what to do.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Coroutine
from typing import Any

from aiocoll._deadline import Deadline
from aiocoll._errors import AuthenticationError, DistError, ProtocolError, StoreError
from aiocoll._net import host_port
from aiocoll.protocol import ClientHandshake

from ._connection import CoordinatorLink, EventCallback, SettleCallback, open_link

__all__ = ["EV_COORDINATOR_LOST", "EV_RECONNECTED", "CoordinatorUnreachable", "LinkKeeper"]

log = logging.getLogger("aiocoll.client")

# Events the session makes up itself (the coordinator's own are in protocol._coordinator).
EV_RECONNECTED = "reconnected"  # a new link is up after a drop
EV_COORDINATOR_LOST = "coordinator_lost"  # reconnecting ran out of time; "reason" says why

_BACKOFF_FIRST = 0.05
_BACKOFF_MAX = 2.0
# One connect + handshake attempt; a paused or black-holed coordinator costs at most this.
_ATTEMPT_TIMEOUT = 10.0


class CoordinatorUnreachable(DistError):
    """No coordinator answered at host:port within the timeout (refused, unreachable, silent)."""


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
        self._reconnect_task: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return host_port(self.host, self.port)

    async def connect(self, deadline: Deadline) -> CoordinatorLink:
        """One link, authenticated, trying until the deadline (backoff with full jitter).

        Raises:
            CoordinatorUnreachable: nothing answered in time. AuthenticationError, ProtocolError:
                not retried (another token, not a coordinator).
        """
        delay = _BACKOFF_FIRST
        attempts = 0
        while True:
            attempts += 1
            remaining = deadline.remaining()
            attempt_time = (
                _ATTEMPT_TIMEOUT if remaining is None else max(min(remaining, _ATTEMPT_TIMEOUT), 0.05)
            )
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
                )
                if link.closed:
                    raise ConnectionResetError("the coordinator closed the link right after the handshake")
                self.server_info = info
                return link
            except AuthenticationError as exc:
                raise AuthenticationError(
                    f"the coordinator at {self.address} did not accept us for job {self.job!r}: {exc}. "
                    f"Use the coordinator's token: set AIOCOLL_TOKEN (or pass token=) to the value the "
                    f"coordinator was started with (--token-file or its AIOCOLL_TOKEN)"
                ) from exc
            except ProtocolError as exc:
                raise ProtocolError(
                    f"{self.address} did not answer as an aiocoll coordinator: {exc}. Check the port "
                    f"(is it a worker's peer port or another service?) and that both sides run the "
                    f"same aiocoll release",
                    remote=exc.remote,
                ) from exc
            except (OSError, asyncio.TimeoutError) as exc:
                last = exc
            if self.closed:
                raise StoreError(f"session to the coordinator at {self.address} was closed while connecting")
            remaining = deadline.remaining()
            if remaining is not None and remaining <= 0:
                raise CoordinatorUnreachable(
                    f"no aiocoll coordinator answered at {self.address} within {deadline.timeout:.3g}s "
                    f"({attempts} attempts; last error: {type(last).__name__}: {last or 'timed out'}). "
                    f"Check that the coordinator runs there (aiocoll coordinator --port {self.port}) and "
                    f"that host and port are right, or raise the timeout"
                ) from last
            pause = random.uniform(0, delay)
            if remaining is not None:
                pause = min(pause, remaining)
            await asyncio.sleep(pause)
            delay = min(delay * 2, _BACKOFF_MAX)

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

    async def _reconnect(self) -> None:
        try:
            link = await self.connect(Deadline(self._timeout()))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
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
        self.changed.set()
