"""The runtime's bootstrap: from an init method (env://, tcp://, file://) or a store to a running
``Runtime`` (a link to every peer, the engine with its verdict and loss hooks, the coordinator
session or the store's progress checks, and the table of every group's providers).

Imports foundations (settings, deadlines, errors, stores, the coordinator protocol's names) and
the client's control plane (the coordinator session, store progress) and data plane (engine,
provider tables, links); never the public surface, and never the server: the coordinator that
rank 0 may start inside itself is made by the factory the caller hands in (``Embed``). The
public API (aiocoll/api.py), the fault-tolerant manager (aiocoll/ft.py) and through them the
facade all start their runtimes here.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import unquote, urlparse

import msgpack

from aiocoll._deadline import Deadline, to_seconds
from aiocoll._env import LAUNCH_VARIABLES, env_int, env_text, launch_variables_missing
from aiocoll._errors import RendezvousError, warn
from aiocoll.protocol._coordinator import EV_BEHIND, EV_MISMATCH, ROLE_WORKER
from aiocoll.stores import FileStore, Store

from .control._store_progress import StoreProgress
from .control.session import CoordinatorSession, CoordinatorUnreachable
from .data.engine import Engine, GroupState
from .data.providers import ProviderTable, world_table
from .data.transports import (
    LinkTransport,
    PeerRow,
    connect_links,
    host_identity,
    listen_addresses,
    open_transport,
)
from .data.transports.tcp import route_interface

__all__ = [
    "WORLD_GID",
    "Embed",
    "EmbeddedCoordinator",
    "Runtime",
    "host_port",
    "join_coordinator",
    "join_store",
    "start_runtime",
]

log = logging.getLogger("aiocoll")

WORLD_GID = "w"


class EmbeddedCoordinator(Protocol):
    """A coordinator run inside this process (aiocoll.server.Coordinator)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# (host, port, token) -> a coordinator to start there
Embed = Callable[[str, int, "str | None"], EmbeddedCoordinator]


class Runtime:
    """What a world group and its sub-groups share: the links, the engine, the coordinator
    session (or the store and its progress checks), an embedded coordinator and every group's
    provider table (the default timeout is the engine's, ``engine.default_timeout``).

    Attributes:
        world: the world group as the engine sees it (group id ``WORLD_GID``).
        hosts: global rank -> host identity, from the membership table (empty: unknown).
    """

    def __init__(
        self,
        engine: Engine,
        transport: LinkTransport,
        *,
        session: Any = None,
        coordinator: Any = None,
        store: Store | None = None,
        owns_store: bool = False,
        hosts: Mapping[int, str] | None = None,
    ) -> None:
        self.engine = engine
        # global rank -> host identity, from the membership table (empty: unknown, nothing assumed)
        self.hosts: Mapping[int, str] = hosts or {}
        self.transport = transport
        self.session = session
        self.coordinator = coordinator
        self.store = store
        self.owns_store = owns_store
        self.closed = False
        self.store_progress: StoreProgress | None = None
        # Every group's providers (client/data/providers.py), by group id: closed with the group.
        self.tables: dict[str, ProviderTable] = {}
        self.world: GroupState = engine.group(WORLD_GID, range(transport.world_size))

    def table(self, state: GroupState, made: ProviderTable | None) -> ProviderTable:
        """The providers of the group ``state``.

        The world's are chosen here; a sub-group's when it formed (``made``).
        """
        table = made or world_table(self.engine, state, self.transport, self.hosts, id(self))
        self.tables[state.gid] = table
        return table

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.store_progress is not None:
            await self.store_progress.aclose()
        await self.engine.aclose()
        for table in self.tables.values():
            table.close()
        self.tables.clear()
        if self.coordinator is not None:
            # Others still use the embedded coordinator until they leave: each leaves its session
            # before it says goodbye on its links, so once every link is closed the coordinator
            # may stop (bounded, so a vanished rank cannot hold us here).
            for _ in range(200):
                if len(self.transport.lost_peers) >= self.transport.world_size - 1:
                    break
                await asyncio.sleep(0.05)
        if self.session is not None:
            with contextlib.suppress(Exception):
                await self.session.aclose()
        await self.transport.aclose()
        if self.owns_store and self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.aclose()
        if self.coordinator is not None:
            with contextlib.suppress(Exception):
                await self.coordinator.stop()


def _check_world(rank: int | None, world_size: int | None, *, need_rank: bool) -> None:
    if world_size is None:
        raise ValueError("world_size is not set: pass world_size= or set WORLD_SIZE")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if rank is None:
        if need_rank:
            raise ValueError("rank is not set: pass rank= or set RANK")
        return
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} is out of range for world_size={world_size}")


async def start_runtime(
    init_method: str | None,
    *,
    rank: int | None,
    world_size: int | None,
    timeout: float | datetime.timedelta | None,
    token: str | None,
    job: str | None,
    store: Store | None,
    embed: Embed,
) -> Runtime:
    """Join a job (the arguments and their defaults are ``aiocoll.init_process_group``'s) and
    return its runtime; ``embed`` makes the coordinator rank 0 starts inside itself when none
    answers at an env:// or tcp:// address."""
    seconds = to_seconds(timeout)
    deadline = Deadline(seconds)
    if token is None:
        token = env_text("AIOCOLL_TOKEN", strip=False)
    job = job or env_text("AIOCOLL_JOB", strip=False) or "default"
    if rank is None:
        rank = env_int("RANK")
    if world_size is None:
        world_size = env_int("WORLD_SIZE")
    if isinstance(world_size, int) and world_size < 0:
        world_size = None  # torch's "-1 means from the environment"
    if isinstance(rank, int) and not isinstance(rank, bool) and rank < 0:
        rank = None
    if not token and not rank:
        # Once per job: every rank of a launch is equally open, and torchrun shows all their
        # output in one terminal. A rank still to be told its number says it too.
        warn(
            "aiocoll: no token (AIOCOLL_TOKEN unset): anyone who can reach the coordinator and peer "
            "ports can join this job; set AIOCOLL_TOKEN to a shared secret"
        )

    if store is not None:
        return await join_store(store, rank, world_size, deadline, seconds, token, job, owns=False)
    method = init_method or "env://"
    url = urlparse(method)
    if url.scheme == "file":
        path = unquote(url.path)
        if not path:
            raise ValueError(f"init_method {method!r} names no file")
        fstore = FileStore(path, world_size if isinstance(world_size, int) else -1)
        return await join_store(fstore, rank, world_size, deadline, seconds, token, job, owns=True)
    host: str | None
    port: int | None
    start_one = True  # rank 0 starts a coordinator when none answers (the contract's env:// and tcp://)
    if url.scheme == "env":
        named = env_text("AIOCOLL_COORDINATOR")
        if named:  # `aiocoll run` names its coordinator here and leaves MASTER_* to torch's store
            host, port = host_port(named, "AIOCOLL_COORDINATOR")
            start_one = False  # a named coordinator runs (embedded, or --coordinator): never replace it
        else:
            host = os.environ.get("MASTER_ADDR")
            port = env_int("MASTER_PORT")
        given = {"MASTER_ADDR": host, "MASTER_PORT": port, "RANK": rank, "WORLD_SIZE": world_size}
        if not host or port is None or world_size is None:  # RANK alone may be left to the coordinator
            raise launch_variables_missing([name for name in LAUNCH_VARIABLES if given[name] in (None, "")])
    elif url.scheme == "tcp":
        host, port = url.hostname, url.port
        if not host or port is None:
            raise ValueError(f"init_method {method!r} must look like tcp://HOST:PORT")
    else:
        raise ValueError(f"init_method {method!r}: expected env://, tcp://HOST:PORT or file:///PATH")
    return await join_coordinator(
        host, port, rank, world_size, deadline, seconds, token, job, embed=embed if start_one else None
    )


def host_port(text: str, what: str) -> tuple[str, int]:
    """Split HOST:PORT or [V6]:PORT (a leading tcp:// is allowed)."""
    value = text.strip().removeprefix("tcp://")
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = value.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{what}={text!r} must look like HOST:PORT")
    return host, int(port_text)


async def _coordinator_answers(host: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2.0)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


async def join_coordinator(
    host: str,
    port: int,
    rank: int | None,
    world_size: int | None,
    deadline: Deadline,
    seconds: float | None,
    token: str | None,
    job: str,
    *,
    embed: Embed | None = None,
) -> Runtime:
    """Join the job through the coordinator at ``host:port`` and return its runtime; with
    ``embed``, rank 0 first starts one there when none answers (never in place of a named one)."""
    start_one = embed is not None
    _check_world(rank, world_size, need_rank=False)
    assert world_size is not None
    iface = route_interface(host, port)
    transport = open_transport(None, None, token=token, job=job)
    coordinator = None
    session = None
    try:
        addrs = await listen_addresses(transport, iface, token=token, job=job)
        if embed is not None and rank == 0 and not await _coordinator_answers(host, port):
            coordinator = embed(host, port, token)
            try:
                await coordinator.start()
            except OSError as exc:  # someone else took the port meanwhile: join theirs
                log.info(
                    "rank 0: could not start a coordinator on %s:%s (%s); joining the one there",
                    host,
                    port,
                    exc,
                )
                coordinator = None
        session = await _connect_session(
            CoordinatorSession, host, port, token, job, ROLE_WORKER, deadline, start_one=start_one
        )
        membership = await session.join(rank, world_size, addrs, host_identity(), deadline.remaining())
        if membership.world_size != world_size:
            raise RendezvousError(
                f"the coordinator reports world_size {membership.world_size}, we asked for {world_size}"
            )
        transport.assign(membership.rank, membership.world_size)
        await connect_links(transport, membership.members, deadline)
        engine = Engine(transport, default_timeout=seconds)
        session.on_member_lost(lambda r, reason: engine.peer_lost(int(r), str(reason)))
        # Hooks for progress reports and heartbeats from a thread; the coordinator's verdicts
        session.on_event(functools.partial(_on_verdict, engine))
        session.start_beats(engine.progress.report)
        runtime = Runtime(
            engine,
            transport,
            session=session,
            coordinator=coordinator,
            hosts={m.rank: m.host for m in membership.members},
        )
    except BaseException:
        await transport.aclose()
        if session is not None:
            with contextlib.suppress(Exception):
                await session.aclose()
        if coordinator is not None:
            with contextlib.suppress(Exception):
                await coordinator.stop()
        raise
    return runtime


def _on_verdict(engine: Engine, event: dict[str, Any]) -> None:
    """The coordinator compared the members' progress reports (EV_MISMATCH, EV_BEHIND)."""
    name, gid, seq, ranks = event.get("ev"), event.get("group"), event.get("seq"), event.get("ranks")
    if name not in (EV_MISMATCH, EV_BEHIND):
        return
    if type(gid) is not str or type(seq) is not int or not isinstance(ranks, list):
        log.warning("rank %d: malformed %s event from the coordinator: %r", engine.rank, name, event)
        return
    ranks = [int(r) for r in ranks if type(r) is int]
    msg = str(event.get("msg", ""))
    if name == EV_MISMATCH:
        engine.remote_mismatch(gid, seq, ranks, msg)
    else:
        # The coordinator's log says it once for the job, and the operation's timeout raises it on
        # every rank that waits: here it is a detail of this rank's log.
        log.info("rank %d: %s", engine.rank, msg)
        engine.progress.note_behind(gid, seq, ranks, msg)


async def _connect_session(
    cls: type[CoordinatorSession],
    host: str,
    port: int,
    token: str | None,
    job: str,
    role: str,
    deadline: Deadline,
    *,
    start_one: bool = True,
) -> CoordinatorSession:
    remaining = deadline.remaining()
    try:
        # The session retries with backoff by itself while its timeout allows (rank 0 may still
        # be starting the embedded coordinator).
        return await cls.connect(
            host, port, token=token, job=job, role=role, timeout=remaining if remaining is not None else 1e9
        )
    except (OSError, asyncio.TimeoutError, CoordinatorUnreachable) as exc:
        # CoordinatorUnreachable names the address, the time and the last attempt's error itself
        said = (
            str(exc)
            if isinstance(exc, CoordinatorUnreachable)
            else f"no aiocoll coordinator answered at {host}:{port} within the rendezvous timeout ({exc})"
        )
        if not start_one:
            raise RendezvousError(
                f"{said} (AIOCOLL_COORDINATOR names it). Rank 0 does not start one in its place: `aiocoll "
                f"run --coordinator` needs one running there; leave --coordinator out to let the launcher "
                f"run one"
            ) from None
        raise RendezvousError(
            f"{said}. Start one (aiocoll coordinator), or let the process with RANK=0 (rank=0) start "
            f"one inside itself"
        ) from None


async def _unpublished(store: Store, keys: list[str], rank: int, world_size: int) -> str:
    """Why a rendezvous through a store timed out: which ranks never published their address."""
    missing: list[int] = []

    async def look() -> None:
        for r, key in enumerate(keys):
            if not await store.check([key]):
                missing.append(r)

    try:
        await asyncio.wait_for(look(), 5)  # an error path: a bounded look, not a second timeout
    except Exception:  # the store itself is gone or too slow: say what we know
        return (
            f"rank {rank}: not every rank of {world_size} published its address in the store within "
            f"the rendezvous timeout, and the store no longer answers"
        )
    said = f"rank {rank}: rank(s) {missing[:32]} of {world_size} did not publish their address in the store"
    said += f" within the rendezvous timeout ({world_size - len(missing)} did)"
    launched = os.environ.get("WORLD_SIZE")
    if launched is not None and launched != str(world_size):
        return f"{said}: this process asked for world_size={world_size} but its WORLD_SIZE is {launched}"
    return f"{said}: not all processes started, or they were given another world size or store"


async def join_store(
    store: Store,
    rank: int | None,
    world_size: int | None,
    deadline: Deadline,
    seconds: float | None,
    token: str | None,
    job: str,
    *,
    owns: bool,
) -> Runtime:
    """Join the job through ``store`` (every rank publishes its addresses there) and return its
    runtime; ``owns``: the runtime closes the store with itself."""
    _check_world(rank, world_size, need_rank=True)
    assert rank is not None and world_size is not None
    host = env_text("AIOCOLL_PEER_HOST") or (
        route_interface(os.environ["MASTER_ADDR"]) if os.environ.get("MASTER_ADDR") else "127.0.0.1"
    )
    transport = open_transport(rank, world_size, token=token, job=job)
    try:
        addrs = await listen_addresses(transport, host, token=token, job=job)
        # Each rank counts its own rendezvous rounds, so a store reused by a later
        # init_process_group (after destroy) never hands out a previous round's dead addresses.
        rnd = await store.add(f"aiocoll/{job}/rounds/{rank}", 1)
        prefix = f"aiocoll/{job}/round{rnd}/peer/"
        await store.set(f"{prefix}{rank}", msgpack.packb({"addrs": addrs, "host": host_identity()}))
        keys = [f"{prefix}{r}" for r in range(world_size)]
        try:
            await asyncio.wait_for(store.wait(keys, deadline.remaining()), deadline.remaining())
            values = await store.multi_get(keys)
        except (TimeoutError, asyncio.TimeoutError):
            raise RendezvousError(await _unpublished(store, keys, rank, world_size)) from None
        table = [PeerRow(r, **msgpack.unpackb(v)) for r, v in enumerate(values)]
        await connect_links(transport, table, deadline)
        engine = Engine(transport, default_timeout=seconds)
        # Progress hook: no coordinator here, so stalls are cross-checked through the store
        progress = StoreProgress(engine, store, f"aiocoll/{job}/round{rnd}/progress/")
        progress.start()
    except BaseException:
        await transport.aclose()
        if owns:
            with contextlib.suppress(Exception):
                await store.aclose()
        raise
    runtime = Runtime(
        engine,
        transport,
        store=store,
        owns_store=owns,
        hosts={row.rank: row.host for row in table},
    )
    runtime.store_progress = progress
    return runtime
