"""torchrun's rendezvous backend ``aiocoll``: torch's elastic agents rendezvous through an aiocoll
coordinator.

    torchrun --nnodes 1:4 --nproc-per-node 8 --rdzv-backend aiocoll \\
             --rdzv-endpoint HOST:PORT --rdzv-id JOB train.py

Installing aiocoll registers the backend: torch's elastic agent loads rendezvous handlers from
the entry point group ``torchrun.handlers``, where aiocoll names ``handler_creator``. Each
torchrun is then one node agent of job ``JOB`` on the coordinator, in the node rendezvous that
``aiocoll run --nnodes MIN:MAX`` uses: generations, the join window after MIN nodes, beats that
find a lost node, node ranks kept from one generation to the next. torchrun keeps its own part:
it starts and watches the workers and counts restarts (``--max-restarts``).
"""

# Public surface; imports torch (it implements torch's RendezvousHandler), so only torch's agent
# and the reference load it. The node rendezvous is aiocoll run's (aiocoll.cli._launch_elastic
# carries out what aiocoll.cli._launch_nodes decides), not a second one. The handler's calls
# block torch's agent thread while they run on aiocoll's loop thread, where the node's session
# with the coordinator and its beats live.

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as td
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from ._env import env_text
from ._sync_loop import get_loop_thread
from ._torch_store import TorchStoreOverAiocoll
from .cli._launch_agent import Console
from .cli._launch_config import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_JOIN_WINDOW,
    DEFAULT_NODE_TIMEOUT,
    DEFAULT_RDZV_TIMEOUT,
    ElasticSpec,
    LaunchConfig,
    NodePlacement,
    format_host_port,
    parse_coordinator_address,
)
from .cli._launch_elastic import LINK_ERRORS, NodeRendezvous
from .cli._launch_nodes import (
    FINISHED,
    Ended,
    Finished,
    NodeState,
    NodeStateError,
    View,
    Write,
    close_run,
    layout_of,
    running_step,
    watched_nodes,
)
from .cli._token_file import read_token_file

__all__ = ["BACKEND_NAME", "AiocollRendezvousHandler", "handler_creator"]

BACKEND_NAME = "aiocoll"
"""The name torchrun's ``--rdzv-backend`` takes."""

# torch's agent gives each node's workers a store under this prefix per generation, so that
# keys of an earlier generation (its rank assignment, its exit barrier) never meet a later one's.
_STORE_PREFIX = "aiocoll.torchrun"


class AiocollRendezvousHandler(RendezvousHandler):
    """torch's RendezvousHandler over an aiocoll coordinator (made by torch's agent, not by users).

    ``--rdzv-conf`` keys (``--rdzv-conf key=value,key=value``):

    - ``token_file``: a file holding the shared secret (default: env ``AIOCOLL_TOKEN``);
    - ``join_timeout``: seconds a node waits to be admitted (default 600, torch's name);
    - ``last_call_timeout``: seconds after the MIN-th node for more to arrive (the join window,
      default 5);
    - ``heartbeat_timeout``: seconds a node agent may go without beating before the others count
      it lost (default 10);
    - ``connect_timeout``: seconds the coordinator has to answer at first (default 30).

    Workers of the job find the coordinator too (``AIOCOLL_COORDINATOR``, ``AIOCOLL_JOB`` and,
    from ``token_file``, ``AIOCOLL_TOKEN`` are set for them unless already set), so that
    ``aiocoll.sync`` and the ``"aiocoll"`` torch backend join the job there, where ``aiocoll
    status`` and the coordinator's web page show them.

    Args:
        params: what torchrun was given (``--rdzv-endpoint``, ``--rdzv-id``, ``--nnodes``,
            ``--rdzv-conf``).

    Raises:
        ValueError: an endpoint, a timeout or a token file that cannot be used.
    """

    def __init__(self, params: RendezvousParameters) -> None:
        try:
            coordinator = parse_coordinator_address(params.endpoint or "")
        except ValueError as exc:
            raise ValueError(f"--rdzv-endpoint {params.endpoint!r}: {exc}") from None
        token_file = params.get("token_file")
        token = read_token_file(str(token_file)) if token_file else env_text("AIOCOLL_TOKEN", strip=False)
        spec = ElasticSpec(
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            join_window=_seconds(params, "last_call_timeout", DEFAULT_JOIN_WINDOW),
            rdzv_timeout=_seconds(params, "join_timeout", DEFAULT_RDZV_TIMEOUT),
            node_timeout=_seconds(params, "heartbeat_timeout", DEFAULT_NODE_TIMEOUT),
        )
        self._run_id = params.run_id
        self._timeout = spec.rdzv_timeout
        self._config = LaunchConfig(
            # torch's agent numbers the workers itself (through the store): the node state's
            # worker count is not used, so each node counts as one.
            nproc_per_node=1,
            placement=NodePlacement(nnodes=spec.max_nodes, node_rank=0, sources=(), warnings=()),
            coordinator=coordinator,
            job=params.run_id,
            max_restarts=0,
            token=token or None,
            command=(),
            connect_timeout=_seconds(params, "connect_timeout", DEFAULT_CONNECT_TIMEOUT),
            elastic=spec,
        )
        console = _TorchrunConsole.from_sys()
        console.prefix = f"[{_TorchrunNode.LABEL} {socket.gethostname()}:{os.getpid()}] ".encode()
        self._node = _TorchrunNode(_Host(self._config, console), coordinator, token or None)
        self._opened = False
        self._admitted: NodeState | None = None
        self._store: TorchStoreOverAiocoll | None = None
        _tell_the_workers(coordinator, params.run_id, token if token_file else None)

    def get_backend(self) -> str:
        """``"aiocoll"``."""
        return BACKEND_NAME

    def get_run_id(self) -> str:
        """The job id (``--rdzv-id``)."""
        return self._run_id

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the job's next generation and wait to be admitted.

        Returns:
            The store torch's agent numbers the workers through, this node's rank, the number
                of nodes, and MASTER_ADDR/MASTER_PORT for the workers (a port found free on
                node 0).

        Raises:
            RendezvousConnectionError: the coordinator refused this node or does not answer.
            RendezvousClosedError: the job is over (a node agent closed it).
            RendezvousTimeoutError: not admitted within ``join_timeout``.
            RendezvousStateError: the job's node state holds something this cannot read.
        """
        state = _loop_run(self._next())
        layout = layout_of(state, self._node.node.id)
        node0 = state.nodes[0]
        if self._store is None:
            self._store = TorchStoreOverAiocoll(self._node.session, self._timeout)
        store = td.PrefixStore(f"{_STORE_PREFIX}/{state.run}/{state.gen}/", self._store)
        info = RendezvousStoreInfo(master_addr=node0.addr, master_port=node0.port)
        return RendezvousInfo(store, layout.node_rank, layout.nnodes, info)

    async def _next(self) -> NodeState:
        node = self._node
        if not self._opened:
            spec = self._config.elastic
            assert spec is not None
            failed = await node.open(
                f"torchrun node agent of job {self._run_id!r} (--nnodes {spec.min_nodes}:{spec.max_nodes})"
            )
            if failed is not None:
                where = format_host_port(*self._config.coordinator or ("?", 0))
                raise RendezvousConnectionError(
                    f"no session with the aiocoll coordinator at {where} for job {self._run_id!r} (the "
                    "reason is logged above)"
                )
            self._opened = True
        try:
            admitted = await node.join()
        except NodeStateError as exc:
            node.unreadable(exc)
            raise RendezvousStateError(f"job {self._run_id!r}: unreadable node state: {exc}") from exc
        if isinstance(admitted, int):
            if node.closed is not None:
                raise RendezvousClosedError(f"job {self._run_id!r} is over: {node.closed}")
            raise RendezvousTimeoutError(
                f"job {self._run_id!r}: not admitted within join_timeout {self._timeout:g}s (logged above)"
            )
        self._admitted = admitted
        node.ran(admitted)
        return admitted

    def num_nodes_waiting(self) -> int:
        """How many nodes the next generation would add or lose: above 0 when this node's
        generation is over (a node joined, was lost or left, or the job was closed).

        torch's agent asks between its checks of the workers; above 0, it stops them and
        calls next_rendezvous.
        """
        if self._admitted is None:
            return 0
        try:
            return int(_loop_run(self._node.changes(self._admitted)))
        except NodeStateError as exc:
            raise RendezvousStateError(f"job {self._run_id!r}: unreadable node state: {exc}") from exc

    def is_closed(self) -> bool:
        """Whether the job is over (a node agent closed it, or it finished). A coordinator that
        does not answer now says no: the next question asks again, as num_nodes_waiting does."""
        if not self._opened:
            return False
        try:
            return bool(_loop_run(self._node.is_over()))
        except NodeStateError as exc:
            raise RendezvousStateError(f"job {self._run_id!r}: unreadable node state: {exc}") from exc
        except LINK_ERRORS:
            return False

    def set_closed(self) -> None:
        """Close the job: no generation forms again; the other agents learn it when they next
        ask to join. Bounded by the operation timeout."""
        if self._opened:
            _loop_run(self._node.close_job_bounded(f"node {self._node.node.name} closed the job"))

    def shutdown(self) -> bool:
        """Close the job (as torch's c10d backend does when its agent is done, failed or not) and
        the session with the coordinator. Returns True."""
        if self._opened:
            self._opened = False
            _loop_run(self._node.finish(f"node {self._node.node.name}'s agent is done"))
        return True


class _TorchrunConsole(Console):
    """The node rendezvous's lines in torchrun's words: its notes name `aiocoll run`'s options,
    which a torchrun user sets under other names."""

    WORDS = (
        ("--rdzv-join-window", "--rdzv-conf last_call_timeout"),
        ("--rdzv-timeout", "--rdzv-conf join_timeout"),
        ("--heartbeat-timeout", "--rdzv-conf heartbeat_timeout"),
        ("--token-file", "--rdzv-conf token_file"),
        ("--job", "--rdzv-id"),
        ("--coordinator", "--rdzv-endpoint"),
        ("launchers", "torchrun agents"),
        ("launcher", "torchrun agent"),
    )

    def log(self, message: str) -> None:
        for theirs, ours in self.WORDS:
            message = message.replace(theirs, ours)
        super().log(message)


@dataclass(frozen=True)
class _Host:
    """What the node rendezvous needs of the program it runs in (its NodeHost): torchrun's
    agent handles signals itself, so none is ever received here."""

    config: LaunchConfig
    console: Console
    signalled: asyncio.Event = field(default_factory=asyncio.Event)
    received: int | None = None


class _TorchrunNode(NodeRendezvous):
    """The node rendezvous with torch's agent in charge of the workers: it joins, reports a
    change of the generation when asked, and closes the job."""

    LABEL = "aiocoll rendezvous"

    def __init__(self, host: _Host, coordinator: tuple[str, int], token: str | None) -> None:
        super().__init__(host, coordinator, token)
        self.closed: str | None = None

    async def join(self) -> NodeState | int:
        return await self._join()

    def ran(self, state: NodeState) -> None:
        """This node's workers run the generation ``state`` starts."""
        self._last_gen = state.gen

    def _finish(self, state: NodeState) -> int:
        ended = state.ended
        self.closed = ended.reason if ended is not None else "it finished"
        return 0

    async def changes(self, admitted: NodeState) -> int:
        me = self._node
        try:
            current = await self._refresh()
            watch = watched_nodes(current, me, running=True)
            await self._observe(watch)
        except LINK_ERRORS as exc:  # the next call tries again; the workers go on meanwhile
            self._link_lost(exc)
            return 0
        now = asyncio.get_running_loop().time()
        view = View(self._beats.dead(watch, now), now, node_timeout=self._spec.node_timeout)
        step = running_step(
            current, me, view, run=admitted.run, gen=admitted.gen, succeeded=False, failure=None
        )
        if isinstance(step, Write):
            try:
                await self._write(step.state)
            except LINK_ERRORS as exc:
                self._link_lost(exc)
                return 0
            self._console.log(step.note)
            step = running_step(
                self._state, me, view, run=admitted.run, gen=admitted.gen, succeeded=False, failure=None
            )
        if isinstance(step, (Ended, Finished)):
            after = step.state
            return max(1, abs(len(after.expected or after.ids()) - len(admitted.nodes)))
        return 0

    async def is_over(self) -> bool:
        state = await self._refresh()
        return state is not None and state.phase == FINISHED and state.run == self._run

    async def close_job(self, reason: str) -> None:
        for _ in range(8):
            state = await self._refresh()
            if state is None or state.run != self._run:
                return
            new = close_run(state, reason, self._node.id)
            if new is None or await self._write(new):
                if new is not None:
                    self._console.log(f"job {self._config.job!r} closed: {reason}")
                return

    async def close_job_bounded(self, reason: str) -> None:
        """``close_job`` within the operation timeout; a coordinator that does not answer (or a
        state it cannot read) is logged, and the other agents then find this node gone."""
        try:
            await asyncio.wait_for(self.close_job(reason), self._op_timeout)
        except (*LINK_ERRORS, NodeStateError) as exc:
            self._console.log(f"could not close job {self._config.job!r} ({exc!r})")

    async def finish(self, reason: str) -> None:
        await self.close_job_bounded(reason)
        await self.close()  # the session is closed whether the job could be closed or not


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get(key)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--rdzv-conf {key}={value!r} is not a number of seconds") from None
    if seconds <= 0:
        raise ValueError(f"--rdzv-conf {key}={value!r} must be positive")
    return seconds


def _tell_the_workers(coordinator: tuple[str, int], job: str, token: str | None) -> None:
    """Let the workers (which inherit this process's environment) join the job at the coordinator."""
    os.environ.setdefault("AIOCOLL_COORDINATOR", format_host_port(*coordinator))
    os.environ.setdefault("AIOCOLL_JOB", job)
    if token:
        os.environ.setdefault("AIOCOLL_TOKEN", token)


def _loop_run(coroutine: Any) -> Any:
    return get_loop_thread().run(coroutine)


def handler_creator() -> Any:
    """The entry point torch's agent loads (group ``torchrun.handlers``, name ``aiocoll``): it
    returns the function that makes the handler from torchrun's rendezvous parameters."""
    return AiocollRendezvousHandler
