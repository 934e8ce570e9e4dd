"""An elastic `aiocoll run` (--nnodes MIN:MAX): this launcher as one node agent of the job.

It carries out what _launch_nodes decides. Over one store session with the coordinator (role
store, in the job's key space, keys under ``aiocoll.run/``) it beats, reads the job's node state
when its version moves, changes it by compare-and-set, and runs each generation's workers with
_launch_agent's _Generation, stopping them when the generation ends: a node joined, a node's
launcher stopped beating (it died, or lost the coordinator), a node left (its launcher got a
signal), or a worker failed (the only ending that uses up --max-restarts). The job is over when
every worker of a generation exited 0, or a failure finds no restart left.

May import the standard library, the other launch modules and the coordinator client
(aiocoll.client.control.session, a plain store session); never the worker runtime.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .._errors import AuthenticationError, DistError, StoreTimeout
from .._net import free_port
from ._launch_agent import (
    EXIT_SETUP_FAILED,
    EXIT_SPAWN_FAILED,
    GenerationResult,
    _Generation,
    _Worker,
    describe_returncode,
    dumps_line,
    exit_code_of,
    last_stderr_line,
)
from ._launch_config import elastic_torch_store_address, format_host_port
from ._launch_nodes import (
    FAILED,
    FINISHED,
    FORMING,
    Admitted,
    Beats,
    Ended,
    Finished,
    Node,
    NodeState,
    NodeStateError,
    View,
    Wait,
    Write,
    decode_state,
    encode_state,
    join_step,
    layout_of,
    leave,
    new_run,
    running_step,
    watched_nodes,
)

if TYPE_CHECKING:
    from aiocoll.client.control.session import CoordinatorSession

    from ._launch_agent import Console, _Agent
    from ._launch_config import LaunchConfig

__all__ = ["EXIT_RENDEZVOUS_FAILED", "KEY_PREFIX", "LINK_ERRORS", "ElasticNode", "NodeHost", "NodeRendezvous"]

# The node state's keys live in the job's own key space, apart from the workers' keys.
KEY_PREFIX = "aiocoll.run/"
STATE_KEY = KEY_PREFIX + "state"
VERSION_KEY = KEY_PREFIX + "version"
# The launcher gave up waiting to be admitted (--rdzv-timeout), or lost the coordinator for good.
EXIT_RENDEZVOUS_FAILED = 1
# A node reads the whole state when its version moves, and at least this often (in ticks) in case
# a writer died between writing it and moving the version.
REREAD_TICKS = 20
LEAVE_SECONDS = 5.0
# What a lost link to the coordinator looks like from a store call: the session's own errors
# (CoordinatorUnreachable, StoreTimeout, a closed session) and the socket's.
_LINK_ERRORS = (DistError, OSError, asyncio.TimeoutError)
LINK_ERRORS = _LINK_ERRORS


def beat_key(node_id: str) -> str:
    return f"{KEY_PREFIX}beat/{node_id}"


def failures_key(run: str, gen: int) -> str:
    return f"{KEY_PREFIX}failures/{run}/{gen}"


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the other nodes most likely reach
    it at; no packet is sent), else its host name."""
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return socket.gethostname()


def _free_port_at(addr: str) -> int:
    try:
        return free_port(addr)
    except OSError:
        return free_port("0.0.0.0")


@dataclass
class _Claim:
    """This node's workers failed. Only the generation's first failure is reported, and only once
    every other node beat since (no node was lost: a lost node would explain the failure)."""

    first: bool
    failure: tuple[str, str, int]
    baseline: dict[str, int] | None = None


class NodeHost(Protocol):
    """What the node rendezvous needs of the program it runs in: `aiocoll run`'s supervisor, or
    the torchrun rendezvous handler (aiocoll.torchrun)."""

    @property
    def config(self) -> LaunchConfig: ...

    @property
    def console(self) -> Console: ...

    @property
    def received(self) -> int | None:
        """The signal that asks this node to stop, or None."""

    @property
    def signalled(self) -> asyncio.Event:
        """Set when a signal arrives (cuts a wait short)."""


class NodeRendezvous:
    """One node agent's part of the node rendezvous: its session with the coordinator, its
    beats, and joining a generation (what _launch_nodes decides, carried out).

    Args:
        host: the program it runs in (its config, console and signals).
        coordinator: (host, port) of the coordinator (--coordinator).
        token: the shared secret, or None.
    """

    LABEL = "aiocoll run"  # what starts its log lines, before the node's name

    def __init__(self, host: NodeHost, coordinator: tuple[str, int], token: str | None) -> None:
        config = host.config
        assert config.elastic is not None
        self._host = host
        self._config = config
        self._spec = config.elastic
        self._console = host.console
        self._coordinator = coordinator
        self._token = token
        self._tick = min(0.5, max(0.05, self._spec.node_timeout / 4))
        self._op_timeout = max(self._spec.node_timeout, 2.0)
        self._beats = Beats(self._spec.node_timeout)
        self._name = f"{socket.gethostname()}:{os.getpid()}"
        self._id = f"{self._name}/{secrets.token_hex(3)}"
        self._addr = _address_towards(*coordinator)
        self._node = Node(self._id, self._name, config.nproc_per_node, self._addr, 0)
        self._session: CoordinatorSession | None = None
        self._raw = b""
        self._state: NodeState | None = None
        self._version = -1
        self._unread_ticks = 0
        self._run: str | None = None
        self._last_gen = -1
        self._warned_rules = False
        self._link_note: str | None = None
        self._beating: asyncio.Future[None] | None = None

    # -- the session --------------------------------------------------------------------------------

    async def open(self, what: str) -> int | None:
        """Open the session, beat, and say so (``what`` this node agent is); None when it is
        open, else the exit status of a node that could not (the reason is logged)."""
        from aiocoll.client.control.session import CoordinatorSession
        from aiocoll.protocol._coordinator import ROLE_STORE

        config = self._config
        where = format_host_port(*self._coordinator)
        try:
            self._session = await CoordinatorSession.connect(
                *self._coordinator,
                token=self._token or None,
                job=config.job,
                role=ROLE_STORE,
                timeout=config.connect_timeout,
            )
        except AuthenticationError as exc:
            self._console.log(
                f"error: the coordinator at {where} refused this launcher ({exc}); give every launcher of "
                "the job and the coordinator the same token (--token-file or AIOCOLL_TOKEN). No worker "
                "was started"
            )
            return EXIT_SETUP_FAILED
        except _LINK_ERRORS as exc:
            self._console.log(f"error: cannot open a session with the coordinator at {where}: {exc}")
            return EXIT_SETUP_FAILED
        self._console.log(
            f"{what}: rendezvous through the coordinator at {where}, under the job's keys {KEY_PREFIX}*"
        )
        self._beating = asyncio.ensure_future(self._beat_forever())
        try:
            # A node beats before it appears in the state, so that its counter can be read.
            await self._session.add(beat_key(self._id), 1, timeout=self._op_timeout)
            await self._session.add(VERSION_KEY, 0, timeout=self._op_timeout)
        except _LINK_ERRORS as exc:
            self._console.log(f"error: the coordinator at {where} does not answer store requests: {exc}")
            await self.close()
            return EXIT_SETUP_FAILED
        return None

    async def close(self) -> None:
        """Stop beating and close the session (bounded); twice is fine."""
        beating, self._beating = self._beating, None
        if beating is not None:
            beating.cancel()
            await asyncio.gather(beating, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(session.aclose(), LEAVE_SECONDS)

    @property
    def node(self) -> Node:
        """This node as the node state lists it (its port is found again at each join)."""
        return self._node

    @property
    def session(self) -> CoordinatorSession:
        """The open session with the coordinator (the job's key space)."""
        assert self._session is not None
        return self._session

    def unreadable(self, exc: NodeStateError) -> int:
        """Say that the job's node state cannot be read; the exit status."""
        self._console.log(
            f"error: key {STATE_KEY!r} of job {self._config.job!r} holds something this node agent cannot "
            f"read ({exc}); was it written by another program or aiocoll version? Use another job id"
        )
        return EXIT_RENDEZVOUS_FAILED

    async def _beat_forever(self) -> None:
        assert self._session is not None
        while True:
            # A beat that fails is a beat missed: the main loop notices the lost link itself.
            with contextlib.suppress(*_LINK_ERRORS):
                await self._session.add(beat_key(self._id), 1, timeout=self._op_timeout)
            await asyncio.sleep(self._tick)

    # -- reading and writing the node state ------------------------------------------------------

    async def _refresh(self) -> NodeState | None:
        """The node state: read again when its version moved (or every REREAD_TICKS)."""
        session = self._session
        assert session is not None
        version = int(await session.get(VERSION_KEY, timeout=self._op_timeout))
        self._unread_ticks += 1
        if version != self._version or self._unread_ticks >= REREAD_TICKS:
            self._version, self._unread_ticks = version, 0
            if self._raw or await session.check([STATE_KEY], timeout=self._op_timeout):
                self._raw = bytes(await session.get(STATE_KEY, timeout=self._op_timeout))
                self._state = decode_state(self._raw)
        self._check_rules(self._state)
        self._link_note = None
        return self._state

    async def _write(self, new: NodeState) -> bool:
        """Compare-and-set the state from what this node last read to ``new``; True if it won.
        Either way this node then holds what is stored now."""
        session = self._session
        assert session is not None
        raw = encode_state(new)
        stored = bytes(await session.compare_set(STATE_KEY, self._raw, raw, timeout=self._op_timeout))
        self._raw, self._state = stored, decode_state(stored)
        if stored != raw:
            return False
        await session.add(VERSION_KEY, 1, timeout=self._op_timeout)
        return True

    async def _observe(self, node_ids: list[str]) -> None:
        """Read the beat counters of ``node_ids`` into self._beats."""
        session = self._session
        assert session is not None
        if not node_ids:
            self._beats.keep(())
            return
        keys = [beat_key(node_id) for node_id in node_ids]
        try:
            values = await session.multi_get(keys, timeout=self._tick)
        except StoreTimeout:
            # A node listed without a counter (a record left by another launcher's crash):
            # reading with add makes it 0, and a counter that never moves is a dead node.
            counts = await asyncio.gather(*(session.add(key, 0, timeout=self._op_timeout) for key in keys))
            values = [str(count).encode() for count in counts]
        now = asyncio.get_running_loop().time()
        for node_id, value in zip(node_ids, values, strict=True):
            try:
                self._beats.observe(node_id, int(value), now)
            except ValueError:
                self._beats.observe(node_id, 0, now)
        self._beats.keep(node_ids)

    def _check_rules(self, state: NodeState | None) -> None:
        if state is None or self._warned_rules or state.phase == FINISHED:
            return
        spec, config = self._spec, self._config
        theirs = (state.min_nodes, state.max_nodes, state.max_restarts)
        if theirs != (spec.min_nodes, spec.max_nodes, config.max_restarts):
            self._warned_rules = True
            self._console.log(
                f"warning: job {config.job!r} runs with --nnodes {state.min_nodes}:{state.max_nodes} "
                f"--max-restarts {state.max_restarts}, as its first node gave them; this launcher's "
                f"--nnodes {spec.min_nodes}:{spec.max_nodes} --max-restarts {config.max_restarts} are "
                "ignored. Give every node the same"
            )

    def _link_lost(self, exc: BaseException) -> None:
        note = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if self._link_note is None:
            self._console.log(
                f"no answer from the coordinator at {format_host_port(*self._coordinator)} ({note}); "
                "trying again"
            )
        self._link_note = note
        # After an outage the state is read again whatever its version says.
        self._version = -1

    async def _leave(self, reason: str) -> None:
        """Take this node out of the state (bounded: a launcher that is stopping does not wait
        for a coordinator that does not answer; then the others find it dead)."""
        me = self._node

        async def attempt() -> None:
            for _ in range(8):
                new = leave(self._state, me, reason)
                if new is None or await self._write(new):
                    return

        try:
            await asyncio.wait_for(attempt(), LEAVE_SECONDS)
        except (*_LINK_ERRORS, NodeStateError) as exc:
            self._console.log(
                f"could not tell the other nodes that this node leaves ({exc!r}); they will find it gone"
            )

    async def _pause(self) -> None:
        """One tick, cut short by a signal to the launcher."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._host.signalled.wait(), self._tick)

    # -- joining ----------------------------------------------------------------------------------

    async def _join(self) -> NodeState | int:
        """Join the job and wait to be admitted: the running state whose generation includes this
        node, or the launcher's exit status (the job finished, --rdzv-timeout, a signal)."""
        spec, config = self._spec, self._config
        loop = asyncio.get_running_loop()
        self._console.prefix = f"[{self.LABEL} {self._name}] ".encode()
        me = self._node = Node(
            self._id, self._name, config.nproc_per_node, self._addr, _free_port_at(self._addr)
        )
        deadline = loop.time() + spec.rdzv_timeout
        formation: tuple[str, int] | None = None
        min_since: float | None = None
        last_note: str | None = None
        while True:
            received = self._host.received
            if received is not None:
                await self._leave(f"node {self._name} left: its launcher got {signal.Signals(received).name}")
                return 128 + received
            try:
                state = await self._refresh()
                watched = watched_nodes(state, me, running=False)
                await self._observe(watched)
            except _LINK_ERRORS as exc:
                self._link_lost(exc)
                if loop.time() >= deadline:
                    return self._give_up(f"the coordinator did not answer: {self._link_note}")
                await self._pause()
                continue
            now = loop.time()
            dead = self._beats.dead(watched, now)
            if state is not None and state.phase == FORMING:
                if formation != (state.run, state.gen):
                    formation, min_since = (state.run, state.gen), None
                live = sum(1 for node in state.nodes if node.id not in dead)
                min_since = (min_since if min_since is not None else now) if live >= state.min_nodes else None
            view = View(dead, now, min_since, spec.join_window, spec.node_timeout)
            fresh = new_run(
                secrets.token_hex(8),
                me,
                min_nodes=spec.min_nodes,
                max_nodes=spec.max_nodes,
                max_restarts=config.max_restarts,
            )
            step = join_step(state, me, view, run=self._run, last_gen=self._last_gen, fresh=fresh)
            if isinstance(step, Write):
                try:
                    won = await self._write(step.state)
                except _LINK_ERRORS as exc:
                    self._link_lost(exc)
                    continue
                if won:
                    if step.state.find(me.id) is not None:
                        self._run = step.state.run
                    if state is None or state.phase == FINISHED or step.state.phase == state.phase:
                        self._console.log(step.note)
                continue
            if isinstance(step, Admitted):
                self._run = step.state.run
                return step.state
            if isinstance(step, Finished):
                return self._finish(step.state)
            assert isinstance(step, Wait)
            if step.note != last_note:
                self._console.log(step.note)
                last_note = step.note
            if now >= deadline:
                await self._leave(f"node {self._name} gave up waiting (--rdzv-timeout)")
                return self._give_up(step.note)
            await self._pause()

    def _finish(self, state: NodeState) -> int:
        """The job is over (``state`` says how): the exit status (a subclass says more)."""
        return state.exit_code if state.exit_code is not None else 1

    def _give_up(self, why: str) -> int:
        spec = self._spec
        self._console.log(
            f"error: not admitted to job {self._config.job!r} within --rdzv-timeout {spec.rdzv_timeout:g}s: "
            f"{why}. Start more launchers with the same --job and --coordinator (--nnodes "
            f"{spec.min_nodes}:{spec.max_nodes} needs {spec.min_nodes} to start), or raise --rdzv-timeout"
        )
        return EXIT_RENDEZVOUS_FAILED


class ElasticNode(NodeRendezvous):
    """Runs this node's part of an elastic job until the job is over or the launcher is stopped.

    Args:
        agent: the launcher's supervisor (its config, console, signals and current generation).
        coordinator: (host, port) of the coordinator (--coordinator).
        token: the shared secret, or None.
    """

    def __init__(self, agent: _Agent, coordinator: tuple[str, int], token: str | None) -> None:
        super().__init__(agent, coordinator, token)
        self._agent = agent

    async def run(self) -> int:
        config, spec = self._config, self._spec
        self._console.prefix = f"[aiocoll run {self._name}] ".encode()
        failed = await self.open(
            f"node agent of job {config.job!r} (--nnodes {spec.min_nodes}:{spec.max_nodes}, "
            f"{config.nproc_per_node} worker(s) here, --max-restarts {config.max_restarts})"
        )
        if failed is not None:
            return failed
        try:
            while True:
                admitted = await self._join()
                if isinstance(admitted, int):
                    return admitted
                code = await self._run_generation(admitted)
                if code is not None:
                    return code
        except NodeStateError as exc:
            return self.unreadable(exc)
        finally:
            await self.close()

    # -- one generation ---------------------------------------------------------------------------

    async def _run_generation(self, state: NodeState) -> int | None:
        """Run this node's workers in the generation ``state`` starts, until it ends (None: join
        the next one) or the job is over (the launcher's exit status)."""
        config, me, agent = self._config, self._node, self._agent
        loop = asyncio.get_running_loop()
        gen = state.gen
        self._last_gen = gen
        layout = layout_of(state, me.id)
        node0 = state.nodes[0]
        store = elastic_torch_store_address(config, (node0.addr, node0.port), self._coordinator)
        self._console.prefix = f"[aiocoll run {self._name} node {layout.node_rank}] ".encode()
        first, last = layout.first_rank, layout.first_rank + config.nproc_per_node - 1
        nodes = ", ".join(f"{rank}={node.name}" for rank, node in enumerate(state.nodes))
        self._console.log(
            f"generation {gen}: node {layout.node_rank} of {layout.nnodes} ({nodes}), ranks {first}..{last} "
            f"of world size {layout.world_size}; restarts used {state.restarts} of {state.max_restarts}; "
            f"MASTER_ADDR:MASTER_PORT {format_host_port(store.addr, store.port)} ({store.source})"
        )
        for warning in store.warnings:
            self._console.log(f"warning: {warning}")
        generation = _Generation(
            config,
            self._console,
            restart_count=state.restarts,
            coordinator=self._coordinator,
            master_addr=store.addr,
            master_port=store.port,
            layout=layout,
            generation=gen,
            max_restarts=state.max_restarts,
        )
        agent.begin(generation)
        task = asyncio.ensure_future(generation.run())
        others = [node_id for node_id in state.ids() if node_id != me.id]
        claim: _Claim | None = None
        succeeded = handled = False
        try:
            while True:
                received = agent.received
                if received is not None:
                    return await self._stopped_by_signal(received, task)
                if not task.done():
                    await asyncio.wait({task}, timeout=self._tick)
                if task.done() and not handled:
                    handled = True
                    result: GenerationResult = task.result()
                    if agent.received is not None:
                        continue
                    if result.spawn_error is not None:
                        await self._leave(f"node {self._name} left: its workers could not be started")
                        return EXIT_SPAWN_FAILED
                    if result.ok:
                        succeeded = True
                        self._console.log(
                            f"all {config.nproc_per_node} rank(s) here ({first}..{last}) exited 0; waiting "
                            "for the other nodes"
                        )
                    elif result.failed is not None:
                        try:
                            claim = await self._claim(state, result.failed, layout.node_rank)
                        except _LINK_ERRORS as exc:
                            self._link_lost(exc)
                            return None
                watch = (
                    others if claim is not None and claim.first else watched_nodes(state, me, running=True)
                )
                try:
                    current = await self._refresh()
                    await self._observe(watch)
                except _LINK_ERRORS as exc:
                    self._link_lost(exc)
                    self._console.log(
                        "stopping this node's workers: the other nodes go on without them once they "
                        "miss its beats, and it joins again when the coordinator answers"
                    )
                    await self._stop(generation, task)
                    return None
                if claim is not None and claim.first and claim.baseline is None:
                    claim.baseline = {node_id: self._beats.value(node_id) or 0 for node_id in others}
                now = loop.time()
                view = View(self._beats.dead(watch, now), now, node_timeout=self._spec.node_timeout)
                failure = None
                if (
                    claim is not None
                    and claim.baseline is not None
                    and self._beats.moved_past(claim.baseline)
                ):
                    failure = claim.failure
                step = running_step(
                    current, me, view, run=state.run, gen=gen, succeeded=succeeded, failure=failure
                )
                if isinstance(step, Write):
                    try:
                        await self._write(step.state)
                    except _LINK_ERRORS as exc:
                        self._link_lost(exc)
                    continue
                if isinstance(step, Ended):
                    await self._stop(generation, task)
                    self._log_ending(step.state, gen)
                    return None
                if isinstance(step, Finished):
                    await self._stop(generation, task)
                    return self._finish(step.state)
                if task.done():
                    await self._pause()
        finally:
            agent.finish()

    async def _claim(self, state: NodeState, worker: _Worker, node_rank: int) -> _Claim:
        """Count this node's failure as the generation's first, unless another node's came first."""
        assert self._session is not None and worker.returncode is not None
        count = await self._session.add(failures_key(state.run, state.gen), 1, timeout=self._op_timeout)
        reason = (
            f"rank {worker.rank} (node {node_rank} {self._name}, local rank {worker.local_rank}, "
            f"pid {worker.pid}) failed ({describe_returncode(worker.returncode)})"
        )
        failure = (reason, last_stderr_line(worker) or "", exit_code_of(worker.returncode))
        if count == 1:
            self._console.log(
                "checking that every other node still beats before counting this failure against "
                "--max-restarts (a lost node would explain it instead)"
            )
        else:
            self._console.log(
                "another node reported a failure of this generation first; following its decision"
            )
        return _Claim(first=count == 1, failure=failure)

    async def _stop(self, generation: _Generation, task: asyncio.Future[GenerationResult]) -> None:
        """Stop this node's workers (SIGTERM, then SIGKILL after --grace-period) and wait for them."""
        generation.request_stop(signal.SIGTERM)
        await asyncio.gather(task, return_exceptions=True)

    async def _stopped_by_signal(self, signum: int, task: asyncio.Future[GenerationResult]) -> int:
        name = signal.Signals(signum).name
        await self._leave(f"node {self._name} left: its launcher got {name}")
        results = await asyncio.gather(task, return_exceptions=True)
        result = results[0]
        codes = result.returncodes if isinstance(result, GenerationResult) else {}
        summary = "; ".join(
            f"rank {rank}: {describe_returncode(code)}" for rank, code in sorted(codes.items())
        )
        self._console.log(f"stopped by {name}: {summary or 'no worker was running'}")
        return 128 + signum

    # -- endings ----------------------------------------------------------------------------------

    def _name_of(self, state: NodeState, node_id: str) -> str:
        node = state.find(node_id)
        return node.name if node is not None else node_id.rsplit("/", 1)[0]

    def _log_ending(self, state: NodeState, gen: int) -> None:
        ended = state.ended
        if ended is None or ended.gen != gen:
            self._console.log(f"generation {gen} is over; the job is at generation {state.gen} now")
            return
        if ended.kind == FAILED:
            self._console.log(
                f"generation {gen} ended: {ended.reason}; restarting every node's workers (restart "
                f"{state.restarts} of {state.max_restarts}, job {self._config.job!r})"
            )
            self._log_cause(state)
            return
        self._console.log(
            f"generation {gen} ended: {ended.reason}; the next one starts with the nodes that remain "
            "(a change of membership: it does not use up --max-restarts)"
        )

    def _log_cause(self, state: NodeState) -> None:
        """The failed rank's last stderr line, on the nodes that did not show its output."""
        ended = state.ended
        if ended is not None and ended.cause and ended.node != self._id:
            self._console.log(f"its last stderr line, on {self._name_of(state, ended.node)}: {ended.cause}")

    def _finish(self, state: NodeState) -> int:
        ended = state.ended
        why = ended.reason if ended is not None else "the job finished"
        used = f"restarts used {state.restarts} of {state.max_restarts}"
        if state.exit_code == 0:
            self._console.log(f"job {self._config.job!r} completed at generation {state.gen}: {why}; {used}")
            return 0
        budget = f"after {state.restarts} restart(s)" if state.max_restarts else "no restarts allowed"
        self._console.log(f"job {self._config.job!r} failed ({budget}): {why}")
        self._log_cause(state)
        self._console.log(dumps_line(self._config.job))
        return state.exit_code if state.exit_code is not None else 1
