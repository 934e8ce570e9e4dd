"""Per-step fault tolerance without restart: ``Manager``, a replica's side of the coordinator's quorums.

Public surface (an addition to the contract, docs/FAULT_TOLERANCE.md); imports the async API, the
client's coordinator session and foundations; never torch (the torch wrapper is
aiocoll/ft_torch.py).

A *replica* holds one copy of the model: one process, or several ranks (``replica_size``; the
model sharded or data-parallel inside it), each with its own Manager. At each step boundary every
rank asks the coordinator for a quorum (server/_quorum.py), which counts a replica only when all
its ranks asked. The step's collectives run over a process group of that quorum, made when the
quorum changed (the old one destroyed): job ``JOB/qID`` of the replicas; for replicas of several
ranks, job ``JOB/qID/sR`` of the ranks with one ``replica_rank`` R (one per replica), and the
commit over job ``JOB/qID`` of every rank. A replica lost
mid-step fails that step's operations on the others within seconds (PeerLostError, as always);
they commit nothing, and their next quorum leaves it out: no restart, no rendezvous. Survivors of
one-rank replicas form that quorum's group over the links of the group they all hold
(``ProcessGroup._survivors_group``), without connecting anew. A
new or restarted replica joins at the next quorum and first receives the state (a torch
state_dict, any pytree of arrays) from a live replica over the group's peer links.

    manager = Manager("10.0.0.1:29500", replica="r0", state_dict=get, load_state_dict=put)
    while manager.step < steps:
        await manager.start_step()                   # quorum; heal when behind
        grads = compute(params, batch(manager.step))
        await manager.all_reduce_mean(grads)         # False when the step failed
        if await manager.commit():                   # every replica of the quorum succeeded
            apply(params, grads)
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import pickle
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from aiocoll._deadline import Deadline
from aiocoll._env import env_int, env_text
from aiocoll._errors import CollectiveTimeout, DistError, PeerLostError, RendezvousError, StoreTimeout
from aiocoll._types import ReduceOp
from aiocoll.api import ProcessGroup
from aiocoll.client.bootstrap import host_port, join_coordinator
from aiocoll.client.control.session import CoordinatorSession
from aiocoll.protocol._coordinator import ROLE_STORE

__all__ = ["Manager", "QuorumError", "StepFailed"]

log = logging.getLogger("aiocoll.ft")

_BEAT_EVERY = 1.0  # the coordinator counts a replica gone after its heartbeat timeout of silence
_DESTROY_TIMEOUT = 5.0  # an old group's goodbye may not hold up the next step longer than this
_HEAL_TAG = 0x4845414C  # the point-to-point tag of state transfers ("HEAL")
_STAGED_BYTES = 256 << 20  # host copies of device tensors a heal's sender keeps in flight, at most


class QuorumError(DistError):
    """No quorum could be formed (or joined) within the Manager's ``quorum_timeout``.

    Raised by ``Manager.start_step``; also on a rank of a replica of several ranks that lost one
    of them, at once or when no new process of the lost rank asked within ``replace_timeout``
    (the coordinator leaves the replica out whole; the message names the lost rank, its replica
    and host). The message names this replica, its rank in the last quorum
    and its host, and what the coordinator said: how many replicas asked (by name) and which ones
    of the previous quorum it waited for, or why it could not be reached.

    Attributes:
        replica: this replica's name.
        step: the steps this replica had committed.
    """

    __module__ = "aiocoll.ft"

    def __init__(self, message: str, *, replica: str, step: int) -> None:
        super().__init__(message)
        self.replica = replica
        self.step = step


class StepFailed(DistError):
    """Why a step did not commit: kept in ``Manager.last_error`` and logged, never raised.

    The message names this replica (rank, host), the step, the operation that failed and the
    replicas it involves, each with its rank in the quorum's group and its host.

    Attributes:
        step: the step that failed.
        quorum_id: the quorum it ran in.
        replicas: the replicas the failure names (lost, or did not answer in time).
        ranks: their ranks in the quorum's group, in the same order.
        hosts: their hosts, in the same order.
        cause: the error of the operation that failed (a ``PeerLostError``,
            ``CollectiveTimeout``, ...).
    """

    __module__ = "aiocoll.ft"

    def __init__(
        self,
        message: str,
        *,
        step: int,
        quorum_id: int,
        replicas: Sequence[str] = (),
        ranks: Sequence[int] = (),
        hosts: Sequence[str] = (),
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.step = step
        self.quorum_id = quorum_id
        self.replicas = list(replicas)
        self.ranks = list(ranks)
        self.hosts = list(hosts)
        self.cause = cause


# ---------------------------------------------------------------------------------------------
# state transfer: a pickle whose arrays travel apart, straight from and into their memory


def _torch_tensor(obj: object) -> Any:
    """``obj`` as a dense torch tensor (detached) when it is one, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.layout is not torch.strided or obj.is_quantized or obj.device.type == "meta":
        return None  # left to pickle itself
    return obj.detach()


def _walk(state: Any) -> dict[int, tuple[Any, ...]]:
    """Where each array of a state sits: ``id(array) -> path`` (the keys and indices leading to it).

    Only through dicts, lists and tuples (a state_dict, a pytree); an array held elsewhere (an
    attribute of an object) has no path, and is received into new memory.
    """
    found: dict[int, tuple[Any, ...]] = {}
    todo: list[tuple[Any, tuple[Any, ...]]] = [(state, ())]
    while todo:
        obj, path = todo.pop()
        if isinstance(obj, dict):
            todo.extend((v, (*path, k)) for k, v in obj.items())
        elif isinstance(obj, (list, tuple)):
            todo.extend((v, (*path, i)) for i, v in enumerate(obj))
        elif type(obj) is np.ndarray or _torch_tensor(obj) is not None:
            found.setdefault(id(obj), path)
    return found


def pack_state(state: Any) -> tuple[np.ndarray, list[Any]]:
    """Split a state into a small pickle and the arrays it holds, for ``send_state``.

    Numpy arrays and dense torch tensors are kept apart and sent as they are, without a copy into
    the pickle; everything else (containers, numbers, strings) is pickled. Each array's path in
    the state (its keys) goes with it, so that a receiver can receive it into its own array at
    the same place.

    Args:
        state: any picklable object: a state_dict, a pytree of arrays.

    Returns:
        The pickle as a uint8 array, and the arrays in the order the pickle refers to them.
    """
    arrays: list[Any] = []
    shapes: list[tuple[str, str, tuple[int, ...], tuple[Any, ...] | None]] = []
    paths = _walk(state)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            path = paths.get(id(obj))
            if type(obj) is np.ndarray and not obj.dtype.hasobject:
                shapes.append(("np", obj.dtype.str, obj.shape, path))
            else:
                tensor = _torch_tensor(obj)
                if tensor is None:
                    return None
                shapes.append(("torch", str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), path))
                obj = tensor
            arrays.append(obj)
            return len(arrays) - 1

    inner = io.BytesIO()
    _Pickler(inner, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    outer = pickle.dumps((shapes, inner.getvalue()), protocol=pickle.HIGHEST_PROTOCOL)
    return np.frombuffer(outer, np.uint8), arrays


def _receivable(obj: Any) -> tuple[str, str, tuple[int, ...], int] | None:
    """(kind, dtype, shape, address) of an array a state may be received straight into, else None.

    It must be in host memory, contiguous and writeable: a receive fills its memory as it is.
    """
    if type(obj) is np.ndarray:
        if obj.dtype.hasobject or not obj.flags.c_contiguous or not obj.flags.writeable:
            return None
        return "np", obj.dtype.str, obj.shape, int(obj.__array_interface__["data"][0])
    tensor = _torch_tensor(obj)
    if tensor is None or tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_conj():
        return None
    return "torch", str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), int(tensor.data_ptr())


def _buffers(shapes: Sequence[tuple[Any, ...]], into: Any) -> tuple[list[Any], int]:
    """The arrays to receive a state's arrays into, and how many of them are ``into``'s own.

    An array of the sender's state is received straight into the receiver's own array at the
    same path (``into``: the receiver's own state) when it has the same kind, dtype and shape,
    so that the heal writes no memory twice and touches no new memory; any other into a new
    array. Each own array (each memory) is used once.
    """
    own: dict[tuple[Any, ...], Any] = {}
    if into is not None:
        paths = _walk(into)
        todo: list[Any] = [into]
        while todo:
            obj = todo.pop()
            if isinstance(obj, dict):
                todo.extend(obj.values())
            elif isinstance(obj, (list, tuple)):
                todo.extend(obj)
            elif id(obj) in paths:
                own.setdefault(paths[id(obj)], obj)
    buffers, mine, used = [], 0, set()
    for kind, dtype, shape, *rest in shapes:
        path = rest[0] if rest else None
        target = own.get(path) if path is not None else None
        fit = _receivable(target) if target is not None else None
        if fit is not None and fit[:3] == (kind, dtype, tuple(shape)) and fit[3] not in used:
            used.add(fit[3])
            buffers.append(target if kind == "np" else _torch_tensor(target))
            mine += 1
        else:
            buffers.append(_empty_like(kind, dtype, shape))
    return buffers, mine


def _empty_like(kind: str, dtype: str, shape: tuple[int, ...]) -> Any:
    if kind == "np":
        return np.empty(shape, np.dtype(dtype))
    import torch  # the source sent torch tensors: this process uses torch too

    return torch.empty(shape, dtype=getattr(torch, dtype))


def _numel(array: Any) -> int:
    return int(array.size) if isinstance(array, np.ndarray) else int(array.numel())


def _nbytes(array: Any) -> int:
    return int(array.nbytes) if isinstance(array, np.ndarray) else int(array.numel() * array.element_size())


def _unpickle(inner: bytes, arrays: list[Any]) -> Any:
    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return arrays[pid]

    return _Unpickler(io.BytesIO(inner)).load()


async def send_state(pg: ProcessGroup, packed: tuple[np.ndarray, list[Any]], dst: int, timeout: float) -> int:
    """Send a ``pack_state`` result to one rank of a group, over the group's peer links.

    Device tensors (CUDA) are sent from host copies, at most 256 MiB of them at a time: the
    receiver receives into host memory.

    Args:
        pg: the group.
        packed: what ``pack_state`` returned.
        dst: the receiving rank in ``pg``.
        timeout: seconds each send may take.

    Returns:
        The number of bytes sent.

    Raises:
        aiocoll.DistError: a send failed (``PeerLostError``, ``CollectiveTimeout``, ...).
    """
    head, arrays = packed
    works = [pg.send(np.array([head.size], np.int64), dst, _HEAL_TAG, timeout=timeout)]
    works.append(pg.send(head, dst, _HEAL_TAG, timeout=timeout))
    staged = 0
    for a in arrays:
        if not _numel(a):
            continue
        host = _on_host(a)
        if host is not a:
            staged += _nbytes(host)
        works.append(pg.send(host, dst, _HEAL_TAG, timeout=timeout))  # posted now, in order
        if staged >= _STAGED_BYTES:  # bound the host copies in flight
            await _all(works)
            works, staged = [], 0
    await _all(works)
    return int(head.size) + sum(_nbytes(a) for a in arrays)


def _on_host(array: Any) -> Any:
    """``array`` when it is in host memory; else a host copy of it (a CUDA tensor).

    The receiver always receives into host memory (it may have no device), and a message must
    be sent as it is received: a device tensor is sent from a host copy.
    """
    if isinstance(array, np.ndarray) or array.device.type == "cpu":
        return array
    return array.cpu()


async def recv_state(
    pg: ProcessGroup,
    src: int,
    timeout: float,
    *,
    into: Any = None,
    on_overwrite: Callable[[], None] | None = None,
) -> tuple[Any, int]:
    """Receive what ``send_state`` sent from one rank of a group.

    The pickle comes from an authenticated peer of this job (every peer link proves the job's
    token), which is what makes unpickling it acceptable.

    Args:
        pg: the group.
        src: the sending rank in ``pg``.
        timeout: seconds each receive may take.
        into: the receiver's own state (its ``state_dict()``): arrays at the same paths with the
            same dtype and shape (contiguous, in host memory) are received into in place, and
            the state returned holds them; the others arrive in new arrays.
        on_overwrite: called before the first receive into one of ``into``'s arrays (from then
            on, a failure leaves the receiver's state partly overwritten).

    Returns:
        The state (arrays as numpy arrays or CPU torch tensors) and the number of bytes received.

    Raises:
        aiocoll.DistError: a receive failed (``PeerLostError``, ``CollectiveTimeout``, ...).
    """
    size = np.zeros(1, np.int64)
    await pg.recv(size, src, _HEAL_TAG, timeout=timeout)
    head = np.empty(int(size[0]), np.uint8)
    await pg.recv(head, src, _HEAL_TAG, timeout=timeout)
    shapes, inner = pickle.loads(head.tobytes())
    arrays, mine = _buffers(shapes, into)
    if mine and on_overwrite is not None:
        on_overwrite()
    await _all([pg.recv(a, src, _HEAL_TAG, timeout=timeout) for a in arrays if _numel(a)])
    return _unpickle(inner, arrays), int(head.size) + sum(_nbytes(a) for a in arrays)


async def broadcast_state(
    pg: ProcessGroup,
    packed: tuple[np.ndarray, list[Any]] | None,
    src: int,
    timeout: float,
    *,
    into: Any = None,
    on_overwrite: Callable[[], None] | None = None,
) -> tuple[Any, int]:
    """Send a state from one rank of a group to all the others at once (a broadcast per array).

    For when every other rank heals from ``src``: the broadcast's algorithm spreads the sending
    over the receivers instead of loading ``src`` with every copy. Device tensors (CUDA) are
    sent from host copies, at most 256 MiB of them at a time.

    Args:
        pg: the group; every rank calls this.
        packed: on ``src``, what ``pack_state`` returned; elsewhere None.
        src: the sending rank in ``pg``.
        timeout: seconds each broadcast may take.
        into: on a receiver, its own state to receive into in place (as ``recv_state``).
        on_overwrite: as ``recv_state``'s.

    Returns:
        The state (on ``src``: None) and the number of bytes it holds.

    Raises:
        aiocoll.DistError: a broadcast failed (``PeerLostError``, ``CollectiveTimeout``, ...).
    """
    sending = pg.rank == src
    if sending:
        assert packed is not None
        head, arrays = packed
        head = head.copy()  # a broadcast writes its result into the root's array too
        size = np.array([head.size], np.int64)
    else:
        size = np.zeros(1, np.int64)
    await pg.broadcast(size, src, timeout=timeout)
    if not sending:
        head = np.empty(int(size[0]), np.uint8)
    await pg.broadcast(head, src, timeout=timeout)
    shapes, inner = pickle.loads(head.tobytes())
    if not sending:
        arrays, mine = _buffers(shapes, into)
        if mine and on_overwrite is not None:
            on_overwrite()
    works, staged = [], 0
    for a in arrays:
        if not _numel(a):
            continue
        host = _on_host(a) if sending else a
        if isinstance(host, np.ndarray) and not host.flags.writeable:
            host = host.copy()
        if host is not a:
            staged += _nbytes(host)
        works.append(pg.broadcast(host, src, timeout=timeout))  # posted now, in order
        if staged >= _STAGED_BYTES:
            await _all(works)
            works, staged = [], 0
    await _all(works)
    nbytes = int(head.size) + sum(_nbytes(a) for a in arrays)
    if sending:
        return None, nbytes
    return _unpickle(inner, arrays), nbytes


def _single_source(heal: Mapping[int, int], members: int) -> int | None:
    """The member every other member heals from, when there is one and they are three or more.

    ``heal``: the quorum's heal plan, {member index: its source} for the members that heal.
    """
    if members < 3 or len(heal) != members - 1:
        return None
    sources = set(heal.values())
    if len(sources) != 1:
        return None
    src = sources.pop()
    return None if src in heal else src


async def _all(works: Sequence[Any]) -> None:
    """Await every one (none left running unobserved); raise the first failure."""
    results = await asyncio.gather(*works, return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


# ---------------------------------------------------------------------------------------------
# the manager


def _default_coordinator() -> str:
    named = env_text("AIOCOLL_COORDINATOR")
    if named:
        return named
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if host and port:
        return f"{host}:{port}"
    raise ValueError(
        "Manager: no coordinator given: pass coordinator='HOST:PORT', or set AIOCOLL_COORDINATOR "
        "(aiocoll run sets it) or MASTER_ADDR and MASTER_PORT"
    )


def _default_replica() -> str:
    named = env_text("AIOCOLL_REPLICA")
    if named:
        return named
    rank = os.environ.get("RANK")
    return f"replica{rank}" if rank else f"{socket.gethostname()}:{os.getpid()}"


async def _destroy_quietly(groups: Iterable[ProcessGroup]) -> None:
    """Destroy ``groups``, each within a bound; errors ignored (they are going)."""
    for g in groups:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(g.destroy(), _DESTROY_TIMEOUT)


class Manager:
    """One replica's side of per-step fault tolerance.

    A replica holds one copy of the model: one process, or ``replica_size`` ranks each with its
    own Manager (all must ask before the replica counts). Each step is ``start_step``
    (the quorum; a heal when behind), the step's collectives over the quorum's ``group``
    (``all_reduce_mean``), then ``commit``; a step that failed anywhere commits nowhere, and the
    next quorum leaves out the replicas that are gone. See docs/FAULT_TOLERANCE.md.

    Args:
        coordinator: "HOST:PORT" of the aiocoll coordinator (default: AIOCOLL_COORDINATOR, else
            MASTER_ADDR:MASTER_PORT). Start it with ``--state-dir`` to survive its own restart.
        replica: this replica's name, unique in the job and the same when it restarts (default:
            AIOCOLL_REPLICA, else replica{RANK}, else HOSTNAME:PID). Every rank of a replica of
            several ranks gives the same name.
        replica_rank: this process's rank inside its replica, 0..replica_size-1 (default:
            AIOCOLL_REPLICA_RANK, else 0). It runs the step's collectives with the ranks of the
            same ``replica_rank`` in the other replicas (its shard's peers), and heals from one.
        replica_size: the number of ranks (processes) of each replica (default:
            AIOCOLL_REPLICA_SIZE, else 1). The same on every rank of a replica; the coordinator
            counts a replica only when all of them asked, and leaves it out whole when one is
            gone.
        state_dict: returns the state a replica that is behind needs (model and optimizer
            state_dicts, any pytree of numpy arrays or torch tensors); called on a live replica
            when another one heals from it. May be set later as an attribute (aiocoll.ft_torch
            does), before the first ``start_step``.
        load_state_dict: takes that state on a replica that heals (arrays arrive as numpy
            arrays or CPU torch tensors). May be set later, like ``state_dict``.
        job: the job (default AIOCOLL_JOB, else "default"); its quorums' groups are jobs
            "JOB/qID" on the same coordinator.
        token: the shared secret (default AIOCOLL_TOKEN).
        min_replicas: a quorum needs at least this many replicas (more than half of them avoids
            two quorums training apart). Every replica of a job must give the same value.
        join_timeout: seconds a quorum waits for replicas of the previous quorum that are there
            but have not asked (as long as they are there, when none of those that asked holds
            the previous quorum's step: new and restarted replicas never train apart from
            them), and a job's first
            quorum for everyone; also how long a new quorum's group may take to form. Every
            replica must give the same value.
        timeout: seconds each collective of a step, and a heal, may take.
        quorum_timeout: seconds ``start_step`` may take in all (asking again after failures).
        replace_timeout: for a replica of several ranks: seconds a rank whose replica lost
            another rank waits in ``start_step`` for a new process of that rank (the same
            replica name and ``replica_rank``); then the replica counts again, in a new
            ``replica_generation``, and its ranks heal. 0: ``QuorumError`` at once (the replica
            restarts whole). Less than ``quorum_timeout``; counted from each ask, so an ask made
            again (after a failure, or a coordinator's restart) waits anew.

    Attributes:
        replica: this replica's name.
        replica_rank: this process's rank inside its replica.
        replica_size: the number of ranks of each replica.
        replica_generation: for a replica of several ranks, the generation of its ranks' own
            group (the same on all of them): it changes when that group must be made again (the
            replica's first quorum, a rank replaced, the replica back after being left out, a
            failure inside it). 0 before the first quorum, and for a replica of one rank.
        step: steps committed (the state's step).
        quorum_id: the current quorum's id (it changes when its membership changes).
        members: the current quorum's replicas, by name, in rank order.
        index: this replica's rank in ``group``.
        hosts: the members' hosts, in rank order.
        group: the current quorum's ProcessGroup of this shard: one rank per replica, the ones
            with this ``replica_rank`` (for more collectives of the step).
        quorum_group: the ProcessGroup of every rank of the current quorum (rank
            ``index * replica_size + replica_rank``), over which ``commit`` agrees; ``group``
            itself when ``replica_size`` is 1.
        last_error: why the last failed step failed (a StepFailed), else None.
        last_heal: ``{"source", "bytes", "seconds"}`` of the last state received, else None.

    Raises:
        ValueError: a setting out of range, or no coordinator given or found in the environment.
    """

    def __init__(
        self,
        coordinator: str | None = None,
        *,
        replica: str | None = None,
        replica_rank: int | None = None,
        replica_size: int | None = None,
        state_dict: Callable[[], Any] | None = None,
        load_state_dict: Callable[[Any], None] | None = None,
        job: str | None = None,
        token: str | None = None,
        min_replicas: int = 1,
        join_timeout: float = 10.0,
        timeout: float = 60.0,
        quorum_timeout: float = 600.0,
        replace_timeout: float = 0.0,
    ) -> None:
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(f"Manager: min_replicas must be a positive int, got {min_replicas!r}")
        for name, value in (
            ("join_timeout", join_timeout),
            ("timeout", timeout),
            ("quorum_timeout", quorum_timeout),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Manager: {name} must be a positive number of seconds, got {value!r}")
        if (
            isinstance(replace_timeout, bool)
            or not isinstance(replace_timeout, (int, float))
            or not replace_timeout >= 0
        ):
            raise ValueError(
                f"Manager: replace_timeout must be a number of seconds >= 0, got {replace_timeout!r}"
            )
        if replace_timeout >= quorum_timeout:
            raise ValueError(
                f"Manager: replace_timeout ({replace_timeout!r} s) must be less than quorum_timeout "
                f"({quorum_timeout!r} s), within which start_step waits in all"
            )
        self.coordinator = coordinator or _default_coordinator()
        self._host, self._port = host_port(self.coordinator, "coordinator")
        self.replica = replica or _default_replica()
        if not isinstance(self.replica, str) or not 0 < len(self.replica) <= 256:
            raise ValueError(f"Manager: replica must be a name of 1..256 characters, got {self.replica!r}")
        if replica_size is None:
            replica_size = env_int("AIOCOLL_REPLICA_SIZE") or 1
        if replica_rank is None:
            replica_rank = env_int("AIOCOLL_REPLICA_RANK") or 0
        for name, value in (("replica_size", replica_size), ("replica_rank", replica_rank)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Manager: {name} must be an int, got {value!r}")
        if not 0 <= replica_rank < replica_size:
            raise ValueError(
                f"Manager: replica_rank must be in 0..replica_size-1, got replica_rank={replica_rank}, "
                f"replica_size={replica_size}"
            )
        self.replica_rank = replica_rank
        self.replica_size = replica_size
        self.job = job or env_text("AIOCOLL_JOB") or "default"
        self._token = token if token is not None else (env_text("AIOCOLL_TOKEN", strip=False) or None)
        self.state_dict = state_dict
        self.load_state_dict = load_state_dict
        self.min_replicas = min_replicas
        self.join_timeout = float(join_timeout)
        self.timeout = float(timeout)
        self.quorum_timeout = float(quorum_timeout)
        self.replace_timeout = float(replace_timeout)
        self.host = socket.gethostname()
        self._uid = os.urandom(8).hex()  # this incarnation: a restart under the same name is new
        self.step = 0
        self.quorum_id = 0
        self.members: list[str] = []
        self.hosts: list[str] = []
        self.index = -1
        self.group: ProcessGroup | None = None
        self.quorum_group: ProcessGroup | None = None
        # The group last made through the coordinator (its own links and session), which
        # ``group`` may be a sub-group of, and its members' ranks in it by (name, incarnation).
        self._linked: ProcessGroup | None = None
        self._linked_ranks: dict[tuple[str, str], int] = {}
        self._rank_hosts: list[list[str]] = []  # each member's ranks' hosts
        self.last_error: StepFailed | None = None
        self.last_heal: dict[str, Any] | None = None
        self._session: CoordinatorSession | None = None
        self._beat: asyncio.Task[None] | None = None
        self._asks = 0
        self._renew = False  # the last step failed: ask for a fresh group
        self._restored = False  # restore(): the next asks may take the job back to ``step``
        self._failed: StepFailed | None = None  # the current step's failure
        self._in_step = False
        self._closed = False
        self._torn = False  # a heal failed after it began to overwrite this replica's own arrays
        self.replica_generation = 0
        self._inside_failed = False  # an operation on the replica's own group failed this step
        self._whole = True  # the replica's ranks hold one step's state (the coordinator's view)

    def __repr__(self) -> str:
        return (
            f"<aiocoll.ft.Manager replica {self.replica!r} job {self.job!r} step {self.step} "
            f"quorum {self.quorum_id} members {self.members}>"
        )

    @property
    def size(self) -> int:
        """The number of replicas in the current quorum."""
        return len(self.members)

    def _where(self) -> str:
        where = f"rank {self.index} of quorum {self.quorum_id}, " if self.index >= 0 else "in no quorum yet, "
        if self.replica_size == 1:
            return f"replica {self.replica!r} ({where}host {self.host})"
        rank = f"rank {self.replica_rank} of {self.replica_size}"
        return f"replica {self.replica!r} {rank} ({where}host {self.host})"

    def _whose(self, rank: int, kind: str) -> tuple[int, int]:
        """(member index, replica_rank) of a rank of a group.

        ``kind``: "shard" (``group``), "whole" (``quorum_group``), or "inside" (the group of this
        replica's own ranks, whose ranks are replica ranks).
        """
        if kind == "whole":
            return divmod(rank, self.replica_size)
        if kind == "inside":
            return self.index, rank
        return rank, self.replica_rank

    def _host_of(self, rank: int, kind: str = "shard") -> str:
        index, shard = self._whose(rank, kind)
        if self.replica_size > 1 and index < len(self._rank_hosts) and shard < len(self._rank_hosts[index]):
            return self._rank_hosts[index][shard]
        return self.hosts[index]

    def _who(self, rank: int, kind: str = "shard") -> str:
        index, shard = self._whose(rank, kind)
        if not 0 <= index < len(self.members):
            return f"rank {rank}"
        if self.replica_size == 1:
            return f"replica {self.members[index]!r} (rank {rank}, host {self.hosts[index]})"
        where = {
            "whole": "the quorum's group of every rank",
            "inside": "the replica's own group",
        }.get(kind, f"the group of replica rank {shard}")
        return (
            f"replica {self.members[index]!r} rank {shard} of {self.replica_size} (rank {rank} of {where}, "
            f"host {self._host_of(rank, kind)})"
        )

    def _ranks_of(self, exc: BaseException, kind: str = "shard") -> list[int]:
        """The ranks of the current quorum's group that ``exc`` names (lost, or did not answer)."""
        if isinstance(exc, PeerLostError):
            ranks = [exc.rank]
        elif isinstance(exc, CollectiveTimeout):
            ranks = list(exc.missing_ranks)
        else:
            ranks = list(getattr(exc, "ranks", []) or [])
        size = {"whole": len(self.members) * self.replica_size, "inside": self.replica_size}.get(
            kind, len(self.members)
        )
        return [r for r in ranks if 0 <= r < size]

    def _named(self, exc: BaseException, kind: str = "shard") -> str:
        """The replicas ``exc`` involves, each with its rank and host.

        When it names none (a group that did not form), the other members of the quorum.
        """
        ranks = self._ranks_of(exc, kind)
        if ranks:
            return ", ".join(self._who(r, kind) for r in ranks)
        others = [self._who(r) for r in range(len(self.members)) if r != self.index]
        return f"one of {', '.join(others)}" if others else "no other replica"

    # -- the coordinator session -------------------------------------------------------------
    async def _connected(self, deadline: Deadline) -> CoordinatorSession:
        if self._closed:
            raise DistError("the Manager is closed")  # (its caller says where)
        if self._session is None:
            self._session = await CoordinatorSession.connect(
                self._host,
                self._port,
                token=self._token,
                job=self.job,
                role=ROLE_STORE,
                timeout=self.quorum_timeout,
            )
            self._beat = asyncio.ensure_future(self._beat_forever(self._session))
        return self._session

    async def _beat_forever(self, session: CoordinatorSession) -> None:
        """Heartbeats on the quorum connection.

        A replica whose host is cut off falls silent and stops holding up the others' quorum
        (the coordinator's heartbeat timeout). Any request says the replica is there as well as a
        beat does, so a beat goes only after a second without one: a replica that asks for a
        quorum more often than once a second (at every step) sends no beats, and the coordinator
        of a thousand replicas reads a thousand messages a second fewer.
        """
        loop = asyncio.get_running_loop()
        while not session.closed:
            quiet = loop.time() - session._last_request
            if quiet >= _BEAT_EVERY:
                with contextlib.suppress(Exception):
                    await session._call("hb", {}, deadline=Deadline(5.0))
                quiet = 0.0
            await asyncio.sleep(_BEAT_EVERY - quiet)

    # -- a step ------------------------------------------------------------------------------
    async def start_step(self) -> int:
        """Begin a step: the quorum, its group, and the state for a replica that is behind.

        Asks the coordinator for this step's quorum and waits until it forms; makes the quorum's
        process group when the membership changed (destroying the old one); then receives the
        state from a live replica when this one is behind (a new or restarted replica), or sends
        it to the replicas the coordinator assigned to this one. A failure while the group forms
        or during a heal (a replica lost meanwhile) makes it ask again, for a quorum without it.

        Returns:
            ``step``: the number of the step about to run (the steps committed so far).

        Raises:
            QuorumError: no quorum within ``quorum_timeout`` (too few replicas, the coordinator
                not reachable), or this rank's replica lost another of its ranks (at once, or
                when no new process of it asked within ``replace_timeout``).
            RuntimeError: a heal is needed but ``state_dict``/``load_state_dict`` are not set.
        """
        deadline = Deadline(self.quorum_timeout)
        self._failed = None
        self._in_step = True
        try:
            return await self._join_quorum(deadline)
        except BaseException:
            self._in_step = False  # no step began
            raise

    async def _join_quorum(self, deadline: Deadline) -> int:
        while True:
            reply = await self._ask(deadline)
            try:
                await self._adopt(reply, deadline)
                return self.step
            except (DistError, OSError, asyncio.TimeoutError) as exc:
                if isinstance(exc, QuorumError):
                    raise  # no replica to heal a torn state from: asking again cannot help
                # A replica lost while the group formed or during a heal: ask again, for a
                # fresh group (the lost one will be left out).
                self._renew = True
                log.warning(
                    "%s: step %d: joining quorum %d failed (%s): %s: %s; asking for a new quorum",
                    self._where(),
                    self.step,
                    reply["quorum_id"],
                    self._named(exc),
                    type(exc).__name__,
                    exc,
                )
                remaining = deadline.remaining()
                if remaining is not None and remaining <= 0:
                    raise QuorumError(
                        f"{self._where()}: could not join a quorum within {self.quorum_timeout:g}s; the last "
                        f"one failed ({self._named(exc)}): {exc}",
                        replica=self.replica,
                        step=self.step,
                    ) from exc

    async def _ask(self, deadline: Deadline) -> dict[str, Any]:
        self._asks += 1
        fields = {
            "replica": self.replica,
            "uid": self._uid,
            "step": self.step,
            "ask": self._asks,
            "host": self.host,
            "min_replicas": self.min_replicas,
            "join_timeout": self.join_timeout,
            "renew": self._renew,
        }
        if self._torn:
            fields["torn"] = True
        if self._restored:
            fields["restore"] = True
        if self.group is not None:
            fields["known"] = self.quorum_id  # the same quorum again: the reply leaves out its members
        if self.replica_size > 1:
            fields["replica_rank"] = self.replica_rank
            fields["replica_size"] = self.replica_size
            fields["replace_timeout"] = self.replace_timeout
            fields["generation"] = self.replica_generation
            if self._inside_failed:
                fields["inside"] = True
        try:
            session = await self._connected(deadline)
            reply, _ = await session._call("quorum", fields, deadline=deadline, waits=True)
        except StoreTimeout as exc:
            raise QuorumError(
                f"{self._where()}: no quorum of at least {self.min_replicas} replicas of job {self.job!r} "
                f"within {self.quorum_timeout:g}s: {exc}",
                replica=self.replica,
                step=self.step,
            ) from exc
        except DistError as exc:
            # RendezvousError: a replica of several ranks lost one, and the coordinator says which
            at = f"the coordinator at {self.coordinator}"
            refused = isinstance(exc, RendezvousError)
            what = f"{at} refused this rank" if refused else f"asking {at} for a quorum failed"
            raise QuorumError(
                f"{self._where()}: {what}: {exc}",
                replica=self.replica,
                step=self.step,
            ) from exc
        self._renew = False
        self._inside_failed = False
        self._restored = False  # in a quorum: the job goes on from there
        return reply

    async def _adopt(self, reply: dict[str, Any], deadline: Deadline) -> None:
        qid, index = int(reply["quorum_id"]), int(reply["index"])
        self.replica_generation = int(reply.get("generation", self.replica_generation))
        if "members" not in reply:
            # The quorum whose group this replica holds, formed again with the same members (whose
            # ranks agreed on their step then, and did nothing but commit together since).
            self._whole = True
            await self._heal(reply)
            return
        members = reply["members"]
        self._whole = members[index][1] >= 0
        for name, host, why in reply.get("left", []):
            rank = self.members.index(name) if name in self.members else -1
            log.warning(
                "%s: quorum %d leaves out replica %r (rank %d of quorum %d, host %s): %s",
                self._where(),
                qid,
                name,
                rank,
                self.quorum_id,
                host,
                why,
            )
        self._rank_hosts = [list(h) for h in reply.get("hosts", [[m[2]] for m in members])]
        if qid != self.quorum_id or self.group is None:
            survivors = self._survivors(members, reply.get("uids"))
            if survivors is None:
                await self._destroy_groups()
            else:
                await self._destroy_step_group()
            self.quorum_id, self.index = qid, index
            self.members = [m[0] for m in members]
            self.hosts = [m[2] for m in members]
            remaining = deadline.remaining()
            forming = self.join_timeout if remaining is None else max(min(self.join_timeout, remaining), 0.1)
            size = self.replica_size
            if survivors is not None:
                await self._regroup(survivors, forming)
                return await self._heal(reply)

            async def make(rank: int, world: int, job: str) -> ProcessGroup:
                runtime = await join_coordinator(
                    self._host,
                    self._port,
                    rank,
                    world,
                    Deadline(forming),
                    self.timeout,
                    self._token,
                    job,
                )  # (no embed: the coordinator runs, never start one in its place)
                return ProcessGroup(runtime, runtime.world, owner=True)

            if size == 1:
                self.group = self.quorum_group = await make(index, len(members), f"{self.job}/q{qid}")
                self._linked = self.group
                uids = reply.get("uids") or []
                self._linked_ranks = {
                    (m[0], u): i for i, (m, u) in enumerate(zip(members, uids, strict=False))
                }
            else:
                made = await asyncio.gather(
                    make(index, len(members), f"{self.job}/q{qid}/s{self.replica_rank}"),
                    make(index * size + self.replica_rank, len(members) * size, f"{self.job}/q{qid}"),
                    return_exceptions=True,
                )
                failed = [g for g in made if isinstance(g, BaseException)]
                if failed:
                    for g in made:
                        if isinstance(g, ProcessGroup):
                            with contextlib.suppress(Exception):
                                await asyncio.wait_for(g.destroy(), _DESTROY_TIMEOUT)
                    raise failed[0]
                shard, whole = made
                assert isinstance(shard, ProcessGroup) and isinstance(whole, ProcessGroup)
                self.group, self.quorum_group = shard, whole
            log.info(
                "%s: step %d: quorum %d of %d replicas %s",
                self._where(),
                self.step,
                qid,
                len(members),
                self.members,
            )
        self.members = [m[0] for m in members]
        self.hosts = [m[2] for m in members]
        await self._heal(reply)

    def _survivors(self, members: list[Any], uids: list[str] | None) -> list[int] | None:
        """The quorum's members' ranks in the linked group, when they are some of its members.

        Some: the same processes (no new one), one or more gone; else None.

        Every member of such a quorum holds that group (each joined it with the others), so
        each finds the same answer and they form their group over its links (``_regroup``).
        """
        if self.replica_size != 1 or self._linked is None or not uids or len(uids) != len(members):
            return None
        ranks = [self._linked_ranks.get((m[0], u), -1) for m, u in zip(members, uids, strict=True)]
        if -1 in ranks or len(ranks) >= self._linked.size or ranks != sorted(ranks):
            return None  # (in the same order, so that each one's rank in the group is its index)
        return ranks

    async def _regroup(self, ranks: list[int], forming: float) -> None:
        """Form the quorum's group of survivors over the links of the group they all hold.

        No new links, session or shared-memory regions to connect, no rendezvous at the
        coordinator: the members agree over the new group itself. When that fails (a member
        lost meanwhile, or one that formed another group), this replica makes its next group
        through the coordinator, as the others whose agreement failed do.
        """
        linked = self._linked
        assert linked is not None
        try:
            self.group = self.quorum_group = await linked._survivors_group(
                ranks, f"q{self.quorum_id}", forming
            )
        except BaseException:
            await self._destroy_groups()  # the linked group too: the next is made anew
            raise
        log.info(
            "%s: step %d: quorum %d of %d replicas %s (over the links of the last group)",
            self._where(),
            self.step,
            self.quorum_id,
            len(self.members),
            self.members,
        )

    async def _heal(self, reply: dict[str, Any]) -> None:
        heal: dict[int, int] = reply["heal"]  # {member index: its source}, for those that heal
        pg = self.group
        assert pg is not None
        source = heal.get(self.index, -1)
        if source < 0 and (self._torn or not self._whole):
            why = (
                "this replica's state was partly overwritten by a heal whose source was lost"
                if self._torn
                else "this replica's ranks hold the states of different steps (a rank was replaced, "
                "or a heal failed on some of them)"
            )
            raise QuorumError(
                f"{self._where()}: {why}, and no replica of quorum {self.quorum_id} holds a whole state "
                f"to heal from: start it again from a checkpoint, or start a replica that has one",
                replica=self.replica,
                step=self.step,
            )
        healers = [i for i, s in heal.items() if s == self.index]
        if (healers or source >= 0) and (self.state_dict is None or self.load_state_dict is None):
            raise RuntimeError(
                f"{self._where()}: quorum {self.quorum_id} needs a state transfer, but the Manager has no "
                f"state_dict/load_state_dict: give them to Manager(...) (aiocoll.ft_torch's wrapper does)"
            )
        single = _single_source(heal, len(self.members))
        if single is not None:
            # Every other member heals from one: a broadcast spreads the sending over them.
            started = time.perf_counter()
            assert self.state_dict is not None
            own = self.state_dict()
            packed = pack_state(own) if single == self.index else None
            state, nbytes = await broadcast_state(
                pg, packed, single, self.timeout, into=own, on_overwrite=self._overwriting
            )
            if single != self.index:
                self._healed(reply, state, nbytes, single, started)
                return
        elif healers:
            assert self.state_dict is not None
            packed = pack_state(self.state_dict())
            started = time.perf_counter()
            await _all([send_state(pg, packed, dst, self.timeout) for dst in healers])
        if healers:
            log.info(
                "%s: sent the state of step %d to %s in %.3fs",
                self._where(),
                self.step,
                [self.members[i] for i in healers],
                time.perf_counter() - started,
            )
        if source >= 0 and single is None:
            started = time.perf_counter()
            assert self.state_dict is not None
            state, nbytes = await recv_state(
                pg, source, self.timeout, into=self.state_dict(), on_overwrite=self._overwriting
            )
            self._healed(reply, state, nbytes, source, started)

    def _overwriting(self) -> None:
        """A heal starts receiving into this replica's own arrays: until it is loaded, the state is torn.

        A torn replica (its heal failed: the source was lost) tells the coordinator, which never
        takes it as a source and has it heal from any replica with a whole state.
        """
        self._torn = True

    def _healed(self, reply: dict[str, Any], state: Any, nbytes: int, source: int, started: float) -> None:
        """Load the state received from member ``source``: this replica is at the quorum's step."""
        assert self.load_state_dict is not None
        self.load_state_dict(state)
        self._torn = False
        seconds = time.perf_counter() - started
        previous, self.step = self.step, int(reply["max_step"])
        self.last_heal = {"source": self.members[source], "bytes": nbytes, "seconds": seconds}
        log.info(
            "%s: healed from %s: step %d -> %d, %d bytes in %.3fs",
            self._where(),
            self._who(source),
            previous,
            self.step,
            nbytes,
            seconds,
        )

    async def _destroy_step_group(self) -> None:
        """Destroy the last quorum's group when it is a sub-group of the linked group (which stays)."""
        old = self.group
        self.group = self.quorum_group = None
        if old is not None and old is not self._linked:
            await _destroy_quietly([old])

    async def _destroy_groups(self) -> None:
        """Destroy the quorum's groups (each within a bound; errors ignored: it is going)."""
        groups = {id(g): g for g in (self.group, self.quorum_group, self._linked) if g is not None}
        self.group = self.quorum_group = self._linked = None
        self._linked_ranks = {}
        await _destroy_quietly(groups.values())

    def _fail(self, what: str, exc: BaseException, kind: str = "shard") -> None:
        """Record the step's failure, naming the replicas, ranks and hosts it involves.

        ``kind``: the group it failed on, whose ranks it names (see ``_whose``).
        """
        if self.replica_size == 1:
            kind = "shard"  # one group: ``group`` is ``quorum_group``, and there is no inside
        ranks = self._ranks_of(exc, kind)
        named = self._named(exc, kind)
        failure = StepFailed(
            f"{self._where()}: step {self.step}: {what} failed ({named}): {type(exc).__name__}: "
            f"{str(exc).rstrip('.')}. "
            f"The step is not committed; the next quorum leaves out the replicas that are gone and "
            f"heals the ones that fell behind",
            step=self.step,
            quorum_id=self.quorum_id,
            replicas=[self.members[self._whose(r, kind)[0]] for r in ranks],
            ranks=ranks,
            hosts=[self._host_of(r, kind) for r in ranks],
            cause=exc,
        )
        if self._failed is None:
            self._failed = failure
            self.last_error = failure
            log.warning("%s", failure)

    def report_error(self, exc: BaseException, *, inside_replica: bool = False) -> None:
        """Mark the current step failed: it will not commit, and the next quorum makes a fresh group.

        Call it when an operation of your own on ``group`` failed, or (``inside_replica``) on the
        group of this replica's own ranks.

        Args:
            exc: the error; its ranks (``PeerLostError.rank``, ``CollectiveTimeout.missing_ranks``)
                are named in ``last_error`` with their replicas and hosts.
            inside_replica: the operation ran on a group of this replica's ranks, in
                ``replica_rank`` order (a replica of several ranks): its ranks are replica ranks.
        """
        if inside_replica:
            self._inside_failed = True  # the next quorum gives the replica a new generation
        self._fail("an operation of the step", exc, "inside" if inside_replica else "shard")

    async def all_reduce_mean(self, arrays: Sequence[Any], *, timeout: float | None = None) -> bool:
        """Average arrays over the quorum's replicas, in place.

        The sum over the replicas that are in this step's quorum, divided by their number. A
        failure does not raise: it is logged and kept in ``last_error``, and ``commit`` returns
        False. For a replica of several ranks this runs over ``group``, this rank's shard; when
        the step has already failed on this rank (``report_error``) it still runs, so that the
        other replicas' ranks of the shard are not held up until its timeout, and returns False.

        Args:
            arrays: numpy arrays or torch tensors (floating point; CUDA tensors too), the same
                shapes and dtypes on every replica.
            timeout: seconds the all_reduce may take (default: the Manager's ``timeout``).

        Returns:
            True; False when the step has failed (then the arrays' contents are not to be used).

        Raises:
            RuntimeError: called outside a step (before ``start_step``).
        """
        if self._failed is not None and self.replica_size == 1:
            return False
        pg = self._group("all_reduce_mean")
        failed = self._failed is not None
        n = pg.size
        try:
            await _all([pg.all_reduce(a, ReduceOp.SUM, timeout=timeout or self.timeout) for a in arrays])
        except DistError as exc:
            self._fail("all_reduce_mean", exc)
            return False
        if failed:
            return False
        for a in arrays:
            a /= n
        return True

    async def commit(self, *, timeout: float | None = None) -> bool:
        """End the step: whether every replica of the quorum completed it.

        A MIN all_reduce of the flags of every rank of the quorum (``quorum_group``), so the
        ranks of a replica of several ranks commit together. When True, apply the step (``step`` has moved
        on); when False, do not: the next ``start_step`` asks for a new quorum, which leaves out
        the replicas that are gone and heals the ones that fell behind.

        Args:
            timeout: seconds the all_reduce may take (default: the Manager's ``timeout``).

        Returns:
            Whether the step is committed.

        Raises:
            RuntimeError: called outside a step (before ``start_step``).
        """
        self._group("commit")
        pg = self.quorum_group
        assert pg is not None
        flag = np.array([0 if self._failed is not None else 1], np.int32)
        try:
            await pg.all_reduce(flag, ReduceOp.MIN, timeout=timeout or self.timeout)
        except DistError as exc:
            self._fail("commit", exc, "whole")
            flag[0] = 0
        self._in_step = False
        if self._failed is not None:
            self._renew = True
            return False
        if not flag[0]:
            log.warning("%s: step %d not committed: another replica's step failed", self._where(), self.step)
            return False
        self.step += 1
        self.last_error = None
        return True

    def _group(self, what: str) -> ProcessGroup:
        if self.group is None or not self._in_step:
            raise RuntimeError(f"{what}: call start_step() first ({self._where()})")
        return self.group

    def restore(self, step: int) -> None:
        """Resume this replica from a checkpoint of ``step``, once that checkpoint is loaded.

        ``step`` is the number of steps committed when the checkpoint was saved. Sets ``step``,
        and lets this replica's next quorum take the job back to it when no replica that holds a
        later step of the job is left (the whole job restarted from a checkpoint under the same
        job name, with a coordinator that remembers the later steps). Without it such a replica
        is refused, so that a replica restarted by mistake from its initial state never trains
        the job's steps again. A replica of the job that holds a later step and is still there
        wins: the quorum goes on from the highest step, and the restored replica heals from it.
        Call it before ``start_step``.

        Args:
            step: the checkpoint's step, at least 0.

        Raises:
            ValueError: ``step`` is not an int at least 0. RuntimeError: called during a step.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Manager.restore: step must be an int >= 0, got {step!r}")
        if self._in_step:
            raise RuntimeError(
                f"Manager.restore: called during step {self.step} ({self._where()}); call it before "
                f"start_step"
            )
        self.step = step
        self._restored = True

    # -- closing -----------------------------------------------------------------------------
    async def close(self) -> None:
        """Leave: destroy the quorum's group and close the coordinator session. Twice is fine.

        The other replicas' next quorum leaves this one out at once (its connection closed).
        """
        if self._closed:
            return
        self._closed = True
        if self._beat is not None:
            self._beat.cancel()
        await self._destroy_groups()
        session, self._session = self._session, None
        if session is not None:
            with contextlib.suppress(Exception):
                await session.aclose()

    async def __aenter__(self) -> Manager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
