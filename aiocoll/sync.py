"""aiocoll.sync: a blocking drop-in for ``torch.distributed`` in scripts.

``import aiocoll.sync as dist`` and a script written for torch.distributed runs unchanged: the
same function names, signatures and in-place semantics, ``group=None`` and ``async_op=False``,
``GroupMember.WORLD``, P2POp/batch_isend_irecv, the object-list functions and torch's store
classes. Tensors may be torch tensors or numpy arrays. Backend names "gloo", "nccl", "mpi" and
None are accepted and all mean aiocoll.

This module is public surface: it imports the async API (aiocoll.api), the stores and the
loop-thread bridge, never torch at import time. It holds no collective logic: every function
converts torch's arguments (global ranks to group ranks, timedelta to seconds, torch's ReduceOp
to aiocoll's) and forwards to ``aiocoll.ProcessGroup`` on one background loop thread.
Functions that torch itself composes from others (batch_isend_irecv,
monitored_barrier) are composed here the same way.

Ranks: ``src``/``dst``/``peer`` arguments are global ranks, as in torch; ``group_src``,
``group_dst`` and ``group_peer`` are ranks within ``group``.

"""

# ASYNC_COUNTERPART maps each operation of aiocoll.ProcessGroup to the function here that forwards
# to it; FACADE_ONLY lists the functions with no single async counterpart. A unit test checks both
# against the async API. Neither is in __all__: they describe this module, they are not its API.

from __future__ import annotations

import datetime
import os
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ._deadline import to_seconds
from ._env import env_text
from ._errors import DistError
from ._monitored_barrier import monitored_barrier as run_monitored_barrier
from ._sync_loop import get_loop_thread, issue_on_caller_streams
from ._sync_stores import FileStore, HashStore, PrefixStore, Store, TCPStore, as_async_store
from ._sync_work import Work
from ._types import ReduceOp

__all__ = [
    "Backend",
    "DistError",
    "FileStore",
    "GroupMember",
    "HashStore",
    "P2POp",
    "PrefixStore",
    "ProcessGroup",
    "ReduceOp",
    "Store",
    "TCPStore",
    "Work",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "destroy_process_group",
    "gather",
    "gather_object",
    "get_backend",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "monitored_barrier",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
]

ASYNC_COUNTERPART: dict[str, str] = {
    # aiocoll.ProcessGroup method -> aiocoll.sync function
    "send": "send",
    "recv": "recv",
    "isend": "isend",
    "irecv": "irecv",
    "broadcast": "broadcast",
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "all_gather_into_tensor",
    "gather": "gather",
    "scatter": "scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all_single",
    "barrier": "barrier",
    "broadcast_object": "broadcast_object_list",
    "all_gather_object": "all_gather_object",
    "gather_object": "gather_object",
    "scatter_object": "scatter_object_list",
    "new_group": "new_group",
    "destroy": "destroy_process_group",
}
"""Which facade function forwards to each operation of the async ``aiocoll.ProcessGroup``."""

FACADE_ONLY: dict[str, str] = {
    "init_process_group": "aiocoll.init_process_group (module-level, not a group method)",
    "is_initialized": "state of this module",
    "is_available": "always True",
    "get_rank": "ProcessGroup.rank",
    "get_world_size": "ProcessGroup.size",
    "get_backend": "the backend name init_process_group or new_group was given",
    "batch_isend_irecv": "isend/irecv in list order",
    "monitored_barrier": "send/recv with rank 0, as torch composes it",
}
"""Facade functions with no single async counterpart, and what they use instead."""

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_BACKENDS = ("aiocoll", "gloo", "nccl", "mpi", "ucc", "cpu:gloo,cuda:nccl")


def is_available() -> bool:
    """True: aiocoll is always available (torch.distributed.is_available)."""
    return True


class Backend(str):
    """The backend name get_backend returns: torch's spellings (torch's Backend).

    ``Backend.AIOCOLL`` is the backend that runs every group, whatever it was called.
    """

    AIOCOLL = "aiocoll"
    GLOO = "gloo"
    NCCL = "nccl"
    MPI = "mpi"
    UNDEFINED = "undefined"


class ProcessGroup:
    """A group handle for the ``group=`` argument: the blocking view of an aiocoll.ProcessGroup.

    Attributes:
        ranks: the global ranks of the members, in group-rank order.
        core: the async aiocoll.ProcessGroup (use it only on the aiocoll loop thread).
    """

    def __init__(self, core: Any, timeout: float | None, name: str, backend: str = "aiocoll") -> None:
        self.core = core
        self.backend = backend
        self.ranks: list[int] = list(core.ranks)
        self.timeout = timeout
        self._name = name
        self._global_to_group = {g: i for i, g in enumerate(self.ranks)}

    def rank(self) -> int:
        """This process's rank in the group."""
        return int(self.core.rank)

    def size(self) -> int:
        """The number of members."""
        return int(self.core.size)

    def name(self) -> str:
        """The name of the backend that runs the group: "aiocoll", whatever get_backend says."""
        return Backend.AIOCOLL

    @property
    def group_name(self) -> str:
        """The group's name in messages (``group_desc`` when it was given one)."""
        return self._name

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """The group rank of ``global_rank``.

        Raises:
            ValueError: when that rank is not a member.
        """
        try:
            return self._global_to_group[global_rank]
        except (KeyError, TypeError):
            raise ValueError(
                f"{what} {global_rank!r} is not a member of group {self._name!r} (global ranks "
                f"{self.ranks}); pass a global rank of the group, or group_{what}= for a group rank"
            ) from None

    def global_rank(self, group_rank: int) -> int:
        """The global rank of the member at ``group_rank``."""
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"<aiocoll.sync.ProcessGroup {self._name!r} ranks={self.ranks} rank={self.rank()}>"


class _World:
    """The default group and the groups made from it (this module's only state)."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.subgroups: list[ProcessGroup] = []
        self.counter = 0
        # The store torch's default group was made with, when this module made that group over
        # this one (it then destroys it too); None otherwise.
        self.torch_store: Any = None


_state_lock = threading.Lock()
_world: _World | None = None


class _GroupMeta(type):
    @property
    def WORLD(cls) -> ProcessGroup | None:
        return _world.group if _world is not None else None


class GroupMember(metaclass=_GroupMeta):
    """Torch's GroupMember.

    ``GroupMember.WORLD`` is the default group (None before init), and
    ``GroupMember.NON_GROUP_MEMBER`` is what new_group gives processes outside the new group.
    """

    NON_GROUP_MEMBER = -100


class group(metaclass=_GroupMeta):
    """``group.WORLD`` is the default group, as in torch."""


def _require_world() -> _World:
    world = _world
    if world is None:
        raise ValueError(
            "Default process group has not been initialized, please make sure to call "
            "aiocoll.sync.init_process_group()."
        )
    return world


def _group(group: Any) -> ProcessGroup | None:
    """The handle for ``group=``; None when this process is not a member."""
    if group is None:
        return _require_world().group
    if isinstance(group, ProcessGroup):
        return group
    if group == GroupMember.NON_GROUP_MEMBER:
        return None
    raise TypeError(
        f"group must be a group from aiocoll.sync.new_group (or None), not {type(group).__name__}"
    )


def _member(group: Any, op: str) -> ProcessGroup | None:
    """The handle for ``group=`` of operation ``op``; None, with torch's warning, for a non-member."""
    pg = _group(group)
    if pg is None:
        # stacklevel 3: the warning names the line of the script that called the facade function.
        warnings.warn(
            f"Running {op} on a rank that is not a member of the given group; nothing to do.",
            stacklevel=3,
        )
    return pg


def _rank_in(
    pg: ProcessGroup, global_rank: int | None, group_rank: int | None, what: str, default: int | None = None
) -> int:
    """Torch's rule: either a global rank or a group rank, never both; group ranks go to the core."""
    if group_rank is not None:
        if global_rank is not None:
            raise ValueError(f"pass either {what} or group_{what}, not both")
        if not 0 <= group_rank < pg.size():
            raise ValueError(f"group_{what}={group_rank} is out of range for a group of size {pg.size()}")
        return group_rank
    if global_rank is None:
        if default is None:
            raise ValueError(f"{what} (a global rank) or group_{what} (a group rank) must be given")
        global_rank = default
    return pg.group_rank(global_rank, what)


def _op(op: Any) -> ReduceOp:
    if type(op) is ReduceOp:  # (the default: no attribute looked for, which an Enum makes slow)
        return op
    return ReduceOp.coerce(op)  # (torch's ops are found in its cache of those met)


def _launch(
    name: str,
    start: Callable[[], Any],
    async_op: bool,
    tensors: list[Any],
    source_rank: Callable[[Any], int] | None = None,
) -> Any:
    """Issue one core operation; block for it, or return a Work when ``async_op``.

    CUDA tensors are staged after the caller's current streams and land before the operation
    completes.
    """
    outcome, _streams = issue_on_caller_streams(start, tensors, wait_on_host=True)
    if async_op:
        outcome.wait_launched()
        return Work(outcome, name, tensors, source_rank)
    result = outcome.result()
    return source_rank(result) if source_rank is not None else None


# ---------------------------------------------------------------------------------- lifecycle


def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: datetime.timedelta | float | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
    *,
    token: str | None = None,
    job: str | None = None,
) -> None:
    """Join the default group (torch.distributed.init_process_group).

    Args:
        backend: "gloo", "nccl", "mpi", "aiocoll" or None: all mean aiocoll.
        init_method: "env://" (default when no store is given), "tcp://HOST:PORT" or "file:///PATH".
        timeout: rendezvous deadline and default for every operation (default 30 minutes).
        world_size: -1 reads it from the environment (WORLD_SIZE).
        rank: -1 reads it from the environment (RANK).
        store: rendezvous through this store instead (an aiocoll.sync store, an aiocoll.Store or a
            torch.distributed.Store); needs rank and world_size.
        group_name: accepted for compatibility.
        pg_options: accepted for compatibility.
        device_id: accepted for compatibility.
        token: aiocoll's shared secret (default: env AIOCOLL_TOKEN).
        job: the job id, the coordinator's key space (default: env AIOCOLL_JOB).

    Raises:
        ValueError: unknown backend, bad ranks, or the default group already exists.
        RendezvousError: the rendezvous failed (also StoreTimeout, AuthenticationError).

    Example:
        ```python
        import aiocoll.sync as dist
        dist.init_process_group("gloo")   # under `aiocoll run` or torchrun
        ```
    """
    global _world
    if backend is not None and str(backend).lower() not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; aiocoll.sync accepts {list(_BACKENDS)} or None")
    if store is not None and init_method is not None:
        raise ValueError("init_method and store are mutually exclusive, pass only one")
    seconds = to_seconds(timeout if timeout is not None else DEFAULT_TIMEOUT)
    torch_store = None
    if store is None and init_method in (None, "env://") and _under_torchrun():
        # torchrun serves a TCPStore on MASTER_PORT (no aiocoll coordinator there): rendezvous
        # through it, as torch's own env:// does.
        torch_store, rank, world_size = _torchrun_rendezvous(rank, world_size, seconds)
        store = torch_store
    async_store = as_async_store(store) if store is not None else None
    with _state_lock:
        if _world is not None:
            raise ValueError("trying to initialize the default process group twice!")
        import aiocoll.api as api

        core = get_loop_thread().run(
            api.init_process_group(
                init_method,
                rank=None if rank is None or rank < 0 else rank,
                world_size=None if world_size is None or world_size < 0 else world_size,
                timeout=seconds if seconds is not None else 1800.0,
                token=token,
                job=job,
                store=async_store,
            )
        )
        world = _World(ProcessGroup(core, seconds, group_name or "default_pg", _backend_name(backend)))
        try:
            world.torch_store = _make_torch_default_group(core, torch_store, seconds)
        except BaseException:
            get_loop_thread().run(core.destroy())
            raise
        _world = world


def _backend_name(backend: str | None) -> str:
    """What get_backend answers for a group made with ``backend``.

    The name the script asked for, so that a script that branches on "gloo" or "nccl" takes the
    branch it took under torch; "aiocoll" when it named none.
    """
    return Backend(str(backend).lower() if backend is not None else Backend.AIOCOLL)


def _under_torchrun() -> bool:
    """Started by torchrun (torch.distributed.run), not by ``aiocoll run``.

    ``aiocoll run`` names its coordinator in AIOCOLL_COORDINATOR.
    """
    return "TORCHELASTIC_RUN_ID" in os.environ and not env_text("AIOCOLL_COORDINATOR")


def _torchrun_rendezvous(rank: int, world_size: int, seconds: float | None) -> tuple[Any, int, int]:
    """Torch's env:// rendezvous.

    Returns the store torchrun serves (prefixed per restart, as torch does), this process's rank
    and the world size.

    Raises:
        RuntimeError: torch is not importable (torchrun comes with torch, so this is a broken
            installation), naming what to do.
    """
    try:
        import torch.distributed as td
    except ImportError as exc:
        raise RuntimeError(
            "aiocoll.sync.init_process_group: this process was started by torchrun, whose rendezvous "
            f"store is torch's, but torch cannot be imported here: {_why_not_importable('torch', exc)}"
        ) from exc
    wait = datetime.timedelta(seconds=seconds if seconds else 1800.0)
    torch_store, rank, world_size = next(
        td.rendezvous("env://", rank=rank, world_size=world_size, timeout=wait)
    )
    return torch_store, int(rank), int(world_size)


def _why_not_importable(module: str, exc: ImportError) -> str:
    """Why ``import module`` failed, in words: not installed, or installed but broken.

    A module of the script's own folder that shadows one that torch imports (a ``cuda.py``,
    say) breaks an installed torch; saying "install torch" then sends the user the wrong way.
    """
    if isinstance(exc, ModuleNotFoundError) and exc.name == module:
        return f"{module} is not installed; install it, or start the script with `aiocoll run`"
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    where = f" (installed at {spec.origin})" if spec is not None and spec.origin else ""
    return (
        f"{module}{where} is installed but importing it failed with {type(exc).__name__}: {exc} "
        "(a file of the script's folder named like a module it imports shadows that module?)"
    )


def _make_torch_default_group(core: Any, torch_store: Any, seconds: float | None) -> Any:
    """When the script uses torch, make torch's default process group too.

    It runs on the "aiocoll" backend and over the same aiocoll group, so that DDP, FSDP2,
    DeviceMesh and ``torch.distributed.*`` calls work beside this module's. Returns the torch
    store it was given (the caller keeps it: torch holds only the C++ side of a store written in
    Python), or None.

    Only when torch is already imported (a script that uses DDP has imported torch; one that does
    not should not pay for importing it) and has no default group yet.
    """
    if "torch" not in sys.modules:
        return None
    import torch.distributed as td

    if not td.is_available() or td.is_initialized():
        return None
    import aiocoll.torch as backend

    if torch_store is None:
        from ._torch_store import TorchStoreOverAiocoll

        rendezvous_store = core.store if core.store is not None else core._rt.session
        torch_store = TorchStoreOverAiocoll(rendezvous_store, seconds)
    with backend.adopting(core):
        td.init_process_group(
            backend=backend.BACKEND_NAME,
            store=torch_store,
            rank=core.rank,
            world_size=core.size,
            timeout=datetime.timedelta(seconds=seconds if seconds else 1800.0),
        )
    return torch_store


def is_initialized() -> bool:
    """True once init_process_group succeeded (and until destroy_process_group)."""
    return _world is not None


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 when not a member."""
    pg = _group(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group: Any = None) -> int:
    """The size of ``group`` (default: the world); -1 when not a member."""
    pg = _group(group)
    return -1 if pg is None else pg.size()


def get_backend(group: Any = None) -> str:
    """The backend name ``group`` was made with, as torch answers it.

    ``init_process_group("gloo")`` gives "gloo" here, as it does under torch.distributed, although
    aiocoll runs the group; ``group.name()`` and ``Backend.AIOCOLL`` name what runs it, "aiocoll".
    A group from new_group without a backend has the default group's.

    Raises:
        ValueError: before init_process_group, or for a group this process is not in.
    """
    pg = _group(group)
    if pg is None:
        raise ValueError("Invalid process group specified: this process is not a member")
    return Backend(pg.backend)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: datetime.timedelta | float | None = None,
    backend: str | None = None,
    pg_options: Any = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> ProcessGroup | int:
    """Make a group of the given global ranks; every rank of the world must call it.

    Args:
        ranks: global ranks of the members (None: all).
        timeout: accepted; the world's applies.
        backend: what get_backend answers for the group (default: the default group's); aiocoll
            runs it whatever its name.
        pg_options: accepted for compatibility.
        use_local_synchronization: accepted for compatibility.
        group_desc: a name for messages.
        device_id: accepted for compatibility.
        sort_ranks: order members by global rank.

    Returns:
        The group handle for ``group=``; ``GroupMember.NON_GROUP_MEMBER`` on non-members.

    Raises:
        ValueError: for ranks outside the world or repeated.
    """
    world = _require_world()
    members = list(range(world.group.size())) if ranks is None else [int(r) for r in ranks]
    if sort_ranks:
        members = sorted(members)
    with _state_lock:
        world.counter += 1
        name = group_desc or f"group_{world.counter}"
    core = get_loop_thread().run(world.group.core.new_group(members))
    if core is None:
        return GroupMember.NON_GROUP_MEMBER
    handle = ProcessGroup(
        core, world.group.timeout, name, world.group.backend if backend is None else _backend_name(backend)
    )
    world.subgroups.append(handle)
    return handle


def destroy_process_group(group: Any = None) -> None:
    """Leave ``group``; with None, leave every group and the default group.

    Raises:
        ValueError: when nothing was initialized.
    """
    global _world
    world = _require_world()
    loop_thread = get_loop_thread()
    if group is None:
        with _state_lock:
            _world = None
        if world.torch_store is not None:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()
        for sub in reversed(world.subgroups):
            loop_thread.run(sub.core.destroy())
        loop_thread.run(world.group.core.destroy())
        return
    pg = _group(group)
    if pg is None:
        return
    if pg in world.subgroups:
        world.subgroups.remove(pg)
    loop_thread.run(pg.core.destroy())


# -------------------------------------------------------------------------- point to point


def isend(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> Work | None:
    """Send ``tensor`` to ``dst`` without blocking; returns a Work (None for non-members)."""
    pg = _member(group, "isend")
    if pg is None:
        return None
    peer = _rank_in(pg, dst, group_dst, "dst")
    return _launch("isend", lambda: pg.core.isend(tensor, peer, tag=tag), True, [tensor])


def irecv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> Work | None:
    """Receive into ``tensor`` from ``src`` (None: any rank) without blocking; returns a Work."""
    pg = _member(group, "irecv")
    if pg is None:
        return None
    peer = None if src is None and group_src is None else _rank_in(pg, src, group_src, "src")
    return _launch("irecv", lambda: pg.core.irecv(tensor, peer, tag=tag), True, [tensor], _source(pg))


def send(
    tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0, group_dst: int | None = None
) -> None:
    """Send ``tensor`` to ``dst`` and block until it was handed over."""
    pg = _member(group, "send")
    if pg is None:
        return
    peer = _rank_in(pg, dst, group_dst, "dst")
    _launch("send", lambda: pg.core.send(tensor, peer, tag=tag), False, [tensor])


def recv(
    tensor: Any, src: int | None = None, group: Any = None, tag: int = 0, group_src: int | None = None
) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank).

    Returns:
        The sender's global rank (-1 for non-members).
    """
    pg = _member(group, "recv")
    if pg is None:
        return -1
    peer = None if src is None and group_src is None else _rank_in(pg, src, group_src, "src")
    return _launch("recv", lambda: pg.core.recv(tensor, peer, tag=tag), False, [tensor], _source(pg))


def _source(pg: ProcessGroup) -> Callable[[Any], int]:
    def to_global(group_rank: Any) -> int:
        return pg.global_rank(int(group_rank))

    return to_global


class P2POp:
    """One send or receive for batch_isend_irecv (torch's P2POp).

    Args:
        op: ``isend`` or ``irecv`` (aiocoll.sync's or torch.distributed's).
        tensor: the buffer. peer / group_peer: the other rank (global / within group). tag: tag.

    Raises:
        ValueError: when op is neither isend nor irecv.
    """

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: Any,
        peer: int | None = None,
        group: Any = None,
        tag: int = 0,
        group_peer: int | None = None,
    ) -> None:
        if getattr(op, "__name__", None) not in ("isend", "irecv"):
            raise ValueError("Invalid ``op``: expected aiocoll.sync.isend or aiocoll.sync.irecv")
        self.op = isend if op.__name__ == "isend" else irecv
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, group_peer={self.group_peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: Sequence[P2POp]) -> list[Work]:
    """Launch every send and receive of the list, in order; returns their Works.

    Raises:
        ValueError: for an empty list, or ops on different groups.
        TypeError: for an element that is not a P2POp.
    """
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv needs a non-empty list of P2POp")
    for p in p2p_op_list:
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv takes P2POp objects, not {type(p).__name__}")
    if len({id(p.group) for p in p2p_op_list}) > 1:
        raise ValueError("batch_isend_irecv: all ops need to use the same group")
    works: list[Work] = []
    for p in p2p_op_list:
        if p.op is isend:
            work = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            work = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        if work is not None:
            works.append(work)
    return works


# ----------------------------------------------------------------------------- collectives


def broadcast(
    tensor: Any,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank."""
    pg = _member(group, "broadcast")
    if pg is None:
        return None
    root = _rank_in(pg, src, group_src, "src")
    return _launch("broadcast", lambda: pg.core.broadcast(tensor, src=root), async_op, [tensor])


def all_reduce(tensor: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across ranks with ``op``, in place on every rank."""
    pg = _member(group, "all_reduce")
    if pg is None:
        return None
    reduce_op = _op(op)
    return _launch("all_reduce", lambda: pg.core.all_reduce(tensor, op=reduce_op), async_op, [tensor])


def reduce(
    tensor: Any,
    dst: int | None = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Reduce ``tensor`` across ranks into ``tensor`` of rank ``dst``."""
    pg = _member(group, "reduce")
    if pg is None:
        return None
    root = _rank_in(pg, dst, group_dst, "dst")
    reduce_op = _op(op)
    return _launch("reduce", lambda: pg.core.reduce(tensor, dst=root, op=reduce_op), async_op, [tensor])


def all_gather(tensor_list: list[Any], tensor: Any, group: Any = None, async_op: bool = False) -> Work | None:
    """Gather ``tensor`` of every rank into ``tensor_list`` (one entry per rank) on every rank."""
    pg = _member(group, "all_gather")
    if pg is None:
        return None
    return _launch("all_gather", lambda: pg.core.all_gather(tensor_list, tensor), async_op, list(tensor_list))


def all_gather_into_tensor(
    output_tensor: Any, input_tensor: Any, group: Any = None, async_op: bool = False
) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (concatenated or stacked)."""
    pg = _member(group, "all_gather_into_tensor")
    if pg is None:
        return None
    return _launch(
        "all_gather_into_tensor",
        lambda: pg.core.all_gather_into_tensor(output_tensor, input_tensor),
        async_op,
        [output_tensor],
    )


def gather(
    tensor: Any,
    gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: int | None = None,
) -> Work | None:
    """Gather ``tensor`` of every rank into ``gather_list`` on rank ``dst`` (default 0)."""
    pg = _member(group, "gather")
    if pg is None:
        return None
    root = _rank_in(pg, dst, group_dst, "dst", default=0)
    return _launch(
        "gather", lambda: pg.core.gather(tensor, gather_list, dst=root), async_op, list(gather_list or [])
    )


def scatter(
    tensor: Any,
    scatter_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
) -> Work | None:
    """Give rank i entry i of ``scatter_list`` of rank ``src`` (default 0), into ``tensor``."""
    pg = _member(group, "scatter")
    if pg is None:
        return None
    root = _rank_in(pg, src, group_src, "src", default=0)
    return _launch(
        "scatter", lambda: pg.core.scatter(tensor, scatter_list or None, src=root), async_op, [tensor]
    )


def reduce_scatter(
    output: Any, input_list: list[Any], op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Reduce entry i of every rank's ``input_list`` into ``output`` of rank i."""
    pg = _member(group, "reduce_scatter")
    if pg is None:
        return None
    reduce_op = _op(op)
    return _launch(
        "reduce_scatter",
        lambda: pg.core.reduce_scatter(output, input_list, op=reduce_op),
        async_op,
        [output],
    )


def reduce_scatter_tensor(
    output: Any, input: Any, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Work | None:
    """Reduce chunk i of every rank's ``input`` into ``output`` of rank i."""
    pg = _member(group, "reduce_scatter_tensor")
    if pg is None:
        return None
    reduce_op = _op(op)
    return _launch(
        "reduce_scatter_tensor",
        lambda: pg.core.reduce_scatter_tensor(output, input, op=reduce_op),
        async_op,
        [output],
    )


def all_to_all(
    output_tensor_list: list[Any], input_tensor_list: list[Any], group: Any = None, async_op: bool = False
) -> Work | None:
    """Send entry i of ``input_tensor_list`` to rank i; receive rank j's into output entry j."""
    pg = _member(group, "all_to_all")
    if pg is None:
        return None
    return _launch(
        "all_to_all",
        lambda: pg.core.all_to_all(output_tensor_list, input_tensor_list),
        async_op,
        list(output_tensor_list),
    )


def all_to_all_single(
    output: Any,
    input: Any,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> Work | None:
    """all_to_all over the first dimension of single tensors, with optional split sizes."""
    pg = _member(group, "all_to_all_single")
    if pg is None:
        return None
    return _launch(
        "all_to_all_single",
        lambda: pg.core.all_to_all_single(output, input, output_split_sizes, input_split_sizes),
        async_op,
        [output],
    )


def barrier(
    group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None
) -> Work | None:
    """Block until every rank of ``group`` reached the barrier.

    Raises:
        CollectiveTimeout: naming the ranks that did not arrive within ``timeout`` (default: the
            group's timeout).
    """
    pg = _member(group, "barrier")
    if pg is None:
        return None
    seconds = to_seconds(timeout)
    if seconds is None:
        return _launch("barrier", lambda: pg.core.barrier(), async_op, [])
    return _launch("barrier", lambda: pg.core.barrier(timeout=seconds), async_op, [])


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier that names the ranks that did not arrive (torch's monitored_barrier).

    As in torch, every other rank reports to the group's rank 0, which answers once all arrived.

    Args:
        group: the group (None: the default group).
        timeout: seconds or timedelta (default: the group's timeout).
        wait_all_ranks: rank 0 waits the whole timeout and names every missing rank, instead of
            failing on the first (lowest) missing one.

    Raises:
        CollectiveTimeout (a DistError, i.e. RuntimeError): on rank 0, naming the global ranks that
            did not arrive; on the others, naming rank 0 when it did not answer.
    """
    pg = _member(group, "monitored_barrier")
    if pg is None:
        return
    seconds = to_seconds(timeout)
    if seconds is None:
        seconds = pg.timeout
    get_loop_thread().run(
        run_monitored_barrier(pg.core, seconds, wait_all_ranks, group=pg.group_name, rank_name=pg.global_rank)
    )


async def _on_loop(start: Callable[[], Any]) -> Any:
    # The core is called on the loop thread (the engine is not thread-safe), where this runs.
    return await start()


# -------------------------------------------------------------------------- object collectives


def broadcast_object_list(
    object_list: list[Any],
    src: int | None = None,
    group: Any = None,
    device: Any = None,
    group_src: int | None = None,
) -> None:
    """Replace ``object_list``'s entries on every rank with those of rank ``src`` (default 0).

    Objects travel pickled, and only between authenticated peers.
    """
    pg = _member(group, "broadcast_object_list")
    if pg is None:
        return
    root = _rank_in(pg, src, group_src, "src", default=0)
    sent = list(object_list)
    received = get_loop_thread().run(_on_loop(lambda: pg.core.broadcast_object(sent, src=root)))
    if pg.rank() != root:
        object_list[: len(received)] = received


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Put every rank's ``obj`` into ``object_list`` (entry i from rank i) on every rank."""
    pg = _member(group, "all_gather_object")
    if pg is None:
        return
    gathered = get_loop_thread().run(_on_loop(lambda: pg.core.all_gather_object(obj)))
    for i, value in enumerate(gathered):
        object_list[i] = value


def gather_object(
    obj: Any,
    object_gather_list: list[Any] | None = None,
    dst: int | None = None,
    group: Any = None,
    group_dst: int | None = None,
) -> None:
    """Put every rank's ``obj`` into ``object_gather_list`` of rank ``dst`` (default 0)."""
    pg = _member(group, "gather_object")
    if pg is None:
        return
    root = _rank_in(pg, dst, group_dst, "dst", default=0)
    if pg.rank() == root and object_gather_list is None:
        raise ValueError("gather_object: the destination rank must pass object_gather_list")
    gathered = get_loop_thread().run(_on_loop(lambda: pg.core.gather_object(obj, dst=root)))
    if pg.rank() == root and object_gather_list is not None:
        for i, value in enumerate(gathered):
            object_gather_list[i] = value


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int | None = None,
    group: Any = None,
    group_src: int | None = None,
) -> None:
    """Put entry i of rank ``src``'s input list into ``scatter_object_output_list[0]`` of rank i."""
    pg = _member(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_output_list must be a list of at least one element")
    root = _rank_in(pg, src, group_src, "src", default=0)
    objs = (
        list(scatter_object_input_list)
        if pg.rank() == root and scatter_object_input_list is not None
        else None
    )
    received = get_loop_thread().run(_on_loop(lambda: pg.core.scatter_object(objs, src=root)))
    scatter_object_output_list[0] = received
