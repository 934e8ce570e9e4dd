"""The arena as a provider: which region of the members' arenas a group takes (each rank's offer,
ANDed over the parent group when the group forms), the engine starter of every kind the arenas
serve, and the straight path of an all_reduce.

Imports foundations (aiocoll._signature, aiocoll._types, aiocoll._work, the working arrays of
aiocoll.device._tensors), client.data._shm_coll and client.data._shm_waker (the collectives
over the arenas and the process's wake-ups), client.data._operation and the engine, and the shm link kind
(the process's arena host); never the public surface. client/data/providers.py and
client/data/routing.py use it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

import aiocoll._signature as _signature
from aiocoll._work import Work
from aiocoll.device._tensors import Working

from ._op_record import Stoppable, checked_timeout
from ._operation import HOST, Finish, Operation, Starter, all_reduce_operation, finish_with_copy_back
from ._shm_coll import ShmGroup
from ._shm_waker import ShmWaker
from .engine import Engine, GroupState, OpTransport
from .transports._link import LinkTransport
from .transports._shm_kind import shm_host

__all__ = [
    "ALL_REGIONS",
    "ArenaForming",
    "ArenaProvider",
    "intra_host_group",
    "region_offer",
    "release_offer",
    "world_group",
]

_SERVED = frozenset({"all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier"})


ALL_REGIONS = (1 << 64) - 1  # what a rank that is not a member offers (see region_offer)


def region_offer(transport: LinkTransport, members: Sequence[int]) -> int:
    """What this rank offers when a group of ``members`` (global ranks) forms: the regions of
    its arena free for it (a bit mask), 0 when the group cannot use shared memory from here
    (a member without an shm link to us), all ones when we are not a member. The AND over the
    parent group's ranks (ReduceOp.BAND) is the set every member can use; its lowest bit is
    the group's region (``intra_host_group``). The regions offered are held back from other
    groups until ``release_offer``."""
    me = transport.rank
    if me not in members:
        return ALL_REGIONS
    host = shm_host(transport)
    kinds = transport.link_kinds()
    if host is None or len(members) < 2 or any(kinds.get(r) != "shm" for r in members if r != me):
        return 0
    offered = host.free_regions()
    host.regions_offered |= offered  # until release_offer: no second group forming gets them
    return offered


def release_offer(transport: LinkTransport, members: Sequence[int], offered: int) -> None:
    """The group of ``members`` that ``offered`` (our ``region_offer``) was for has agreed (and
    taken its region with ``intra_host_group``) or failed: the rest is free for other groups.
    A rank that is not a member held nothing back (its offer of all ones says "no objection",
    and a member's offer of every region looks the same)."""
    host = shm_host(transport)
    if host is not None and transport.rank in members:
        host.regions_offered &= ~offered


def intra_host_group(
    transport: LinkTransport, members: Sequence[int], offers: int, gid: str
) -> ShmGroup | None:
    """The shared-memory side of a new group of ``members`` (global ranks, in group order), in
    the lowest region of ``offers`` (the AND of every rank's ``region_offer``); None when there
    is none or we are not a member."""
    host = shm_host(transport)
    me = transport.rank
    if host is None or offers == 0 or me not in members:  # all ones from members: every region free
        return None
    region = (offers & -offers).bit_length() - 1
    if host.waker is None:
        host.waker = ShmWaker(host)
    group = ShmGroup(
        host,
        host.waker,
        region,
        members,
        list(members).index(me),
        chunk=host.chunk,
        ranks_on_host=len(host.peers) + 1,
        gid=gid,
    )
    transport.on_peer_lost(group.peer_lost_handler)
    return group


def world_group(transport: LinkTransport, gid: str) -> ShmGroup | None:
    """The world group's shared-memory collectives (region 0, free on every rank at start),
    when every other rank has an shm link (every member on this host, the memory confirmed
    shared); else None."""
    n = transport.world_size
    kinds = transport.link_kinds()
    if n < 2 or len(kinds) != n - 1 or any(k != "shm" for k in kinds.values()):
        return None
    return intra_host_group(transport, range(n), 1, gid)


class ArenaProvider:
    """The arena collectives as a provider (client/data/providers.py): the kinds ``ShmGroup`` serves,
    over a group whose members all share this host, in the region they agreed on."""

    name: ClassVar[str] = "arena"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 30
    kinds: frozenset[str] = frozenset(_SERVED)

    def __init__(self, group: ShmGroup) -> None:
        self.group = group
        self.why = f"every member on this host, linked by shared memory (region {group.region})"
        self._reduce: Starter = self._all_reduce  # (bound once: see ``prepare``)
        self._start: Starter = self._start_other

    @classmethod
    def for_world(cls, links: LinkTransport, gid: str) -> ArenaProvider | None:
        group = world_group(links, gid)
        return None if group is None else cls(group)

    def usable(self, links: LinkTransport) -> bool:
        """No other member is linked to us by anything but shared memory now. A member whose link
        is gone leaves the arena as it is: the arena fails the group's operations with that
        member's loss itself (ShmGroup.peer_lost), and the group is then over."""
        kinds = links.link_kinds()
        me = links.rank
        return all(kinds.get(r, "shm") == "shm" for r in self.group.ranks if r != me)

    def prepare(self, op: Operation) -> Starter | None:
        """The operation's starter (see client/data/_operation.Provider), or None for one the arenas
        do not take (an out-of-place all_reduce). The starters are this provider's methods, bound
        once: the record a starter is handed as its transport is the operation, so none is made
        per operation."""
        if op.kind == "all_reduce":  # (in place: the public layer hands one tuple as both)
            return self._reduce if op.inputs is op.outputs or op.inputs[0] is op.outputs[0] else None
        return self._start

    def _all_reduce(self, tag: Any, op: OpTransport, finish: Finish) -> Stoppable:  # (tag[2]: the seq)
        # (op.waiting_for: progress reports and timeouts name whom we wait for)
        return self._reduce_step(
            op.outputs[0], op.op, op.meta, tag[2], finish_with_copy_back(op, finish), op.waiting_for
        )

    def _reduce_step(
        self, x: Any, reduce_op: Any, meta: dict[str, Any], seq: int, finish: Finish, on_wait: Any
    ) -> Stoppable:
        """Begin the all_reduce of ``x`` (seq ``seq``, signature ``meta``) on the arena."""
        return self.group.all_reduce(
            x,
            reduce_op,
            meta.get("dtype") or x.dtype.name,  # (bfloat16 travels as uint16 bits)
            _signature.pack(seq, meta),
            finish,
            on_wait,
        )

    def all_reduce(
        self,
        engine: Engine,
        state: GroupState,
        w: Working,
        reduce_op: Any,
        meta: dict[str, Any],
        tensor: Any,
        timeout: Any,
    ) -> Work:
        """An all_reduce of ``w`` in place (ProviderTable.all_reduce). Its straight path: begun
        on the arena before any record is made; one that ends inside the call is only an entry
        in the recorder's history and a Work born complete (Engine.ended_at_once), one that does
        not gets its record then and goes on through the engine from where it is
        (Engine.went_on; ``_Late`` hands the record what the arena said meanwhile). The call
        site is read here (Engine.site: this method is as deep as Engine.submit_op)."""
        timeout = checked_timeout(timeout)  # (refused before anything runs)
        site = engine.site()
        x = w.array
        if w.staged or not engine.straight_open(state):
            op = all_reduce_operation(meta, x, w, reduce_op, tensor, timeout, HOST)
            return engine.submit_op(state, op, self._reduce, False, site)
        seq = engine.next_seq(state)
        started = _monotonic()
        late = _Late()
        failure: BaseException | None = None
        lane: Stoppable | None = None
        try:
            lane = self._reduce_step(x, reduce_op, meta, seq, late.finish, late.waiting_for)
        except BaseException as exc:
            failure = exc
        else:
            if late.ended:
                if late.exc is None:
                    return engine.ended_at_once("all_reduce", state, seq, meta or None, started, site, tensor)
                failure = late.exc
        op = all_reduce_operation(meta, x, w, reduce_op, tensor, timeout, HOST)
        work = engine.went_on(state, op, seq, started, site, False, lane, failure)
        late.bind(op)
        if failure is not None and not isinstance(failure, Exception):
            raise failure
        return work

    def _start_other(self, tag: Any, op: OpTransport, finish: Finish) -> Stoppable:
        group = self.group
        kind = op.kind
        meta = op.meta
        sig = _signature.pack(tag[2], meta)
        fin = finish_with_copy_back(op, finish)
        on_wait = op.waiting_for
        recv = op.outputs
        if kind == "broadcast":
            return group.broadcast(recv[0], op.root, sig, fin, on_wait)
        if kind == "all_gather":
            return group.all_gather(recv, op.inputs[0], sig, fin, on_wait)
        if kind == "reduce_scatter":
            name = meta.get("dtype") or recv[0].dtype.name
            return group.reduce_scatter(recv[0], op.inputs, op.op, name, sig, fin, on_wait)
        return group.barrier(sig, fin, on_wait)

    def close(self) -> None:
        self.group.close()


class _Late:
    """What the arena says of an all_reduce begun before its record was made
    (ArenaProvider.all_reduce): its end, kept until the record is bound (``bind``) and handed to
    it after; whom it waits for, likewise."""

    __slots__ = ("ended", "exc", "op", "waits")

    def __init__(self) -> None:
        self.ended = False
        self.exc: BaseException | None = None
        self.op: Operation | None = None
        self.waits: list[int] | None = None

    def finish(self, _: Any, exc: BaseException | None) -> None:
        op = self.op
        if op is None:
            self.ended = True
            self.exc = exc
        else:
            op.finish_copied(None, exc)

    def waiting_for(self, ranks: Iterable[int]) -> None:
        op = self.op
        if op is None:
            self.waits = list(ranks)
        else:
            op.waiting_for(ranks)

    def bind(self, op: Operation) -> None:
        """From now on the record ``op`` hears what the arena says."""
        self.op = op
        if self.waits is not None and not self.ended:
            op.waiting_for(self.waits)


_monotonic = time.monotonic


class ArenaForming:
    """A sub-group forming: the arena regions this rank offers it (``offered``, ANDed over the
    parent group's ranks by the formation's all_reduce), the group's arena once agreed
    (``formed``), and the offer's end (``release``, whatever happened)."""

    def __init__(self, links: LinkTransport, members: Sequence[int]) -> None:
        self._links = links
        self._members = members
        self.offered = region_offer(links, members)

    def formed(self, agreed: int, gid: str) -> ArenaProvider | None:
        group = intra_host_group(self._links, self._members, agreed, gid)
        return None if group is None else ArenaProvider(group)

    def release(self) -> None:
        release_offer(self._links, self._members, self.offered)
