"""The async API: init_process_group and ProcessGroup.

This is the public surface: it may import everything below it (client, server, algorithms,
stores, foundations) and nothing imports it except the facade, the torch backend and the CLI.
It holds argument checking (bad arguments fail at call time, before anything is sent), tensor
conversion, operation signatures and the operation's record, handed to the group's provider
table (aiocoll.client.data.providers); the runtime's bootstrap is aiocoll.client.bootstrap, the
engine (aiocoll.client.data.engine) decides when operations run and how they fail, the providers
how bytes move.

Ranks in ProcessGroup methods (``src``, ``dst``, the ranks given to ``new_group``) are ranks *in
that group* (0..size-1), as for torch's ProcessGroup objects; ``pg.ranks`` maps them to global
ranks.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from aiocoll._reduce import check_reduce_op
from aiocoll._types import ReduceOp
from aiocoll._work import Work
from aiocoll.client.bootstrap import EmbeddedCoordinator, Runtime, start_runtime
from aiocoll.client.data._operation import DEFAULT_TIMEOUT, Operation, p2p_operation
from aiocoll.client.data.engine import GroupState
from aiocoll.client.data.providers import ProviderTable
from aiocoll.device._tensors import DEVICE, HOST, Working, as_working, dtype_name, numel
from aiocoll.stores import Store

__all__ = ["ProcessGroup", "init_process_group"]

log = logging.getLogger("aiocoll")

_DEFAULT = DEFAULT_TIMEOUT  # "use the group's default timeout"
_META_CACHE = 256  # distinct operation signatures a group keeps made (see ProcessGroup._meta)


# --------------------------------------------------------------------------------------------
# argument checking


def _check_rank(what: str, value: Any, size: int) -> int:
    if type(value) is int and 0 <= value < size:  # (the usual call: checked in fewest steps)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int group rank, got {type(value).__name__} {value!r}")
    r = int(value)
    if not 0 <= r < size:
        raise ValueError(f"{what}={r} is out of range: this group has ranks 0..{size - 1}")
    return r


def _check_tag(tag: Any) -> int:
    if type(tag) is int:  # (the usual call: checked in fewest steps)
        return tag
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be an int, got {type(tag).__name__} {tag!r}")
    return int(tag)


def _check_list(what: str, value: Any, length: int) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{what} must be a list of {length} tensors, got {type(value).__name__}")
    if len(value) != length:
        raise ValueError(
            f"{what} has {len(value)} tensors; this group of size {length} needs exactly {length}"
        )
    return list(value)


def _same_dtype(what: str, tensors: Sequence[Any], name: str) -> None:
    for i, t in enumerate(tensors):
        got = dtype_name(t)
        if got != name:
            raise TypeError(
                f"{what}[{i}] has dtype {got} but the operation's tensor is {name}; use one dtype"
            )


def _same_numel(what: str, tensors: Sequence[Any], count: int) -> None:
    for i, t in enumerate(tensors):
        got = numel(t)
        if got != count:
            raise ValueError(
                f"{what}[{i}] has {got} elements; it must have {count} (as the operation's tensor)"
            )


def _memory(workings: Sequence[Working]) -> str:
    """The memory of an operation on these tensors: DEVICE when any is a device tensor."""
    for w in workings:
        if w.memory is DEVICE:
            return DEVICE
    return HOST


def _coerce_op(op: Any, name: str, kind: str) -> ReduceOp:
    rop = op if type(op) is ReduceOp else ReduceOp.coerce(op)
    try:
        check_reduce_op(rop, name)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{kind}: {exc}") from exc
    return rop


# --------------------------------------------------------------------------------------------
# ProcessGroup


class ProcessGroup:
    """A group of ranks and every operation of the contract over them.

    Every operation enqueues at call time and returns a `aiocoll.Work` at once; ``await`` it
    for the result, or call ``.wait()`` from a thread outside the event loop. Operations of one
    group match across ranks in the order each rank called them, so many may be in flight
    (``asyncio.gather``). Rank arguments (``src``, ``dst``) are ranks within this group.

    Tensors are ``numpy.ndarray`` or ``torch.Tensor`` (CPU or CUDA), of any shape, contiguous or
    not; results are written in place. Make one with `init_process_group` or
    `new_group`.

    Attributes:
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        ranks: the members' global ranks, indexed by group rank.
        group_id: the group's id in messages (the world group's is ``"w"``).

    Example:
        ```python
        async with await aiocoll.init_process_group() as pg:
            x = np.full(4, pg.rank, dtype=np.float32)
            await pg.all_reduce(x)                   # the sum over the ranks, in place
            a, b = np.ones(3), np.ones(3)
            await asyncio.gather(pg.all_reduce(a), pg.broadcast(b, src=0))
        ```
    """

    def __init__(
        self,
        runtime: Runtime,
        state: GroupState,
        *,
        owner: bool = False,
        providers: ProviderTable | None = None,
    ) -> None:
        self._rt = runtime
        self._state = state
        self._owner = owner
        self.rank = state.index
        self.size = len(state.ranks)
        self.ranks = list(state.ranks)
        # the other members' global ranks by group rank: a send's or receive's peer checked and
        # looked up at once
        self._peers = {i: r for i, r in enumerate(self.ranks) if i != self.rank}
        self.group_id = state.gid
        self._destroyed = False
        self._metas: dict[tuple[Any, ...], dict[str, Any]] = {}
        # How this group's collectives run: chosen once, here (client/data/providers.py).
        self._providers = runtime.table(state, providers)

    def __repr__(self) -> str:
        return f"<aiocoll.ProcessGroup {self.group_id!r} rank {self.rank}/{self.size} ranks={self.ranks}>"

    @property
    def default_timeout(self) -> float | None:
        """Seconds every operation may take unless given its own ``timeout=`` (None: no limit)."""
        return self._rt.engine.default_timeout  # (what the engine gives an operation called without)

    def _set_label(self, label: str) -> None:
        """Name this group in error messages (the torch backend passes torch's group name)."""
        self._state.label = label

    def _set_default_timeout(self, seconds: float | None) -> None:
        """Change the default deadline of later operations of every group on this runtime.

        This is torch's ``ProcessGroup.set_timeout``; each torch group has a runtime of its own.
        """
        self._rt.engine.default_timeout = seconds

    @property
    def store(self) -> Store | None:
        """The rendezvous store when one was given or made (file://, ``store=``), else None."""
        return self._rt.store

    # -- plumbing --------------------------------------------------------------------------
    def _meta(
        self,
        kind: str,
        name: str | None = None,
        count: int | None = None,
        *,
        root: int | None = None,
        op: str | None = None,
    ) -> dict[str, Any]:
        """An operation's signature (kind, dtype, count, root, op: what every rank must agree on).

        Made once per distinct signature and shared by every operation that has it (a training
        loop repeats a few), so what is derived from it can be cached by identity (the packed
        bytes shared-memory collectives publish); nothing may change the dict.
        """
        key = (kind, name, count, root, op)  # (all_reduce looks its signature up by this key too)
        meta = self._metas.get(key)
        if meta is not None:
            return meta
        meta = {"kind": kind}
        if name is not None:
            meta["dtype"] = name
        if count is not None:
            meta["count"] = count
        if root is not None:
            meta["root"] = root
        if op is not None:
            meta["op"] = op
        if len(self._metas) >= _META_CACHE:
            self._metas.clear()
        self._metas[key] = meta
        return meta

    # -- point to point --------------------------------------------------------------------
    def send(self, tensor: Any, dst: int, tag: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Send ``tensor`` to group rank ``dst``.

        Args:
            tensor: the data to send; it may be reused once the Work completes.
            dst: the receiving group rank.
            tag: tells apart messages between the same two ranks; the receive must use the same tag.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives None, once the data was handed off.

        Raises:
            ValueError: ``dst`` out of range or this rank.
            TypeError: not a tensor, or ``tag`` not an int.
        """
        # (the usual call, an int rank of another member and an int tag, checked in one look-up)
        peer = self._peers.get(dst) if type(dst) is int and type(tag) is int else None
        if peer is None:
            d = _check_rank("dst", dst, self.size)
            if d == self.rank:
                raise ValueError(f"send: dst={d} is this rank; a rank cannot send to itself")
            peer, tag = self.ranks[d], _check_tag(tag)
        w = as_working(tensor, True, False)
        meta = {"dtype": w.dtype_name, "count": w.array.size}
        if w.memory == HOST:
            return self._providers.send(peer, tag, w, meta, timeout)
        return self._providers.submit(p2p_operation("send", meta, w.array, w, w.memory, peer, tag, timeout))

    def recv(self, tensor: Any, src: int | None = None, tag: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Receive into ``tensor`` from group rank ``src``, or from any rank.

        Args:
            tensor: where the message lands; its dtype and size must be the sender's.
            src: the sending group rank; None takes the first message of ``tag`` from any rank (it
                keeps waiting while some other rank of the group is alive).
            tag: the sender's tag.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives the sender's group rank.

        Raises:
            ValueError: ``src`` out of range or this rank.
            TypeError: not a tensor, or ``tag`` not an int.
            MismatchError: (from the awaited Work) the message's dtype or size differs from
                ``tensor``'s.
        """
        # (the usual call, an int rank of another member and an int tag, checked in one look-up)
        peer = self._peers.get(src) if type(src) is int and type(tag) is int else None
        if peer is None:
            if src is not None:
                s = _check_rank("src", src, self.size)
                if s == self.rank:
                    raise ValueError(f"recv: src={s} is this rank; a rank cannot receive from itself")
                peer = self.ranks[s]
            tag = _check_tag(tag)
        w = as_working(tensor, False, True)
        meta = {"dtype": w.dtype_name, "count": w.array.size}
        if w.memory == HOST:
            return self._providers.recv(peer, tag, w, meta, timeout)
        return self._providers.submit(p2p_operation("recv", meta, w.array, w, w.memory, peer, tag, timeout))

    isend = send
    irecv = recv

    # -- collectives -----------------------------------------------------------------------
    def broadcast(self, tensor: Any, src: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Copy ``tensor`` of group rank ``src`` into ``tensor`` on every rank.

        Args:
            tensor: the data on ``src``; the destination, of the same dtype and size, elsewhere.
            src: the group rank whose data is sent.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``tensor``.

        Raises:
            ValueError: ``src`` out of range.
            MismatchError: (from the awaited Work) ranks gave different roots, dtypes or sizes.
        """
        root = _check_rank("src", src, self.size)
        w = as_working(tensor, root == self.rank, True)
        meta = self._meta("broadcast", w.dtype_name, w.numel, root=root)
        o = Operation("broadcast", meta, (), (w.array,), (w,), tensor, timeout, w.memory)
        o.root = root
        return self._providers.submit(o)

    def all_reduce(self, tensor: Any, op: Any = ReduceOp.SUM, *, timeout: Any = _DEFAULT) -> Work:
        """Reduce ``tensor`` over every rank; the result is written into ``tensor`` everywhere.

        Args:
            tensor: this rank's contribution, overwritten with the result.
            op: an `aiocoll.ReduceOp` (or torch's, or its name).
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``tensor``.

        Raises:
            TypeError: not a tensor, or ``op`` meaningless for its dtype (AVG of integers, bitwise
                operations on floats).
            MismatchError: (from the awaited Work) ranks gave different ops, dtypes or sizes.
            PeerLostError: (from the awaited Work) a rank of the group was lost.
            CollectiveTimeout: (from the awaited Work) the operation outlived its timeout.

        Example:
            ```python
            grads = np.ones(1024, dtype=np.float32)
            await pg.all_reduce(grads, op=aiocoll.ReduceOp.AVG)
            ```
        """
        w = as_working(tensor)
        name = w.dtype_name
        rop = op if type(op) is ReduceOp else ReduceOp.coerce(op)
        count = w.array.size
        # A signature is made only once its op was found meaningful for its dtype: one made
        # already needs no second check (the usual call, in a loop of a few signatures).
        meta = self._metas.get(("all_reduce", name, count, None, rop._value_))
        if meta is None:
            rop = _coerce_op(rop, name, "all_reduce")
            meta = self._meta("all_reduce", name, count, op=rop._value_)
        return self._providers.all_reduce(w, rop, meta, tensor, timeout)

    def reduce(self, tensor: Any, dst: int = 0, op: Any = ReduceOp.SUM, *, timeout: Any = _DEFAULT) -> Work:
        """Reduce ``tensor`` over every rank into ``tensor`` of group rank ``dst``.

        Args:
            tensor: this rank's contribution; on ``dst`` it is overwritten with the result.
            dst: the group rank that receives the result.
            op: an `aiocoll.ReduceOp`.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``tensor``.

        Raises:
            ValueError: ``dst`` out of range.
            TypeError: not a tensor, or ``op`` meaningless for its dtype.
        """
        root = _check_rank("dst", dst, self.size)
        name = dtype_name(tensor)
        rop = _coerce_op(op, name, "reduce")
        w = as_working(tensor, write=root == self.rank)
        meta = self._meta("reduce", name, w.numel, root=root, op=rop._value_)
        workings = (w,) if root == self.rank else ()
        o = Operation("reduce", meta, (w.array,), (w.array,), workings, tensor, timeout, w.memory)
        o.root = root
        o.op = rop
        return self._providers.submit(o)

    def all_gather(self, tensor_list: Any, tensor: Any, *, timeout: Any = _DEFAULT) -> Work:
        """Gather every rank's ``tensor`` into ``tensor_list`` on every rank.

        Args:
            tensor_list: one tensor per rank, in group-rank order, each of ``tensor``'s dtype and size.
            tensor: this rank's contribution.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``tensor_list``.

        Raises:
            ValueError: ``tensor_list`` does not hold one tensor per rank.
            TypeError: a tensor of another dtype or size.
        """
        name = dtype_name(tensor)
        outs = _check_list("all_gather: tensor_list", tensor_list, self.size)
        _same_dtype("all_gather: tensor_list", outs, name)
        _same_numel("all_gather: tensor_list", outs, numel(tensor))
        w = as_working(tensor, write=False)
        wo = [as_working(t, read=False) for t in outs]
        meta = self._meta("all_gather", name, w.numel)
        memory = _memory([w, *wo])
        return self._providers.submit(
            Operation("all_gather", meta, (w.array,), [x.array for x in wo], wo, tensor_list, timeout, memory)
        )

    def all_gather_into_tensor(
        self, output_tensor: Any, input_tensor: Any, *, timeout: Any = _DEFAULT
    ) -> Work:
        """Gather every rank's ``input_tensor`` into one ``output_tensor``, in rank order.

        Args:
            output_tensor: ``size`` times ``input_tensor``'s elements.
            input_tensor: this rank's contribution.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``output_tensor``.

        Raises:
            ValueError: ``output_tensor`` has the wrong number of elements.
            TypeError: the tensors' dtypes differ.
        """
        name = dtype_name(input_tensor)
        _same_dtype("all_gather_into_tensor: output_tensor", [output_tensor], name)
        n = numel(input_tensor)
        if numel(output_tensor) != n * self.size:
            raise ValueError(
                f"all_gather_into_tensor: output_tensor has {numel(output_tensor)} elements; it needs "
                f"{self.size} x {n} = {n * self.size}"
            )
        w = as_working(input_tensor, write=False)
        wo = as_working(output_tensor, read=False)
        parts = [wo.array[i * n : (i + 1) * n] for i in range(self.size)]
        meta = self._meta("all_gather", name, n)
        memory = _memory((w, wo))
        return self._providers.submit(
            Operation("all_gather", meta, (w.array,), parts, (wo,), output_tensor, timeout, memory)
        )

    def _root_list(
        self, op: str, list_name: str, root_name: str, root: int, value: Any, dtype: str, count: int
    ) -> list[Any] | None:
        """The per-rank list a rooted op takes on its root (checked), or None elsewhere.

        Raises:
            ValueError/TypeError: the root gave no list, or one of the wrong length, dtype or sizes;
                a non-root gave a list.
        """
        if root != self.rank:
            if value:
                raise ValueError(
                    f"{op}: {list_name} must be None on rank {self.rank}, which is not {root_name}={root}"
                )
            return None
        if value is None:
            raise ValueError(
                f"{op}: rank {root} is {root_name} and must pass {list_name} of {self.size} tensors"
            )
        what = f"{op}: {list_name}"
        tensors = _check_list(what, value, self.size)
        _same_dtype(what, tensors, dtype)
        _same_numel(what, tensors, count)
        return tensors

    def gather(self, tensor: Any, gather_list: Any = None, dst: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Gather every rank's ``tensor`` into ``gather_list`` of group rank ``dst``.

        Args:
            tensor: this rank's contribution.
            gather_list: on ``dst``, one tensor per rank; None on the other ranks.
            dst: the group rank that gathers.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``gather_list`` on ``dst`` and None elsewhere.

        Raises:
            ValueError: ``gather_list`` missing on ``dst``, given elsewhere, or of the wrong length.
        """
        root = _check_rank("dst", dst, self.size)
        name = dtype_name(tensor)
        w = as_working(tensor, write=False)
        outs = self._root_list("gather", "gather_list", "dst", root, gather_list, name, w.numel)
        if outs is not None:
            wo = [as_working(t, read=False) for t in outs]
            recv = [x.array for x in wo]
            result: Any = gather_list
        else:
            wo, recv, result = [], [], None
        meta = self._meta("gather", name, w.numel, root=root)
        o = Operation("gather", meta, (w.array,), recv, wo, result, timeout, _memory([w, *wo]))
        o.root = root
        return self._providers.submit(o)

    def scatter(
        self, tensor: Any, scatter_list: Any = None, src: int = 0, *, timeout: Any = _DEFAULT
    ) -> Work:
        """Give group rank ``i`` the tensor ``scatter_list[i]`` of rank ``src``, into its ``tensor``.

        Args:
            tensor: where this rank's part lands.
            scatter_list: on ``src``, one tensor per rank; None on the other ranks.
            src: the group rank that scatters.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``tensor``.

        Raises:
            ValueError: ``scatter_list`` missing on ``src``, given elsewhere, or of the wrong length.
        """
        root = _check_rank("src", src, self.size)
        name = dtype_name(tensor)
        w = as_working(tensor, read=False)
        ins = self._root_list("scatter", "scatter_list", "src", root, scatter_list, name, w.numel)
        wi = [] if ins is None else [as_working(t, write=False) for t in ins]
        meta = self._meta("scatter", name, w.numel, root=root)
        send = [x.array for x in wi]
        o = Operation("scatter", meta, send, (w.array,), (w,), tensor, timeout, _memory([w, *wi]))
        o.root = root
        return self._providers.submit(o)

    def reduce_scatter(
        self, output: Any, input_list: Any, op: Any = ReduceOp.SUM, *, timeout: Any = _DEFAULT
    ) -> Work:
        """Reduce ``input_list[i]`` over every rank into ``output`` of group rank ``i``.

        Args:
            output: where this rank's reduced part lands.
            input_list: one tensor per rank, each of ``output``'s dtype and size.
            op: an `aiocoll.ReduceOp`.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``output``.

        Raises:
            ValueError: ``input_list`` does not hold one tensor per rank.
            TypeError: a tensor of another dtype or size, or ``op`` meaningless for the dtype.
        """
        name = dtype_name(output)
        rop = _coerce_op(op, name, "reduce_scatter")
        ins = _check_list("reduce_scatter: input_list", input_list, self.size)
        _same_dtype("reduce_scatter: input_list", ins, name)
        _same_numel("reduce_scatter: input_list", ins, numel(output))
        w = as_working(output, read=False)
        wi = [as_working(t, write=False) for t in ins]
        meta = self._meta("reduce_scatter", name, w.numel, op=rop._value_)
        send = [x.array for x in wi]
        o = Operation("reduce_scatter", meta, send, (w.array,), (w,), output, timeout, _memory([w, *wi]))
        o.op = rop
        return self._providers.submit(o)

    def reduce_scatter_tensor(
        self, output: Any, input: Any, op: Any = ReduceOp.SUM, *, timeout: Any = _DEFAULT
    ) -> Work:
        """Reduce ``input`` over every rank; rank ``i`` gets block ``i`` of the result in ``output``.

        Args:
            output: where this rank's block lands.
            input: ``size`` times ``output``'s elements.
            op: an `aiocoll.ReduceOp`.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``output``.

        Raises:
            ValueError: ``input`` has the wrong number of elements.
            TypeError: the dtypes differ, or ``op`` is meaningless for the dtype.
        """
        name = dtype_name(output)
        rop = _coerce_op(op, name, "reduce_scatter_tensor")
        _same_dtype("reduce_scatter_tensor: input", [input], name)
        n = numel(output)
        if numel(input) != n * self.size:
            raise ValueError(
                f"reduce_scatter_tensor: input has {numel(input)} elements; "
                f"it needs {self.size} x {n} = {n * self.size}"
            )
        w = as_working(output, read=False)
        wi = as_working(input, write=False)
        send = [wi.array[i * n : (i + 1) * n] for i in range(self.size)]
        meta = self._meta("reduce_scatter", name, n, op=rop._value_)
        o = Operation("reduce_scatter", meta, send, (w.array,), (w,), output, timeout, _memory((w, wi)))
        o.op = rop
        return self._providers.submit(o)

    def all_to_all(self, output_list: Any, input_list: Any, *, timeout: Any = _DEFAULT) -> Work:
        """Send ``input_list[j]`` to group rank ``j`` and receive rank ``j``'s into ``output_list[j]``.

        Args:
            output_list: one tensor per rank, where each rank's part lands.
            input_list: one tensor per rank, what each rank gets from this one.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``output_list``.

        Raises:
            ValueError: a list does not hold one tensor per rank.
        """
        outs = _check_list("all_to_all: output_list", output_list, self.size)
        ins = _check_list("all_to_all: input_list", input_list, self.size)
        if not ins:
            raise ValueError("all_to_all: empty lists")
        name = dtype_name(ins[0])
        _same_dtype("all_to_all: input_list", ins, name)
        _same_dtype("all_to_all: output_list", outs, name)
        if numel(outs[self.rank]) != numel(ins[self.rank]):
            raise ValueError(
                f"all_to_all: output_list[{self.rank}] has {numel(outs[self.rank])} elements but "
                f"input_list[{self.rank}] (this rank's block to itself) has {numel(ins[self.rank])}"
            )
        wi = [as_working(t, write=False) for t in ins]
        wo = [as_working(t, read=False) for t in outs]
        meta = self._meta("all_to_all", name)
        send, recv = [x.array for x in wi], [x.array for x in wo]
        return self._providers.submit(
            Operation("all_to_all", meta, send, recv, wo, output_list, timeout, _memory([*wi, *wo]))
        )

    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        timeout: Any = _DEFAULT,
    ) -> Work:
        """All-to-all on one tensor, split along dimension 0.

        Args:
            output: where the parts from every rank land, in rank order.
            input: the parts for every rank, in rank order.
            output_split_sizes: rows received from each rank; None: equal parts.
            input_split_sizes: rows sent to each rank; None: equal parts.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives ``output``.

        Raises:
            ValueError: split sizes that do not add up to the tensor's rows, or a tensor that does not
                divide equally.
        """
        name = dtype_name(input)
        _same_dtype("all_to_all_single: output", [output], name)
        wi = as_working(input, write=False)
        wo = as_working(output, read=False)
        in_bounds = self._splits("input", input, wi, input_split_sizes)
        out_bounds = self._splits("output", output, wo, output_split_sizes)
        if (
            in_bounds[self.rank][1] - in_bounds[self.rank][0]
            != out_bounds[self.rank][1] - out_bounds[self.rank][0]
        ):
            raise ValueError(
                f"all_to_all_single: this rank's block to itself has "
                f"{in_bounds[self.rank][1] - in_bounds[self.rank][0]} "
                f"input elements but {out_bounds[self.rank][1] - out_bounds[self.rank][0]} output elements"
            )
        send = [wi.array[a:b] for a, b in in_bounds]
        recv = [wo.array[a:b] for a, b in out_bounds]
        meta = self._meta("all_to_all", name)
        return self._providers.submit(
            Operation("all_to_all", meta, send, recv, (wo,), output, timeout, _memory((wi, wo)))
        )

    def _splits(
        self, what: str, tensor: Any, w: Working, sizes: Sequence[int] | None
    ) -> list[tuple[int, int]]:
        shape = w.shape
        rows = shape[0] if shape else 1
        per_row = w.numel // rows if rows else 0
        if sizes is None or len(sizes) == 0:
            if rows % self.size:
                raise ValueError(
                    f"all_to_all_single: {what} has {rows} rows (dim 0), not divisible by the group size "
                    f"{self.size}; pass {what}_split_sizes"
                )
            split = [rows // self.size] * self.size
        else:
            split = [int(s) for s in sizes]
            if len(split) != self.size:
                raise ValueError(
                    f"all_to_all_single: {what}_split_sizes has {len(split)} entries; "
                    f"the group has {self.size}"
                )
            if any(s < 0 for s in split) or sum(split) != rows:
                raise ValueError(
                    f"all_to_all_single: {what}_split_sizes {split} must be non-negative and add up to the "
                    f"{rows} rows (dim 0) of {what}"
                )
        bounds, pos = [], 0
        for s in split:
            bounds.append((pos * per_row, (pos + s) * per_row))
            pos += s
        return bounds

    def barrier(self, *, timeout: Any = _DEFAULT) -> Work:
        """Wait until every rank of the group reached the barrier.

        Args:
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives None.
        """
        return self._providers.submit(Operation("barrier", self._meta("barrier"), (), (), (), None, timeout))

    # -- object operations -----------------------------------------------------------------
    # Objects are pickled here (one that cannot be fails at call time); the group's object row
    # (client/data/_objects.py) sends them and unpickles what arrives.
    def broadcast_object(self, obj: Any = None, src: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Send a picklable object from group rank ``src`` to every rank.

        Objects are unpickled only from authenticated peers (see the token).

        Args:
            obj: the object on ``src``; ignored elsewhere.
            src: the group rank that sends.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives the object, on every rank.
        """
        root = _check_rank("src", src, self.size)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if root == self.rank else b""
        o = Operation(
            "broadcast_object", {"kind": "broadcast_object", "root": root}, (data,), (), (), obj, timeout
        )
        o.root = root
        return self._providers.submit(o)

    def all_gather_object(self, obj: Any, *, timeout: Any = _DEFAULT) -> Work:
        """Gather a picklable object from every rank.

        Args:
            obj: this rank's object.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives the list of every rank's object, in group-rank order.

        Example:
            ```python
            hosts = await pg.all_gather_object(socket.gethostname())
            ```
        """
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        meta = {"kind": "all_gather_object"}
        return self._providers.submit(Operation("all_gather_object", meta, (data,), (), (), None, timeout))

    def gather_object(self, obj: Any, dst: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Gather picklable objects at group rank ``dst``.

        Args:
            obj: this rank's object.
            dst: the group rank that gathers.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives the list of every rank's object on ``dst``, None elsewhere.
        """
        root = _check_rank("dst", dst, self.size)
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        o = Operation(
            "gather_object", {"kind": "gather_object", "root": root}, (data,), (), (), None, timeout
        )
        o.root = root
        return self._providers.submit(o)

    def scatter_object(self, objs: Any = None, src: int = 0, *, timeout: Any = _DEFAULT) -> Work:
        """Give group rank ``i`` the object ``objs[i]`` of rank ``src``.

        Args:
            objs: on ``src``, one picklable object per rank; ignored elsewhere.
            src: the group rank that scatters.
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            A Work, at once; awaiting it gives this rank's object.

        Raises:
            ValueError: ``objs`` missing on ``src`` or of the wrong length.
        """
        root = _check_rank("src", src, self.size)
        me = self.rank
        blobs: list[bytes] = []
        if me == root:
            if not isinstance(objs, (list, tuple)) or len(objs) != self.size:
                raise ValueError(
                    f"scatter_object: rank {root} is src and must pass a list of {self.size} objects"
                )
            blobs = [pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL) for o in objs]
        o = Operation(
            "scatter_object", {"kind": "scatter_object", "root": root}, blobs, (), (), None, timeout
        )
        o.root = root
        return self._providers.submit(o)

    # -- groups ----------------------------------------------------------------------------
    async def new_group(
        self, ranks: Sequence[int] | None = None, *, timeout: Any = _DEFAULT
    ) -> ProcessGroup | None:
        """Make a sub-group of the given group ranks; every rank of this group must call it.

        Args:
            ranks: the members, as ranks of this group (None: all of them).
            timeout: seconds this operation may take (None: no limit); by default the group's,
                from ``init_process_group(timeout=...)``.

        Returns:
            The new group on its members, None on the others.

        Raises:
            ValueError: ranks repeated or out of range.
            TypeError: ranks that are not ints.
            MismatchError: ranks called it with different rank lists.

        Example:
            ```python
            evens = await pg.new_group(range(0, pg.size, 2))
            if evens is not None:
                await evens.all_reduce(x)
            ```
        """
        if ranks is None:
            chosen = list(range(self.size))
        else:
            if not isinstance(ranks, (list, tuple, range)):
                raise TypeError(f"new_group: ranks must be a list of group ranks, got {type(ranks).__name__}")
            chosen = sorted(_check_rank("new_group: rank", r, self.size) for r in ranks)
            if len(set(chosen)) != len(chosen):
                raise ValueError(f"new_group: ranks {list(ranks)} repeat a rank")
            if not chosen:
                raise ValueError("new_group: ranks is empty")
        members = [self.ranks[r] for r in chosen]
        meta = {"kind": "new_group", "ranks": chosen}
        # Every rank offers what its providers could give the new group; the group's formation
        # ANDs the offers in place (an all_reduce is a barrier too): what every member can use.
        forming = self._providers.forming(members)
        offers = (forming.offers,)
        try:
            forming_op = Operation("new_group", meta, offers, offers, (), None, timeout)
            forming_op.op = ReduceOp.BAND
            gid = await self._providers.submit(forming_op)
            if self._rt.transport.rank not in members:
                return None
            state = self._rt.engine.group(gid, members)
            providers = forming.formed(self._rt.engine, state)
        finally:
            forming.release()
        return ProcessGroup(self._rt, state, providers=providers)

    async def _survivors_group(self, ranks: Sequence[int], gid: str, timeout: float) -> ProcessGroup:
        """A sub-group made by its members alone, over this group's links already connected.

        For when other ranks of this group are gone and cannot take part in ``new_group``: a
        fault-tolerant job's survivors (aiocoll/ft.py) go on without connecting anew. Only the
        members call it, each with the same ``ranks`` (ranks of this group) and ``gid``, an id
        no other group of this runtime has. They agree on their shared-memory region over the
        new group itself, which is also the formation's barrier: when a member does not take
        part (lost, or it formed another group), no member gets the group (the error of that
        agreement, within ``timeout`` seconds).
        """
        members = [self.ranks[r] for r in sorted(ranks)]
        engine = self._rt.engine
        forming = self._providers.forming(members)
        state = engine.group(gid, members)
        group = ProcessGroup(self._rt, state, providers=forming.bare(engine, state))
        try:
            await group.all_reduce(forming.offers, ReduceOp.BAND, timeout=timeout)
            group._providers.close()
            group._providers = self._rt.table(state, forming.formed(engine, state))
        except BaseException:
            await group.destroy()
            raise
        finally:
            forming.release()
        return group

    async def destroy(self) -> None:
        """Leave the group; for the group init_process_group returned, close its links and sessions.

        Pending operations fail; calling it twice is fine. ``async with`` on the group calls it.
        """
        if self._destroyed:
            return
        self._destroyed = True
        self._providers.destroyed()  # later calls raise at once
        if self._owner:
            await self._rt.aclose()
        else:
            self._rt.engine.forget_group(self.group_id)
            table = self._rt.tables.pop(self.group_id, None)
            if table is not None:
                table.close()

    async def __aenter__(self) -> ProcessGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.destroy()


# --------------------------------------------------------------------------------------------
# init_process_group


async def init_process_group(
    init_method: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    timeout: float | datetime.timedelta | None = 1800.0,
    token: str | None = None,
    job: str | None = None,
    store: Store | None = None,
) -> ProcessGroup:
    """Join a job and return its world group.

    Args:
        init_method: ``"env://"`` (the default: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, as set
            by ``aiocoll run`` or torchrun), ``"tcp://HOST:PORT"`` or ``"file:///PATH"``. With
            env:// and tcp://, rank 0 starts a coordinator inside its own process when none answers
            at the address (never in place of the one AIOCOLL_COORDINATOR names).
        rank: this process's rank (default: RANK); may be left to the coordinator.
        world_size: the number of ranks (default: WORLD_SIZE).
        timeout: seconds (or a timedelta) for the rendezvous, and every operation's default.
        token: the shared secret (default: env AIOCOLL_TOKEN). Without one, a warning from rank 0
            says that anyone who can reach the ports can join.
        job: the job id, one coordinator's key space (default: env AIOCOLL_JOB, else "default").
        store: rendezvous through this aiocoll Store instead (``rank`` and ``world_size``
            required).

    Returns:
        The world ProcessGroup; use it as an async context manager to destroy it at the end.

    Raises:
        ValueError: missing or inconsistent rank, world size or address.
        RendezvousError: the job could not form within ``timeout``.
        AuthenticationError: the coordinator or a peer refused our token.

    Example:
        ```python
        async with await aiocoll.init_process_group() as pg:
            print(pg.rank, pg.size)
        ```
    """
    runtime = await start_runtime(
        init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        token=token,
        job=job,
        store=store,
        embed=_embedded_coordinator,
    )
    return ProcessGroup(runtime, runtime.world, owner=True)


def _embedded_coordinator(host: str, port: int, token: str | None) -> EmbeddedCoordinator:
    """The coordinator rank 0 starts inside itself when none answers at its address."""
    from aiocoll.server import Coordinator

    return Coordinator(host, port, token=token)
