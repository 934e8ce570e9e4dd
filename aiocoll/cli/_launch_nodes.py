"""The node rendezvous of an elastic `aiocoll run` (--nnodes MIN:MAX), as pure decisions.

Each launcher is a node agent. The agents of one job share one record in the job's key space on
the coordinator, the *node state*: which generation forms or runs, its nodes in node-rank order,
the nodes waiting to be admitted, the restarts after failures used so far. Every change is one
compare-and-set of the whole record, so when two agents decide at once only one decision
stands, and the other agent decides again from what won. What an agent writes follows from the
record and from what it has seen itself (whose beats stopped, its own workers' outcome, its own
clock for the join window), through the functions here, which return what to write or what to
do; _launch_elastic carries that out. As in torch elastic's dynamic_rendezvous, decision apart
from effect: no I/O, no clock reads and no event loop here, so every rule is unit-tested.

Imports only the standard library and _launch_config's RankLayout.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ._launch_config import RankLayout

__all__ = [
    "CLOSED",
    "FAILED",
    "FINISHED",
    "FORMING",
    "JOINED",
    "LEFT",
    "LOST",
    "REJOINED",
    "RUNNING",
    "SUCCEEDED",
    "Admitted",
    "Beats",
    "Ended",
    "Ending",
    "Finished",
    "Node",
    "NodeState",
    "NodeStateError",
    "View",
    "Wait",
    "Write",
    "assign_node_ranks",
    "close_formation",
    "close_run",
    "decode_state",
    "encode_state",
    "end_failed",
    "end_generation",
    "end_reason",
    "formation_wait",
    "join_step",
    "layout_of",
    "leave",
    "mark_done",
    "new_run",
    "running_step",
    "watched_nodes",
]

# Phases of the node state.
FORMING, RUNNING, FINISHED = "forming", "running", "finished"
# Why a generation ended (Ending.kind). Only FAILED uses up --max-restarts. CLOSED: a node agent
# closed the job (torchrun's agents close the rendezvous when they are done, failed or not).
JOINED, LOST, LEFT, REJOINED, FAILED, SUCCEEDED = "joined", "lost", "left", "rejoined", "failed", "succeeded"
CLOSED = "closed"
_KINDS = frozenset({JOINED, LOST, LEFT, REJOINED, FAILED, SUCCEEDED, CLOSED})
_FORMAT = 1


class NodeStateError(ValueError):
    """The node state's key holds something this launcher did not write."""


@dataclass(frozen=True)
class Node:
    """One node agent (one `aiocoll run` process).

    Attributes:
        id: unique for the launcher process (its name and a random suffix).
        name: ``host:pid``, how people and logs tell the nodes apart.
        nproc: its --nproc-per-node.
        addr: the address it reaches the coordinator from (MASTER_ADDR when it is node rank 0).
        port: a port free there when it joined (MASTER_PORT when it is node rank 0).
    """

    id: str
    name: str
    nproc: int
    addr: str
    port: int


@dataclass(frozen=True)
class Ending:
    """How a generation ended.

    Attributes:
        gen: the generation.
        kind: JOINED, LOST, LEFT or REJOINED (a change of membership), FAILED (a worker failed),
            SUCCEEDED (every worker exited 0).
        reason: one line naming what happened, the node and, for a failure, the rank.
        cause: for a failure, the failed worker's last stderr line ("" if none).
        node: the id of the node where it happened ("" if none in particular).
    """

    gen: int
    kind: str
    reason: str
    cause: str = ""
    node: str = ""


@dataclass(frozen=True)
class NodeState:
    """The job's node state, one record shared by every node agent of the job.

    Attributes:
        run: a random id, new each time the job starts from nothing (or again after it finished).
        gen: the generation that forms or runs (0 first).
        phase: FORMING (nodes join), RUNNING (``nodes`` run workers) or FINISHED.
        nodes: FORMING: the nodes joined, in arrival order; RUNNING and FINISHED: the
            generation's nodes in node-rank order.
        waiting: nodes that arrived while the generation ran (or beyond MAX), to be admitted.
        expected: FORMING after a generation ended: the ids expected back (its nodes that were
            not lost, and the nodes that waited); None for the first generation.
        previous: the ids of the last generation's nodes in node-rank order (kept ranks stay).
        done: RUNNING: the nodes whose workers all exited 0.
        restarts: restarts after failures so far (TORCHELASTIC_RESTART_COUNT).
        min_nodes, max_nodes, max_restarts: the job's --nnodes and --max-restarts, as its first
            node gave them.
        ended: how the last generation ended, or None.
        exit_code: FINISHED: 0, or the exit status of the failure that ended the job.
        serial: counts writes, so that no write stores the bytes it replaces.
    """

    run: str
    gen: int
    phase: str
    nodes: tuple[Node, ...]
    min_nodes: int
    max_nodes: int
    max_restarts: int
    waiting: tuple[Node, ...] = ()
    expected: tuple[str, ...] | None = None
    previous: tuple[str, ...] = ()
    done: tuple[str, ...] = ()
    restarts: int = 0
    ended: Ending | None = None
    exit_code: int | None = None
    serial: int = 0

    def ids(self) -> list[str]:
        return [node.id for node in self.nodes]

    def find(self, node_id: str) -> Node | None:
        return next((node for node in (*self.nodes, *self.waiting) if node.id == node_id), None)


# -- the record's wire form ------------------------------------------------------------------------


def _node_fields(node: Node) -> list[Any]:
    return [node.id, node.name, node.nproc, node.addr, node.port]


def encode_state(state: NodeState) -> bytes:
    """The record's bytes: compact JSON, the same bytes for the same state."""
    ended = state.ended
    body = {
        "f": _FORMAT,
        "run": state.run,
        "gen": state.gen,
        "phase": state.phase,
        "nodes": [_node_fields(n) for n in state.nodes],
        "waiting": [_node_fields(n) for n in state.waiting],
        "expected": None if state.expected is None else list(state.expected),
        "previous": list(state.previous),
        "done": list(state.done),
        "restarts": state.restarts,
        "min": state.min_nodes,
        "max": state.max_nodes,
        "max_restarts": state.max_restarts,
        "ended": None if ended is None else [ended.gen, ended.kind, ended.reason, ended.cause, ended.node],
        "exit": state.exit_code,
        "serial": state.serial,
    }
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _int(value: Any) -> int:
    if type(value) is not int:
        raise TypeError(f"expected an integer, got {value!r:.60}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r:.60}")
    return value


def _strs(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r:.60}")
    return tuple(_str(item) for item in value)


def _nodes(value: Any) -> tuple[Node, ...]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list of nodes, got {value!r:.60}")
    nodes = []
    for item in value:
        if not isinstance(item, list) or len(item) != 5:
            raise TypeError(f"expected [id, name, nproc, addr, port], got {item!r:.60}")
        nodes.append(Node(_str(item[0]), _str(item[1]), _int(item[2]), _str(item[3]), _int(item[4])))
    return tuple(nodes)


def decode_state(raw: bytes) -> NodeState:
    """The record in ``raw``.

    Raises:
        NodeStateError: ``raw`` is not a node state this launcher can read.
    """
    try:
        body = json.loads(raw)
        if not isinstance(body, dict) or body.get("f") != _FORMAT:
            raise TypeError(f"not a node state of format {_FORMAT}")
        phase = _str(body["phase"])
        if phase not in (FORMING, RUNNING, FINISHED):
            raise TypeError(f"unknown phase {phase!r:.40}")
        ended_fields = body["ended"]
        ended = None
        if ended_fields is not None:
            if not isinstance(ended_fields, list) or len(ended_fields) != 5:
                raise TypeError("'ended' is not [gen, kind, reason, cause, node]")
            kind = _str(ended_fields[1])
            if kind not in _KINDS:
                raise TypeError(f"unknown ending {kind!r:.40}")
            ended = Ending(_int(ended_fields[0]), kind, *(_str(v) for v in ended_fields[2:]))
        expected = body["expected"]
        exit_code = body["exit"]
        return NodeState(
            run=_str(body["run"]),
            gen=_int(body["gen"]),
            phase=phase,
            nodes=_nodes(body["nodes"]),
            waiting=_nodes(body["waiting"]),
            expected=None if expected is None else _strs(expected),
            previous=_strs(body["previous"]),
            done=_strs(body["done"]),
            restarts=_int(body["restarts"]),
            min_nodes=_int(body["min"]),
            max_nodes=_int(body["max"]),
            max_restarts=_int(body["max_restarts"]),
            ended=ended,
            exit_code=None if exit_code is None else _int(exit_code),
            serial=_int(body["serial"]),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise NodeStateError(f"{exc} (in {bytes(raw[:80])!r})") from None


# -- what an agent has seen of the others ----------------------------------------------------------


class Beats:
    """What one agent has seen of other nodes' beat counters, by its own clock.

    A node agent adds 1 to its counter every tick. A node is dead to this agent once its counter
    has not moved for ``timeout`` seconds of this agent's reading it; a node never read is not
    judged. Times are the caller's monotonic clock, passed in.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        # node id -> (last value read, when it was first read with that value)
        self._seen: dict[str, tuple[int, float]] = {}

    def observe(self, node_id: str, value: int, now: float) -> None:
        seen = self._seen.get(node_id)
        if seen is None or seen[0] != value:
            self._seen[node_id] = (value, now)

    def value(self, node_id: str) -> int | None:
        seen = self._seen.get(node_id)
        return None if seen is None else seen[0]

    def dead(self, node_ids: Iterable[str], now: float) -> frozenset[str]:
        """The nodes among ``node_ids`` whose counter has not moved for the timeout."""
        return frozenset(
            node_id
            for node_id in node_ids
            if (seen := self._seen.get(node_id)) is not None and now - seen[1] >= self.timeout
        )

    def moved_past(self, baseline: dict[str, int]) -> bool:
        """Every node of ``baseline`` (id -> a value read earlier) has beaten since."""
        return all((self.value(node_id) or 0) > value for node_id, value in baseline.items())

    def keep(self, node_ids: Iterable[str]) -> None:
        """Forget every node but ``node_ids`` (a node seen again starts its clock again)."""
        wanted = set(node_ids)
        for node_id in [n for n in self._seen if n not in wanted]:
            del self._seen[node_id]


@dataclass(frozen=True)
class View:
    """What this agent brings to a decision besides the record.

    Attributes:
        dead: the nodes whose beats this agent has seen stop (Beats.dead).
        now: this agent's monotonic clock.
        min_since: when this agent first saw the forming generation with MIN live nodes, or None.
        join_window: --rdzv-join-window.
        node_timeout: how long a node's beats may stop before it is dead (--heartbeat-timeout).
    """

    dead: frozenset[str] = frozenset()
    now: float = 0.0
    min_since: float | None = None
    join_window: float = 0.0
    node_timeout: float = 0.0


# -- decisions -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Write:
    """Compare-and-set the record to ``state``; ``note`` says what that does (logged if it wins)."""

    state: NodeState
    note: str = ""


@dataclass(frozen=True)
class Wait:
    """Nothing to write now; ``note`` says what is waited for (logged when it changes)."""

    note: str = ""


@dataclass(frozen=True)
class Admitted:
    """The generation in ``state`` runs with this node: start its workers."""

    state: NodeState


@dataclass(frozen=True)
class Ended:
    """This node's generation is over (``state`` says what came after): stop its workers."""

    state: NodeState


@dataclass(frozen=True)
class Finished:
    """The job is over, ``state.exit_code`` says how."""

    state: NodeState


def _bump(state: NodeState, **changes: Any) -> NodeState:
    return replace(state, serial=state.serial + 1, **changes)


def _without(nodes: Sequence[Node], node_ids: Iterable[str]) -> tuple[Node, ...]:
    gone = set(node_ids)
    return tuple(node for node in nodes if node.id not in gone)


def new_run(run: str, me: Node, *, min_nodes: int, max_nodes: int, max_restarts: int) -> NodeState:
    """The record of a job that starts now, with ``me`` as its first node."""
    return NodeState(
        run=run,
        gen=0,
        phase=FORMING,
        nodes=(me,),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        max_restarts=max_restarts,
    )


def assign_node_ranks(previous: Sequence[str], joined: Sequence[Node]) -> tuple[Node, ...]:
    """Node-rank order of a new generation: the nodes of the last generation keep their order
    (node rank 0 stays where it was while it stays), then the others in the order they joined."""
    position = {node_id: index for index, node_id in enumerate(previous)}
    kept = sorted((node for node in joined if node.id in position), key=lambda node: position[node.id])
    return (*kept, *(node for node in joined if node.id not in position))


def layout_of(state: NodeState, node_id: str) -> RankLayout:
    """Where ``node_id``'s workers sit in the generation ``state`` runs: its node rank, the
    global rank of its local rank 0 (the workers of lower node ranks come first) and the world
    size (every node's --nproc-per-node together)."""
    ids = state.ids()
    node_rank = ids.index(node_id)
    return RankLayout(
        node_rank=node_rank,
        nnodes=len(ids),
        first_rank=sum(node.nproc for node in state.nodes[:node_rank]),
        world_size=sum(node.nproc for node in state.nodes),
    )


def _names(nodes: Iterable[Node]) -> str:
    return ", ".join(node.name for node in nodes)


def formation_wait(state: NodeState, view: View) -> str | None:
    """None when the forming generation may start now, else what it waits for.

    It starts when MAX live nodes joined; or when at least MIN did and no node expected back
    (a node of the last generation not seen dead, or a node that waited) is still missing, and
    either the expected nodes alone make MIN (a running job carries on at once) or the join
    window has passed since this agent saw MIN live nodes (the first generation, or one that
    needed new nodes to reach MIN).
    """
    live = [node for node in state.nodes if node.id not in view.dead]
    if len(live) >= state.max_nodes:
        return None
    present = {node.id for node in (*live, *state.waiting)}
    pending = [
        node_id for node_id in state.expected or () if node_id not in present and node_id not in view.dead
    ]
    if pending:
        return (
            f"{len(live)} node(s) joined, waiting for {len(pending)} node(s) of the last generation to "
            "stop their workers and join again"
        )
    if len(live) < state.min_nodes:
        wanted = f"--nnodes {state.min_nodes}:{state.max_nodes}"
        return f"{len(live)} node(s) joined, waiting for at least {state.min_nodes} ({wanted})"
    returning = sum(1 for node in live if node.id in (state.expected or ()))
    if state.expected is not None and returning >= state.min_nodes:
        return None
    if view.min_since is not None and view.now - view.min_since >= view.join_window:
        return None
    return (
        f"{len(live)} node(s) joined; waiting up to {view.join_window:g}s (--rdzv-join-window) for more, "
        f"up to {state.max_nodes}"
    )


def close_formation(state: NodeState, view: View) -> NodeState:
    """The forming generation, started: its live nodes in node-rank order (at most MAX; the rest
    wait as spares), nodes seen dead dropped."""
    live = [node for node in state.nodes if node.id not in view.dead]
    ordered = assign_node_ranks(state.previous, live)
    members, spares = ordered[: state.max_nodes], ordered[state.max_nodes :]
    return _bump(
        state,
        phase=RUNNING,
        nodes=members,
        waiting=(*spares, *_without(state.waiting, view.dead)),
        expected=None,
        done=(),
    )


def end_generation(
    state: NodeState, kind: str, reason: str, *, gone: Iterable[str] = (), node: str = ""
) -> NodeState:
    """The running generation, ended by a change of membership (``kind`` JOINED, LOST, LEFT or
    REJOINED): the next one forms, expecting back every node but ``gone``, and the nodes that
    waited. --max-restarts is not used up."""
    gone_ids = set(gone)
    expected = [n.id for n in (*state.nodes, *state.waiting) if n.id not in gone_ids]
    return _bump(
        state,
        gen=state.gen + 1,
        phase=FORMING,
        nodes=(),
        waiting=(),
        expected=tuple(expected),
        previous=tuple(state.ids()),
        done=(),
        ended=Ending(state.gen, kind, reason, node=node),
    )


def end_failed(state: NodeState, reason: str, cause: str, node: str, exit_code: int) -> NodeState:
    """The running generation, ended by a worker's failure: restarted (every node expected back)
    while --max-restarts allows, else the job is over with ``exit_code``."""
    ending = Ending(state.gen, FAILED, reason, cause=cause, node=node)
    if state.restarts < state.max_restarts:
        restarted = end_generation(state, FAILED, reason, node=node)
        return replace(restarted, restarts=state.restarts + 1, ended=ending)
    return _bump(state, phase=FINISHED, ended=ending, exit_code=exit_code, waiting=())


def mark_done(state: NodeState, node_id: str) -> NodeState:
    """``node_id``'s workers all exited 0; when it is the last node of the generation to say so,
    the job is over and succeeded."""
    done = (*state.done, node_id)
    if set(done) >= set(state.ids()):
        reason = f"every worker of generation {state.gen} ({len(state.nodes)} node(s)) exited 0"
        ending = Ending(state.gen, SUCCEEDED, reason)
        return _bump(state, phase=FINISHED, done=done, waiting=(), exit_code=0, ended=ending)
    return _bump(state, done=done)


def close_run(state: NodeState | None, reason: str, node: str) -> NodeState | None:
    """The job, closed by node agent ``node``: FINISHED, so that no generation forms again in
    this run and an agent that asks to join it learns that it is over; None when it already is
    (or there is no job)."""
    if state is None or state.phase == FINISHED:
        return None
    ending = Ending(state.gen, CLOSED, reason, node=node)
    return _bump(state, phase=FINISHED, waiting=(), exit_code=0, ended=ending)


def end_reason(state: NodeState, view: View) -> Write | None:
    """A change of membership that ends the running generation: one of its nodes seen dead, or a
    node waiting while there is room below MAX (not once a node has finished: its workers'
    exit 0 is not undone to admit another)."""
    dead = [node for node in state.nodes if node.id in view.dead]
    if dead:
        names = _names(dead)
        reason = (
            f"node(s) {names} lost: their launcher stopped beating for {view.node_timeout:g}s "
            "(it died, or lost the coordinator)"
        )
        return Write(end_generation(state, LOST, reason, gone=(n.id for n in dead)), reason)
    live_waiting = [node for node in state.waiting if node.id not in view.dead]
    if live_waiting and len(state.nodes) < state.max_nodes and not state.done:
        reason = f"node(s) {_names(live_waiting)} asked to join"
        return Write(end_generation(state, JOINED, reason), reason)
    return None


def join_step(
    state: NodeState | None,
    me: Node,
    view: View,
    *,
    run: str | None,
    last_gen: int,
    fresh: NodeState,
) -> Write | Wait | Admitted | Finished:
    """What a node agent without workers does next: join, wait, or start its workers.

    Args:
        state: the record, or None when the job has none yet.
        me: this node (with a port found free just now).
        view: what this agent saw (dead nodes, its clock, the join window).
        run: the run this agent has taken part in (None before it first joined one).
        last_gen: the last generation this agent ran workers in (-1: none).
        fresh: the record to write when the job starts (again) with this node.
    """
    if state is None:
        return Write(fresh, f"job starts; {me.name} is its first node")
    if state.phase == FINISHED:
        if state.run == run:
            return Finished(state)
        how = state.ended.reason if state.ended is not None else "it finished"
        return Write(fresh, f"the job had finished ({how}); it starts again, {me.name} its first node")
    ids = state.ids()
    if state.phase == FORMING:
        if me.id not in ids:
            live = [node for node in state.nodes if node.id not in view.dead]
            if len(live) >= state.max_nodes:
                if state.find(me.id) is not None:
                    return Wait(f"generation {state.gen} has its {state.max_nodes} nodes (MAX); a spare")
                spare = _bump(state, waiting=(*state.waiting, me))
                return Write(
                    spare, f"joined as a spare: generation {state.gen} has its {state.max_nodes} nodes (MAX)"
                )
            return Write(
                _bump(state, nodes=(*state.nodes, me), waiting=_without(state.waiting, [me.id])),
                f"joined generation {state.gen}",
            )
        why = formation_wait(state, view)
        if why is not None:
            return Wait(why)
        started = close_formation(state, view)
        return Write(started, f"generation {state.gen} starts with {len(started.nodes)} node(s)")
    # RUNNING
    if me.id in ids:
        if state.gen > last_gen:
            return Admitted(state)
        # Still listed in a generation whose workers it stopped (it lost the coordinator for a
        # while): the others must start one without those workers.
        reason = f"node {me.name} dropped out of generation {state.gen} (its workers stopped) and joins again"
        return Write(end_generation(state, REJOINED, reason, node=me.id), reason)
    ending = end_reason(state, view)
    if ending is not None:
        return ending
    if state.find(me.id) is None:
        return Write(
            _bump(state, waiting=(*state.waiting, me)),
            f"generation {state.gen} runs with {len(state.nodes)} node(s); asked to join",
        )
    if len(state.nodes) >= state.max_nodes:
        return Wait(
            f"generation {state.gen} runs with its {state.max_nodes} nodes (MAX); a spare until one leaves"
        )
    return Wait(f"generation {state.gen} is finishing; waiting to be admitted")


def running_step(
    state: NodeState | None,
    me: Node,
    view: View,
    *,
    run: str,
    gen: int,
    succeeded: bool,
    failure: tuple[str, str, int] | None,
) -> Write | Wait | Ended | Finished:
    """What a node agent whose workers run generation ``gen`` does next.

    Args:
        state: the record.
        me: this node.
        view: what this agent saw.
        run: the run this generation belongs to.
        gen: the generation its workers run.
        succeeded: its workers all exited 0.
        failure: (reason, cause, exit status) of its workers' failure, once it is this node's to
            report (it was the generation's first, and every other node beat since: no node was
            lost, which would explain the failure instead).
    """
    if state is None:
        return Ended(
            NodeState(run="", gen=gen + 1, phase=FORMING, nodes=(), min_nodes=0, max_nodes=0, max_restarts=0)
        )
    if state.run != run or state.gen != gen or state.phase != RUNNING or me.id not in state.ids():
        if state.phase == FINISHED and state.run == run and state.gen == gen:
            return Finished(state)
        return Ended(state)
    ending = end_reason(state, view)
    if ending is not None:
        return ending
    if failure is not None:
        reason, cause, exit_code = failure
        new = end_failed(state, reason, cause, me.id, exit_code)
        return Write(new, reason)
    if succeeded and me.id not in state.done:
        return Write(mark_done(state, me.id), f"every worker of {me.name} exited 0")
    return Wait()


def leave(state: NodeState | None, me: Node, reason: str) -> NodeState | None:
    """The record without ``me`` (its launcher stops): a running generation it is in ends (kind
    LEFT); None when there is nothing to change."""
    if state is None or state.phase == FINISHED:
        return None
    if state.find(me.id) is None and me.id not in (state.expected or ()):
        return None
    if state.phase == RUNNING and me.id in state.ids():
        return end_generation(state, LEFT, reason, gone=[me.id], node=me.id)
    expected = None if state.expected is None else tuple(i for i in state.expected if i != me.id)
    nodes, waiting = _without(state.nodes, [me.id]), _without(state.waiting, [me.id])
    return _bump(state, nodes=nodes, waiting=waiting, expected=expected)


def watched_nodes(state: NodeState | None, me: Node, *, running: bool) -> list[str]:
    """Whose beats this agent reads each tick. A node running workers reads only the next node
    in node-rank order (a ring: every node is watched once, and the work is the same on every
    node whatever the size); a node without workers (forming, or waiting to be admitted) reads
    every node it may wait for, so that a dead job's record does not hold it back."""
    if state is None or state.phase == FINISHED:
        return []
    ids = state.ids()
    if running and me.id in ids:
        if len(ids) < 2:
            return []
        return [ids[(ids.index(me.id) + 1) % len(ids)]]
    others = [*ids, *(n.id for n in state.waiting), *(state.expected or ())]
    return list(dict.fromkeys(node_id for node_id in others if node_id != me.id))
