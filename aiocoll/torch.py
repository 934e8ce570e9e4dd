"""aiocoll.torch: importing it registers the torch.distributed backend "aiocoll".

    import aiocoll.torch  # noqa: F401
    torch.distributed.init_process_group("aiocoll")   # then new_group, collectives, DDP, hooks

Public surface: imports torch, the async API (aiocoll.api) and the loop-thread bridge. It holds no
collective logic: ``AiocollProcessGroup`` subclasses ``torch.distributed.ProcessGroup`` and turns
each call c10d makes (lists of tensors plus an options object) into one operation of an
``aiocoll.ProcessGroup`` running on aiocoll's loop thread, and returns an ``AiocollWork``.

Devices: registered for "cpu" and "cuda". CUDA tensors go through aiocoll's pinned staging
pipeline (aiocoll.device._staging). As torch's own collectives do, an operation orders itself on the
caller's current CUDA stream: the values staged are those the caller's stream computed before
the call (an event recorded on the calling thread at call time), and ``Work.wait()`` makes the
caller's current stream wait for the results instead of blocking the host on the last copy
(the network part of the operation is host-driven and is waited for on the host). The Work's
future completes once the results are on the device. ``device_id`` in ``init_process_group``
is accepted (the group is not split per device: one aiocoll group serves every device).

Rendezvous goes through the store torch hands the backend (already prefixed per group), wrapped
as an aiocoll async store; each torch group, default or made by ``new_group``, is its own aiocoll
group with its own peer links.

Ordering. Operations of one group are matched across ranks in the order each rank launched
them: the launch (``call_soon_threadsafe`` onto the loop, which takes the sequence number in that
order) happens on the calling thread before the call returns. Comm hooks that launch collectives
from a future's callback (PowerSGD does) therefore race with collectives launched meanwhile by
the autograd thread, and two ranks may order them differently. Such hooks are safe when nothing
else is launched on that group until they finish: one gradient bucket (a large
``bucket_cap_mb``), or a hook that waits for its collectives before returning.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as td

from ._deadline import to_seconds
from ._monitored_barrier import monitored_barrier as run_monitored_barrier
from ._sync_loop import Outcome, get_loop_thread, issue_on_caller_streams
from ._sync_stores import as_async_store
from ._torch_work import AiocollWork
from ._types import ReduceOp

__all__ = [
    "BACKEND_NAME",
    "DEVICES",
    "AiocollProcessGroup",
    "AiocollWork",
    "adopting",
    "create_process_group",
]

BACKEND_NAME = "aiocoll"
# The devices whose tensors the backend moves: registered with torch, and checked at every call.
DEVICES = ("cpu", "cuda")
_DEFAULT_TIMEOUT = 1800.0


# c10d's RedOpType members as aiocoll's ReduceOp, by their int values, filled as they are met:
# c10d's options object makes a new ReduceOp wrapper at every read, and this is read at every
# call. Looked up by the wrapper's hash, which c10d makes its RedOpType's int: one pybind call,
# where ``.op.value`` is two and makes an enum object, which together cost more than the rest of
# this function. An entry is made only where the hash is that int, so a torch that hashed its
# wrappers otherwise would always take the long way, never a wrong entry.
_by_red_op: dict[int, ReduceOp] = {}


def _reduce_op(opts: Any) -> ReduceOp:
    """The reduction of c10d's options object; SUM when c10d passes none."""
    if opts is None:
        return ReduceOp.SUM
    op = opts.reduceOp
    if type(op) is not td.ReduceOp:  # (options made by hand)
        return ReduceOp.coerce(op)
    key = hash(op)
    known = _by_red_op.get(key)
    if known is None:
        inner = op.op  # type: ignore[attr-defined]  # (c10d's ReduceOp wraps a RedOpType in .op)
        known = ReduceOp.coerce(inner)  # (PREMUL_SUM raises, uncached)
        if key == inner.value:
            _by_red_op[key] = known
    return known


def _root(opts: Any) -> int:
    """The root rank of c10d's options object; 0 when c10d passes none."""
    return int(opts.rootRank) if opts is not None else 0


def _one(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    # (its device is checked once, by _launch, with every other tensor of the call)
    if len(tensors) != 1:
        raise ValueError(
            f"aiocoll {op}: expected a list of exactly one tensor per process, got {len(tensors)}"
        )
    return tensors[0]


def _check_devices(op: str, tensors: Sequence[Any]) -> None:
    for t in tensors:
        if getattr(t, "is_cpu", False):
            continue  # (the usual tensor, without making its torch.device)
        device = getattr(t, "device", None)
        # a tensor's device is a torch.device already; anything else (a string) is parsed
        if device is not None and getattr(device, "type", None) not in DEVICES:
            _check_device(op, device)


def _check_device(op: str, device: Any) -> None:
    if device is not None:
        device = torch.device(device)
        if device.type not in DEVICES:
            raise ValueError(
                f"aiocoll {op}: got a tensor on device {device}; the aiocoll backend moves tensors on "
                f"{', '.join(DEVICES)} only. Copy it there (.cpu()), or give torch a backend per device, "
                f"e.g. init_process_group('cpu:aiocoll,xpu:xccl')"
            )


def _not_on_aiocoll(what: str, instead: str) -> NotImplementedError:
    """The error for a torch feature this backend does not offer (a RuntimeError, as torch's)."""
    return NotImplementedError(f"the aiocoll backend does not support {what}; {instead}")


async def _all(works: list[Any]) -> list[Any]:
    # Gathers several core Works launched together (consecutive sequence numbers).
    return list(await asyncio.gather(*(_await(w) for w in works)))


async def _await(work: Any) -> Any:
    return await work


class _Coalescing(threading.local):
    """Per thread, as torch's coalescing state is: the Works issued since _start_coalescing."""

    works: list[AiocollWork] | None = None  # (a class default: read at every call, never missing)


class AiocollProcessGroup(td.ProcessGroup):
    """A torch.distributed process group whose operations run on aiocoll.

    Args:
        store: the store torch gives the backend (prefixed for this group); used for rendezvous.
        rank: this process's rank in the group.
        size: the group's size.
        timeout: rendezvous deadline and every operation's default (timedelta or seconds).

    Raises:
        RendezvousError: the group could not form in time (StoreTimeout when its store ran out).
    """

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta | float | None) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        seconds = to_seconds(timeout) if timeout is not None else None
        self._timeout = seconds if seconds else _DEFAULT_TIMEOUT
        self._group_name = ""
        self._group_desc = ""
        self._closed = False
        self._lock = threading.Lock()
        self._coalescing = _Coalescing()
        self._loop = get_loop_thread()
        adopted = _take_adoptable(rank, size)
        # An adopted group is aiocoll.sync's world: it is that module's to close, not this one's.
        self._owns_core = adopted is None
        if adopted is not None:
            self._core = adopted
            return
        async_store = as_async_store(store)

        async def join() -> Any:
            from aiocoll.api import init_process_group

            return await init_process_group(
                rank=rank, world_size=size, timeout=self._timeout, store=async_store
            )

        self._core = self._loop.run(join())

    # -- identity ------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        """The backend's name, "aiocoll" (c10d asks it)."""
        return BACKEND_NAME

    def name(self) -> str:
        """The backend's name, "aiocoll"."""
        return BACKEND_NAME

    # torch asks the group for its backend of the device given as init_process_group's
    # device_id; one aiocoll group serves every device, and does not split per device.
    supports_splitting = False

    def _get_backend(self, device: Any) -> AiocollProcessGroup:  # type: ignore[override]
        return self

    def _set_group_name(self, name: str) -> None:
        self._group_name = name
        self._name_core_group()

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
        self._name_core_group()

    @property
    def _label(self) -> str:
        """The name errors give this group: the description the user gave, else torch's name."""
        if self._group_desc and self._group_desc != "undefined":
            return self._group_desc
        return self._group_name or "default"

    def _name_core_group(self) -> None:
        # Each torch group is its own aiocoll world (group id "w" inside): name it as torch does.
        # An adopted one keeps the name aiocoll.sync gave it.
        if self._owns_core:
            self._core._set_label(self._label)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The group's name as torch knows it."""
        return self._group_name

    @property
    def group_desc(self) -> str:
        """The group's description (``new_group(group_desc=...)``), used in messages."""
        return self._group_desc

    # -- plumbing ------------------------------------------------------------------------------
    def _launch(
        self,
        op: str,
        start: Callable[[], Any],
        tensors: list[torch.Tensor],
        source_rank: Callable[[Any], int] | None = None,
    ) -> AiocollWork:
        _check_devices(op, tensors)
        # The launch (and so the sequence number's order) happens here, on the calling thread.
        outcome, streams = issue_on_caller_streams(start, tensors, wait_on_host=False)
        work = AiocollWork(outcome, op, tensors, source_rank, streams)
        coalesced = self._coalescing.works
        if coalesced is not None:
            coalesced.append(work)
        return work

    def _many(self, op: str, calls: Sequence[Callable[[], Any]], tensors: list[torch.Tensor]) -> AiocollWork:
        """Launch several core operations back to back (one loop callback) as one Work."""
        return self._launch(op, lambda: _all([call() for call in calls]), tensors)

    # -- collectives ---------------------------------------------------------------------------
    def allreduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> AiocollWork:  # type: ignore[override]
        """All-reduce each tensor of ``tensors`` in place (``opts.reduceOp``; SUM for sparse tensors)."""
        op = _reduce_op(opts)
        t = tensors[0] if len(tensors) == 1 else _one(tensors, "allreduce")  # (_one raises)
        if t.is_sparse:  # (a COO tensor: one attribute read, where comparing layouts is two)
            return self._sparse_allreduce(t, op)
        return self._launch("allreduce", lambda: self._core.all_reduce(t, op=op), [t])

    def _sparse_allreduce(self, t: torch.Tensor, op: ReduceOp) -> AiocollWork:
        """Sum sparse COO tensors: gather every rank's (indices, values), add them up, in place.

        One core operation (an object all-gather, whose links are authenticated) carries each
        rank's entries, so the call keeps its place in the group's order.
        """
        if op != ReduceOp.SUM:
            raise ValueError(
                f"aiocoll allreduce: sparse COO tensors reduce with SUM only, got {op.name}; "
                f"use a dense tensor (t.to_dense()) for other reductions"
            )
        mine = t.coalesce()
        entries = (mine.indices(), mine.values())

        async def add_up(gathered: Any) -> None:
            parts = await gathered
            indices = torch.cat([i for i, _ in parts], dim=1)
            values = torch.cat([v for _, v in parts])
            t.copy_(torch.sparse_coo_tensor(indices, values, t.shape).coalesce())

        return self._launch("allreduce", lambda: add_up(self._core.all_gather_object(entries)), [t])

    def allreduce_coalesced(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> AiocollWork:
        """All-reduce several tensors as one operation, in place."""
        op = _reduce_op(opts)
        ts = list(tensors)
        calls = [functools.partial(self._core.all_reduce, t, op=op) for t in ts]
        return self._many("allreduce_coalesced", calls, ts)

    def broadcast(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> AiocollWork:  # type: ignore[override]
        """Broadcast ``tensors`` from ``opts.rootRank`` to every member, in place."""
        root = _root(opts)
        t = _one(tensors, "broadcast")
        return self._launch("broadcast", lambda: self._core.broadcast(t, src=root), [t])

    def reduce(self, tensors: Sequence[torch.Tensor], opts: Any = None) -> AiocollWork:  # type: ignore[override]
        """Reduce ``tensors`` onto ``opts.rootRank`` (``opts.reduceOp``)."""
        op = _reduce_op(opts)
        root = _root(opts)
        t = _one(tensors, "reduce")
        return self._launch("reduce", lambda: self._core.reduce(t, dst=root, op=op), [t])

    def allgather(  # type: ignore[override]
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> AiocollWork:
        """Gather every member's tensor into each output list."""
        outs = list(_one(output_tensors, "allgather"))  # type: ignore[arg-type]
        t = _one(input_tensors, "allgather")
        _check_devices("allgather", input_tensors)  # (_launch checks the outputs)
        return self._launch("allgather", lambda: self._core.all_gather(outs, t), outs)

    def allgather_coalesced(
        self,
        output_lists: Sequence[Sequence[torch.Tensor]],
        input_list: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> AiocollWork:
        """c10d's layout: ``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        inputs = list(input_list)
        if len(output_lists) != self.size() or any(len(outs) != len(inputs) for outs in output_lists):
            raise ValueError(
                f"aiocoll allgather_coalesced: expected output_tensor_lists as {self.size()} lists (one "
                f"per rank) of {len(inputs)} tensors (one per input), got lengths "
                f"{[len(outs) for outs in output_lists]}"
            )
        calls = [
            functools.partial(self._core.all_gather, [outs[i] for outs in output_lists], t)
            for i, t in enumerate(inputs)
        ]
        return self._many("allgather_coalesced", calls, [x for outs in output_lists for x in outs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> AiocollWork:
        """Gather every member's ``input`` into the flat ``output``."""
        return self._launch(
            "all_gather_into_tensor", lambda: self._core.all_gather_into_tensor(output, input), [output]
        )

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> AiocollWork:
        """Several all_gather_into_tensor operations as one."""
        pairs = list(zip(outputs, inputs, strict=True))
        calls = [functools.partial(self._core.all_gather_into_tensor, o, i) for o, i in pairs]
        return self._many("allgather_into_tensor_coalesced", calls, list(outputs))

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: Sequence[torch.Tensor],
        input_tensors: Sequence[Sequence[torch.Tensor]],
        opts: Any = None,
    ) -> AiocollWork:
        """Reduce the input lists and scatter the results, one tensor per member."""
        op = _reduce_op(opts)
        out = _one(output_tensors, "reduce_scatter")
        ins = list(_one(input_tensors, "reduce_scatter"))  # type: ignore[arg-type]
        return self._launch("reduce_scatter", lambda: self._core.reduce_scatter(out, ins, op=op), [out])

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> AiocollWork:
        """Reduce the flat ``input`` and give each member its slice in ``output``."""
        op = _reduce_op(opts)
        return self._launch(
            "reduce_scatter_tensor", lambda: self._core.reduce_scatter_tensor(output, input, op=op), [output]
        )

    reduce_scatter_single = reduce_scatter_tensor  # type: ignore[assignment]
    _reduce_scatter_base = reduce_scatter_tensor  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], opts: Any = None
    ) -> AiocollWork:
        """Several reduce_scatter_tensor operations as one."""
        op = _reduce_op(opts)
        pairs = list(zip(outputs, inputs, strict=True))
        calls = [functools.partial(self._core.reduce_scatter_tensor, o, i, op=op) for o, i in pairs]
        return self._many("reduce_scatter_tensor_coalesced", calls, list(outputs))

    def gather(  # type: ignore[override]
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
        opts: Any = None,
    ) -> AiocollWork:
        """Gather every member's tensor onto ``opts.rootRank``."""
        root = _root(opts)
        t = _one(input_tensors, "gather")
        _check_devices("gather", input_tensors)  # (_launch checks the outputs)
        outs = list(output_tensors[0]) if len(output_tensors) > 0 else None
        return self._launch("gather", lambda: self._core.gather(t, outs, dst=root), outs or [])

    def scatter(  # type: ignore[override]
        self,
        output_tensors: Sequence[torch.Tensor],
        input_tensors: Sequence[Sequence[torch.Tensor]],
        opts: Any = None,
    ) -> AiocollWork:
        """Scatter the root's list, one tensor per member."""
        root = _root(opts)
        out = _one(output_tensors, "scatter")
        ins = list(input_tensors[0]) if len(input_tensors) > 0 else None
        return self._launch("scatter", lambda: self._core.scatter(out, ins, src=root), [out])

    def alltoall(
        self, output_tensors: Sequence[torch.Tensor], input_tensors: Sequence[torch.Tensor], opts: Any = None
    ) -> AiocollWork:
        """Each member sends its i-th input tensor to member i."""
        outs, ins = list(output_tensors), list(input_tensors)
        return self._launch("alltoall", lambda: self._core.all_to_all(outs, ins), outs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> AiocollWork:
        """All-to-all on flat tensors, split by the given sizes (equal parts when empty)."""
        out_splits = [int(s) for s in output_split_sizes] or None
        in_splits = [int(s) for s in input_split_sizes] or None
        return self._launch(
            "alltoall_base",
            lambda: self._core.all_to_all_single(output, input, out_splits, in_splits),
            [output],
        )

    def barrier(self, opts: Any = None) -> AiocollWork:
        """Wait until every member called barrier."""
        seconds = _opts_timeout(opts)
        if seconds is None:
            return self._launch("barrier", lambda: self._core.barrier(), [])
        return self._launch("barrier", lambda: self._core.barrier(timeout=seconds), [])

    def monitored_barrier(
        self, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
    ) -> None:
        """Torch's ``ProcessGroup.monitored_barrier``: rank 0 names the ranks that did not arrive.

        ``torch.distributed.monitored_barrier(group)`` refuses every group not recorded as gloo
        (torch's own check); call this on the group instead, e.g.
        ``dist.group.WORLD.monitored_barrier(timedelta(seconds=30))``.

        Raises:
            CollectiveTimeout (a RuntimeError): on rank 0 "Rank N failed to pass monitoredBarrier
                in T ms"; on the others, when rank 0 did not answer within the timeout.
        """
        seconds = self._timeout if timeout is None else to_seconds(timeout)
        self._loop.run(
            run_monitored_barrier(self._core, seconds, bool(wait_all_ranks), group=self._label, rank_name=int)
        )

    # -- point to point ------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], dstRank: int, tag: int = 0) -> AiocollWork:
        """Send ``tensors[0]`` to ``dstRank`` with ``tag``."""
        t = _one(tensors, "send")
        dst = int(dstRank)
        return self._launch("send", lambda: self._core.send(t, dst, tag=int(tag)), [t])

    def recv(self, tensors: Sequence[torch.Tensor], srcRank: int, tag: int = 0) -> AiocollWork:
        """Receive into ``tensors[0]`` from ``srcRank`` with ``tag``."""
        t = _one(tensors, "recv")
        src = int(srcRank)
        return self._launch("recv", lambda: self._core.recv(t, src, tag=int(tag)), [t], int)

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int = 0) -> AiocollWork:
        """Receive into ``tensors[0]`` from any member; the Work's source rank says whose."""
        t = _one(tensors, "recv_anysource")
        # torch maps the group rank _source_rank() gives to a global rank itself.
        return self._launch("recv_anysource", lambda: self._core.recv(t, None, tag=int(tag)), [t], int)

    # -- coalescing (dist._coalescing_manager(group, device=...)) -----------------------------
    # Operations inside run as they are issued (in order, as always); the Work _end_coalescing
    # returns completes once every one of them did. Per thread, as torch's coalescing state is.
    def _start_coalescing(self, device: Any) -> None:
        if torch.device(device).type != "cpu":
            raise _not_on_aiocoll(
                f"device-level coalescing on {device}",
                "use dist._coalescing_manager(group) without device= (its all_reduce, "
                "all_gather_into_tensor and reduce_scatter_tensor run as one coalesced call), or issue "
                "the operations one by one and wait for their Works",
            )
        if self._coalescing.works is not None:
            raise ValueError("aiocoll: _start_coalescing called twice without _end_coalescing")
        self._coalescing.works = []

    def _end_coalescing(self, device: Any) -> AiocollWork:
        works: list[AiocollWork] | None = self._coalescing.works
        if works is None:
            raise ValueError("aiocoll: _end_coalescing without _start_coalescing")
        self._coalescing.works = None
        outcome = Outcome.all_of([w.outcome for w in works])
        return AiocollWork(outcome, "coalesced", [t for w in works for t in w.result_tensors])

    # Left to the C++ base, this fails with torch's misleading "Could not find the default
    # backend type"; say what to use instead.
    def _register_on_completion_hook(self, hook: Any) -> None:
        raise _not_on_aiocoll(
            "ProcessGroup._register_on_completion_hook",
            "chain a callback on each operation's future instead: work.get_future().then(callback)",
        )

    def set_timeout(self, timeout: datetime.timedelta | float) -> None:
        """Change the default deadline of this group's later operations (and of monitored_barrier)."""
        seconds = to_seconds(timeout)
        self._timeout = seconds if seconds else _DEFAULT_TIMEOUT
        self._core._set_default_timeout(self._timeout)

    # -- lifecycle -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Close this group's links (idempotent); pending operations fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._owns_core and self._loop.thread.is_alive():
            self._loop.run(self._core.destroy())

    def abort(self) -> None:
        """Fail every operation in flight and close the group's links at once."""
        self.shutdown()

    def __repr__(self) -> str:
        return f"<AiocollProcessGroup {self._group_name!r} rank {self.rank()}/{self.size()}>"


def _opts_timeout(opts: Any) -> float | None:
    value = getattr(opts, "timeout", None)
    if not isinstance(value, datetime.timedelta):
        return None
    seconds = value.total_seconds()
    return seconds if seconds > 0 else None  # c10d's "unset" is negative


# aiocoll.sync's world while it makes torch's default group over it (see ``adopting``).
_adoptable: list[Any] = []
_adoptable_lock = threading.Lock()


@contextlib.contextmanager
def adopting(core: Any) -> Iterator[None]:
    """Within this block, torch's next group of ``core``'s rank and size runs over ``core``.

    ``core`` is an aiocoll.ProcessGroup; the group torch creates uses it instead of a rendezvous
    of its own. This is how ``aiocoll.sync.init_process_group`` gives torch a default group (for
    DDP, FSDP2, DeviceMesh and ``torch.distributed.*``) that is the very group the script's
    aiocoll.sync calls use.
    """
    with _adoptable_lock:
        _adoptable.append(core)
    try:
        yield
    finally:
        with _adoptable_lock:
            if core in _adoptable:
                _adoptable.remove(core)


def _take_adoptable(rank: int, size: int) -> Any:
    with _adoptable_lock:
        for core in _adoptable:
            if core.rank == rank and core.size == size:
                _adoptable.remove(core)
                return core
    return None


def create_process_group(
    store: Any, rank: int, size: int, timeout: datetime.timedelta | float | None
) -> AiocollProcessGroup:
    """The creator torch calls for backend "aiocoll" (also for each new_group)."""
    return AiocollProcessGroup(store, rank, size, timeout)


def _register() -> None:
    if BACKEND_NAME.upper() in getattr(td.Backend, "_plugins", {}):
        return
    td.Backend.register_backend(BACKEND_NAME, create_process_group, devices=list(DEVICES))


_register()
