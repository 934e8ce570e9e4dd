"""How a group's operations run: the providers (the rows of a group's table), the one selection
function, the table.

Imports foundations (aiocoll.algorithms, aiocoll._work, the device staging and working arrays of
aiocoll.device) and the client's engine, operation record, arenas (client/data/_shm_arena.py,
client/data/_shm_coll.py), routes (client/data/routing.py), object row (client/data/_objects.py) and
the links' transport (client/data/transports/_link.py); never the public surface. The public layer
checks a call's arguments, builds its record (client/data/_operation.Operation) and submits it to
the group's ``ProviderTable``, which hands it to the first row that takes it; a send or receive of
host memory, and an all_reduce of host memory, it hands to the table's ``send``, ``recv`` or
``all_reduce`` with the call's fields, and the p2p or arena row makes the record only for one that
does not end inside the call. Nothing else decides how an operation runs: collective, point-to-
point, object or group formation, host or device memory.

Every row declares, once, what it takes: its kinds, its memory (host or device) and its
priority. ``select_providers`` queries the rows available to the group when the group is made
(as Open MPI's coll framework queries its components per communicator), logs at DEBUG why it
chose what it chose, and fills the table: for every memory and kind, the rows that serve it,
highest priority first. The table is chosen again only when the process's links change (a link
added or lost). Per call, a row may still decline one operation (the arena runs only in-place
all_reduces; IPC only the kinds and reduce ops it can); the table then asks the next. The rows:

  - ``arena`` (host, 30): every member on this host, linked by shared memory: the members'
    arenas (client/data/_shm_coll.py), in a region the members agree on when the group forms.
  - ``routed`` (host, 20): a group spanning hosts with several members on one: all_reduce by
    host, then among host leaders, then back (client/data/routing.py), its intra-host parts on arenas.
  - ``driver`` (host, 0): every collective, any group: the algorithms over the links, run by the
    message driver (aiocoll/algorithms/_driver.py) from message callbacks, without a task.
  - ``p2p`` (host, 0): send and recv over the links.
  - ``objects`` (host, 0): object operations and group formation (client/data/_objects.py).
  - ``ipc`` (device, 20): device to device between the ranks of one host by CUDA IPC
    (aiocoll/device/_ipc.py), for the all_reduces and broadcasts it can take.
  - ``staged`` (device, 10): every collective and send/recv, chunk by chunk through pinned host
    staging (aiocoll/device/_staged_ops.py).

The rows that run in steps (ipc, staged, objects) run each step as a host operation by the
group's route (``ProviderTable._run_part``) inside their one operation.

A new provider (UCX, a GPU-direct link) is a class with ``name``, ``memory``, ``priority``,
``kinds``, ``why``, ``prepare`` and ``close`` (client/data/_operation.Provider), plus a line in
``ProviderTable.__init__``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from aiocoll._errors import DistError, MismatchError
from aiocoll._work import Work
from aiocoll.algorithms import CollectiveSpec, Tag, Transport
from aiocoll.algorithms._driver import start_collective
from aiocoll.algorithms._plan import prepare
from aiocoll.device._ipc import IPC_KINDS, IPC_OPS, ipc_groups
from aiocoll.device._staged_ops import RunPart, StagedOp, p2p_chunk_tag
from aiocoll.device._tensors import Working

from ._objects import ObjectProvider
from ._op_record import checked_timeout
from ._operation import (
    COLLECTIVE_KINDS,
    DEVICE,
    HANDED_OFF,
    HOST,
    P2P_KINDS,
    Body,
    Finish,
    Operation,
    Provider,
    Starter,
    all_reduce_operation,
    as_starter,
    awaiting,
    copying_back,
    finish_with_copy_back,
    p2p_operation,
    spec_of,
)
from ._shm_arena import ArenaForming, ArenaProvider
from ._shm_coll import ShmGroup
from .engine import Engine, GroupState, OpTransport, Stoppable
from .routing import HostLayout, RoutedProvider, host_layout, run_routed
from .transports._link import LinkTransport

__all__ = [
    "Provider",
    "ProviderTable",
    "select_providers",
]

log = logging.getLogger("aiocoll.providers")

# The arena's kinds that complete on a member only once it read every member's part: it sends
# nothing over the links under the operation's tag, and once one completed, every member ran it
# on the arena, so no message under its tag can come (the engine need not watch for one). Not a
# broadcast: its root may finish before the others, one of which may have called something else.
_ARENA_SEALED = frozenset({"all_reduce", "all_gather", "reduce_scatter", "barrier"})


_monotonic = time.monotonic


class DriverProvider:
    """Every collective over the links, by the message driver (no task per operation)."""

    name: ClassVar[str] = "driver"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 0
    kinds: frozenset[str] = COLLECTIVE_KINDS
    why = "serves every collective over the links"

    def __init__(self, ranks: tuple[int, ...], me: int) -> None:
        self._ranks = ranks
        self._me = me

    def prepare(self, op: Operation) -> Starter:
        spec = spec_of(op, self._ranks, self._me)
        meta = op.meta

        def start(tag: Tag, transport: OpTransport, finish: Finish) -> Stoppable:
            done = finish_with_copy_back(op, finish)
            return start_collective(
                prepare(spec, meta), spec, transport, tag, meta, lambda exc: done(None, exc)
            )

        return start

    def close(self) -> None:
        pass


class P2PProvider:
    """Point-to-point over the links: a send is handed to the link; a receive checks that the
    message is of the receiving tensor's dtype and completes with the sender's group rank.

    Both take the straight path when they can (``send`` and ``recv``, which the table calls
    for host memory: no record, a Work born complete): a send whose payload the link took at
    once, a receive whose message is here or arrives within the transport's short in-place
    wait (Transport.recv_now). The rest get their record and run as a task that awaits the
    link. A receive takes the straight path only while no receive of its
    tag waits as a task: the task posts its receive when it first runs, and a later receive
    taking the message first would break the order in which receives of one tag match."""

    name: ClassVar[str] = "p2p"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 0
    kinds: frozenset[str] = P2P_KINDS
    why = "send and recv over the links"

    def __init__(self, ranks: tuple[int, ...], gid: str, engine: Engine, state: GroupState) -> None:
        self._ranks = ranks
        self._gid = gid
        self._engine = engine
        self._state = state
        self._waiting: dict[Tag, int] = {}  # receives running as tasks, by tag
        self._send: Starter = self._send_starter  # (bound once: see ``prepare``)
        self._recv: Starter = self._recv_starter

    def prepare(self, op: Operation) -> Starter:
        # (methods bound once: the record a starter is handed as its transport is the
        # operation, which holds what it runs on, so no starter is made per operation)
        return self._send if op.kind == "send" else self._recv

    # The straight path (ProviderTable.send and .recv, for host memory): the operation runs on
    # the transport before any record is made, and one that ends inside the call is only an
    # entry in the recorder's history and a Work born complete (Engine.ended_at_once). One
    # that does not gets its record and goes on through the engine from where it is, with the
    # call site read here (Engine.site: this method is as deep as Engine.submit_op).
    def send(self, peer: int, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """Send ``w``'s array to global rank ``peer`` with the user's ``tag``."""
        engine, group = self._engine, self._state
        timeout = checked_timeout(timeout)  # (refused before anything runs)
        array = w.array
        if not engine.straight_open(group):
            op = p2p_operation("send", meta, array, w, HOST, peer, tag, timeout)
            return engine.submit_op(group, op, self._send, True, engine.site())
        started = _monotonic()
        start: Starter | None = None
        try:
            rest = group.transport.send_nowait(peer, ("p", self._gid, tag), array.data, meta)
        except Exception as exc:  # (a link lost on the way: the Work says so, as for any send)
            start = _raising(exc)
        else:
            if rest is not None:
                start = _handing_off(peer, rest)
        # (the site is read once the message is on its way: a receiver waiting for it need not
        # wait for that too)
        site = engine.site()
        if start is None:
            return engine.ended_at_once("send", group, -1, None, started, site, None)
        op = p2p_operation("send", meta, array, w, HOST, peer, tag, timeout)
        return engine.submit_op(group, op, start, True, site, begun=True)

    def recv(self, peer: int | None, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """Receive into ``w``'s array from global rank ``peer`` (None: any) with ``tag``."""
        engine, group = self._engine, self._state
        timeout = checked_timeout(timeout)  # (refused before anything runs)
        site = engine.site()
        array = w.array
        key = ("p", self._gid, tag)
        if peer is None or w.staged or key in self._waiting or not engine.straight_open(group):
            op = p2p_operation("recv", meta, array, w, HOST, peer, tag, timeout)
            return engine.submit_op(group, op, self._recv, True, site)
        started = _monotonic()
        into = array.data.cast("B")
        here: tuple[int, dict[str, Any]] | None = None
        start: Starter
        try:
            here = group.transport.recv_now(peer, key, into)
            if here is not None and not here[1].get("chunks"):
                got = received(meta, tag, here[0], here[1], self._ranks, self._gid)
                return engine.ended_at_once("recv", group, -1, None, started, site, got)
            start = _landing(self, peer, into, here, None)
        except MismatchError as exc:  # (consumed: a wrong size, or a wrong dtype _landed says again)
            start = _landing(self, peer, into, here, exc if here is None else None)
        except Exception as exc:  # (a link lost on the way: the Work says so, as for any receive)
            start = _raising(exc)
        op = p2p_operation("recv", meta, array, w, HOST, peer, tag, timeout)
        return engine.submit_op(group, op, start, True, site, begun=True)

    def _send_starter(self, tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        # A send completes once handed off: a small one usually is, inside this call (its Work
        # is born complete); the rest of a larger one runs as a task. (A working array is 1-D
        # and contiguous: its buffer is handed over as it is, and the links send its bytes
        # whatever its format.)
        peer = op.peers[0]
        rest = op.group.transport.send_nowait(peer, tag, op.inputs[0].data, op.meta)
        if rest is None:
            finish(None, None)
            return HANDED_OFF
        return _handing_off(peer, rest)(tag, op, finish)

    def _recv_starter(self, tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        peers = op.peers
        source = peers[0] if peers else None
        into = op.outputs[0].data.cast("B")
        if tag in self._waiting:  # an earlier receive of this tag is not posted yet: after it
            return self._as_task(op, source, into, tag, op, finish)
        try:
            here = op.recv_now(source, tag, into)
        except MismatchError as exc:
            return self._landed(op, source, into, tag, finish, None, exc)
        return self._landed(op, source, into, tag, finish, here, None)

    def _landed(
        self,
        op: Operation,
        source: int | None,
        into: memoryview,
        tag: Tag,
        finish: Finish,
        here: tuple[int, dict[str, Any]] | None,
        failed: MismatchError | None,
    ) -> Stoppable:
        """A receive's start once the transport's straight receive (``recv_now``) answered:
        ``here`` (the sender and the message's meta; None: nothing came, the receive runs as a
        task), or ``failed`` (the message was consumed and did not fit)."""
        if failed is not None:
            if not failed.ranks:
                raise failed
            remote = getattr(failed, "remote_meta", None) or {}
            return copying_back(op, _refusal(remote, failed.ranks[0], op, self._ranks, self._gid, failed))(
                tag, op, finish
            )
        if here is None:
            return self._as_task(op, source, into, tag, op, finish)
        got, sent = here
        if sent.get("chunks"):  # a device tensor's staged message: see _refuse_staged_into_host
            return copying_back(op, _refusal(sent, got, op, self._ranks, self._gid, None))(tag, op, finish)
        op.result = received(op.meta, op.p2p_tag, got, sent, self._ranks, self._gid)
        op.finish_copied(None, None, None if finish == op.finish else finish)
        return HANDED_OFF

    def _as_task(
        self,
        op: Operation,
        source: int | None,
        into: memoryview,
        tag: Tag,
        transport: OpTransport,
        finish: Finish,
    ) -> Stoppable:
        """Run the receive ``op`` as a task that awaits the link (counted in ``_waiting`` until it
        finishes)."""
        ranks, gid, tasks = self._ranks, self._gid, self._waiting

        async def wait(tag: Tag, transport: OpTransport) -> None:
            try:
                got, sent = await transport.recv(source, tag, into)
            except MismatchError as exc:
                if exc.ranks:
                    await _refuse_staged_into_host(
                        getattr(exc, "remote_meta", None) or {},
                        exc.ranks[0],
                        op,
                        tag,
                        transport,
                        ranks,
                        gid,
                        exc,
                    )
                raise
            # a host tensor the size of a device tensor's first chunk: the rest is still coming
            await _refuse_staged_into_host(sent, got, op, tag, transport, ranks, gid, None)
            op.result = received(op.meta, op.p2p_tag, got, sent, ranks, gid)

        tasks[tag] = tasks.get(tag, 0) + 1

        def done(result: Any, exc: BaseException | None) -> None:
            left = tasks.pop(tag) - 1
            if left:
                tasks[tag] = left
            finish(result, exc)

        return copying_back(op, wait)(tag, transport, done)  # (as_starter finishes a task once)

    def close(self) -> None:
        pass


def _handing_off(peer: int, rest: Awaitable[None]) -> Starter:
    """The starter of a send the transport took in part at once: it runs as a task that awaits
    the rest of the hand-off, counted as the operation's wait for ``peer``."""

    def start(tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        return as_starter(awaiting(op.sending(peer, rest)))(tag, op, finish)

    return start


def _raising(exc: Exception) -> Starter:
    """The starter of an operation whose straight path failed in the transport: it fails with
    ``exc`` as a starter that raised does (Engine.submit_op)."""

    def start(tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        raise exc

    return start


def _landing(
    row: P2PProvider,
    peer: int,
    into: memoryview,
    here: tuple[int, dict[str, Any]] | None,
    failed: MismatchError | None,
) -> Starter:
    """The starter of a receive whose straight path did not end it (P2PProvider.recv): it goes
    on from what the transport answered (P2PProvider._landed)."""

    def start(tag: Tag, op: OpTransport, finish: Finish) -> Stoppable:
        return row._landed(op, peer, into, tag, finish, here, failed)

    return start


async def _refuse_staged_into_host(
    sent: dict[str, Any],
    src: int,
    op: Operation,
    tag: Tag,
    transport: Transport,
    ranks: tuple[int, ...],
    gid: str,
    exc: MismatchError | None,
) -> None:
    """A receive into a host tensor met the first chunk of a device tensor's message of several
    chunks (its meta ``sent`` says so, from rank ``src``; ``exc``: the length mismatch, when the
    chunk did not fit): take the other chunks off the wire, so that they do not stay behind for a
    later receive on the tag, and raise an error that says what to do. Returns when the message
    was something else."""
    chunks, chunk_bytes, nbytes = (int(sent.get(k, 0) or 0) for k in ("chunks", "chunk_bytes", "nbytes"))
    if chunks < 2:
        return
    with contextlib.suppress(DistError):  # a sender lost meanwhile: the refusal is still the news
        for k in range(1, chunks):
            size = max(0, min(chunk_bytes, nbytes - k * chunk_bytes))
            await transport.recv(src, p2p_chunk_tag(tag, k), memoryview(bytearray(size)))
    sender = ranks.index(src) if src in ranks else src
    raise MismatchError(
        f"recv (group {gid!r}, tag {op.p2p_tag}): rank {sender} sent a device tensor of {nbytes} bytes, "
        f"staged in {chunks} chunks of {chunk_bytes} bytes, but this rank receives into a host tensor "
        f"of {op.outputs[0].nbytes} bytes: a host tensor receives a device tensor's message only when it "
        f"fits in one staging chunk (AIOCOLL_STAGING_CHUNK_BYTES). Receive into a device tensor, or "
        f"send a host copy (tensor.cpu())",
        group=gid,
        ranks=[src],
    ) from exc


def _refusal(
    sent: dict[str, Any],
    src: int,
    op: Operation,
    ranks: tuple[int, ...],
    gid: str,
    exc: MismatchError | None,
) -> Body:
    """A receive taken on the straight path that met a device tensor's staged message (or a
    length mismatch ``exc``): the refusal, which takes the rest off the wire, runs as a task
    (``copying_back``: a message of one chunk after all is received as usual)."""

    async def refuse(tag: Tag, transport: OpTransport) -> None:
        await _refuse_staged_into_host(sent, src, op, tag, transport, ranks, gid, exc)
        if exc is not None:
            raise exc
        op.result = received(op.meta, op.p2p_tag, src, sent, ranks, gid)  # (one chunk: nothing to refuse)

    return refuse


def received(
    meta: dict[str, Any], p2p_tag: Any, got: int, sent: dict[str, Any], ranks: tuple[int, ...], gid: str
) -> int:
    """The group rank of a receive's sender (global rank ``got``), once its message (meta
    ``sent``) is checked against the receiving tensor (the receive's ``meta``, its tag
    ``p2p_tag``).

    Raises:
        MismatchError: the message's dtype is not the receiving tensor's.
    """
    if sent.get("dtype") != meta.get("dtype"):
        sender = ranks.index(got) if got in ranks else got
        raise MismatchError(
            f"recv (group {gid!r}, tag {p2p_tag}): rank {sender} sent {sent.get('dtype')} "
            f"but the receiving tensor is {meta.get('dtype')}",
            group=gid,
            ranks=[got],
        )
    return ranks.index(got)


class StagedProvider:
    """Device tensors, every collective and send/recv, chunk by chunk through pinned staging;
    each chunk of a collective runs as a host operation by the group's route (``run``)."""

    name: ClassVar[str] = "staged"
    memory: ClassVar[frozenset[str]] = frozenset({DEVICE})
    priority: ClassVar[int] = 10
    kinds: frozenset[str] = COLLECTIVE_KINDS | P2P_KINDS
    why = "device tensors, chunk by chunk through pinned host buffers"
    _ipc = False  # whether its operations may go device to device (IpcProvider)

    def __init__(
        self,
        ranks: tuple[int, ...],
        me: int,
        rank: int,
        group_key: tuple[Any, ...],
        gid: str,
        run: RunPart,
    ) -> None:
        self._run = run
        self._ranks = ranks
        self._me = me
        self._rank = rank
        self._key = group_key
        self._gid = gid

    def prepare(self, op: Operation) -> Starter | None:
        kind = op.kind
        if kind in P2P_KINDS:
            return self._p2p(op)
        if self._ipc and (kind not in IPC_KINDS or op.op not in IPC_OPS):
            return None
        key = self._key if self._ipc else None  # (no IPC state: the operation is staged)
        # Made now, at call time: it records the caller's event (what is sent is what the
        # caller computed so far).
        staged = StagedOp(kind, len(self._ranks), op.inputs, op.outputs, rank=self._rank, group_key=key)
        ranks, me, gid, run, meta = self._ranks, self._me, self._gid, self._run, op.meta

        async def body(tag: Tag, transport: OpTransport) -> None:
            what = f"{kind} (group {gid!r}, seq {tag[2]})"
            await staged.collective(
                transport, tag, meta, ranks=ranks, me=me, root=op.root, op=op.op, what=what, run=run
            )

        return copying_back(op, body)

    def _p2p(self, op: Operation) -> Starter:
        """A send or receive of one device tensor, one message per chunk; staged messages on one
        tag and peer go one after another, in call order (StagedOp.chain)."""
        ranks, gid, utag, meta = self._ranks, self._gid, op.p2p_tag, op.meta
        if op.kind == "send":
            staged = StagedOp("send", len(ranks), op.inputs, (), rank=self._rank)
            peer = op.peers[0]
            chain_key: tuple[Any, ...] = ("send", *self._key, utag, peer)
            what = f"send (group {gid!r}, tag {utag}) to rank {ranks.index(peer)}"

            async def send(tag: Tag, transport: OpTransport) -> None:
                await staged.send_to(transport, tag, peer, meta, what)

            return _chained(staged, chain_key, as_starter(send))
        staged = StagedOp("recv", len(ranks), (), op.outputs, rank=self._rank)
        source = op.peers[0] if op.peers else None
        what = f"recv (group {gid!r}, tag {utag})"

        async def recv(tag: Tag, transport: OpTransport) -> None:
            try:
                got, sent = await staged.recv_from(transport, tag, source, what)
            except MismatchError as exc:
                _refuse_host_into_staged(exc, op, staged, ranks, gid)
                raise
            op.result = received(op.meta, op.p2p_tag, got, sent, ranks, gid)

        return _chained(staged, ("recv", *self._key, utag), copying_back(op, recv))

    def close(self) -> None:
        if self._ipc:
            ipc_groups.forget(self._key)


def _refuse_host_into_staged(
    exc: MismatchError, op: Operation, staged: StagedOp, ranks: tuple[int, ...], gid: str
) -> None:
    """A receive into a device tensor of several chunks met one message from a host tensor (its
    meta says no chunks): raise an error that says what to do. Returns (for the caller to raise
    ``exc``) when the message was something else."""
    sent = getattr(exc, "remote_meta", None)
    itemsize = op.outputs[0].itemsize
    if sent is None or "chunks" in sent or op.outputs[0].size <= staged.chunk_elems or not exc.ranks:
        return
    src = exc.ranks[0]
    sender = ranks.index(src) if src in ranks else src
    raise MismatchError(
        f"recv (group {gid!r}, tag {op.p2p_tag}): rank {sender} sent a host tensor's message in one piece, "
        f"but this rank receives into a device tensor of {op.outputs[0].size * itemsize} bytes, staged in "
        f"chunks of {staged.chunk_elems * itemsize} bytes: a device tensor receives a host tensor's "
        f"message only when it fits in one staging chunk (AIOCOLL_STAGING_CHUNK_BYTES). Send from a "
        f"device tensor, or receive into a host tensor and copy it to the device",
        group=gid,
        ranks=[src],
    ) from exc


def _chained(staged: StagedOp, key: tuple[Any, ...], run: Starter) -> Starter:
    """``run``, ordered after the earlier staged messages on ``key`` (taken when it starts, in
    call order; let go when it finishes, however it finishes)."""

    def start(tag: Tag, transport: OpTransport, finish: Finish) -> Stoppable:
        end = staged.chain(key)

        def done(result: Any, exc: BaseException | None) -> None:
            end()
            finish(result, exc)

        return run(tag, transport, done)

    return start


class IpcProvider(StagedProvider):
    """Device tensors of an all_reduce or a broadcast, device to device between the ranks of one
    host (CUDA IPC, aiocoll/device/_ipc.py): the members open each other's mailbox and event once,
    together, at the group's first such operation of several chunks, and agree whether every one
    could; where not (or for one chunk), the operation is staged as StagedProvider's are."""

    name: ClassVar[str] = "ipc"
    priority: ClassVar[int] = 20
    kinds: frozenset[str] = frozenset(IPC_KINDS)
    why = "device tensors of all_reduce and broadcast, device to device where the group can"
    _ipc = True


class ProviderTable:
    """A group's rows, chosen by ``select_providers``; ``submit`` runs an operation.

    Attributes:
        layout: the group's members by host (client/data/routing.HostLayout), None when unknown.
        chosen: memory -> kind -> the names of the rows that serve it, in the order they are asked.
        ran: the name of the row that took the group's latest operation ("-": none yet).
    """

    def __init__(
        self,
        engine: Engine,
        state: GroupState,
        links: LinkTransport,
        hosts: Mapping[int, str],
        arena: ArenaProvider | None,
        group_key: tuple[Any, ...],
    ) -> None:
        self._engine = engine
        self._state = state
        self._links = links
        self._hosts = hosts
        self._arena = arena
        self._key = group_key
        ranks = tuple(state.ranks)
        me, rank, gid = state.index, links.rank, state.gid
        self.layout: HostLayout | None = host_layout(ranks, ranks[me], hosts)
        self._routed = RoutedProvider(links, ranks, me, self.layout, f"{gid}/host")
        # (host point-to-point has this one row: the API reaches it through ``send``/``recv``)
        self._p2p = P2PProvider(ranks, gid, engine, state)
        # the rows other than the arena, which may be dropped (``select``)
        self._rows: tuple[Provider, ...] = (
            self._routed,
            DriverProvider(ranks, me),
            self._p2p,
            ObjectProvider(ranks, me, gid, self._run_part),
            IpcProvider(ranks, me, rank, group_key, gid, self._run_part),
            StagedProvider(ranks, me, rank, group_key, gid, self._run_part),
        )
        self._by: dict[str, dict[str, tuple[tuple[Provider, bool], ...]]] = {}
        self._links_seen = -1
        self._destroyed = False
        self._retired: list[Provider] = []
        self.chosen: dict[str, dict[str, list[str]]] = {}
        self.ran = "-"
        self.select()

    # -- selection ---------------------------------------------------------------------------
    def select(self) -> None:
        """Choose the rows for every memory and kind (once per group, and again when links change)."""
        self._links_seen = self._links.links_version
        if self._arena is not None and not self._arena.usable(self._links):
            log.debug("group %r: arena dropped: a member is now linked by another kind", self._state.gid)
            self._retired.append(self._arena)  # closed with the table (its operations failed)
            self._arena = None
        rows = self._rows if self._arena is None else (self._arena, *self._rows)
        by = select_providers(self._state.gid, rows)
        # each row with whether the engine retires the tag of an operation it runs (see
        # _ARENA_SEALED), looked up once here rather than per call
        arena = self._arena
        self._by = {
            m: {k: tuple((p, k not in _ARENA_SEALED or p is not arena) for p in ps) for k, ps in t.items()}
            for m, t in by.items()
        }
        self.chosen = {m: {k: [p.name for p in ps] for k, ps in t.items()} for m, t in by.items()}
        # the row whose straight path takes a host all_reduce: the arena, when it is the first
        # row for it (it takes every in-place one, as the API's all_reduce is)
        first = by.get(HOST, {}).get("all_reduce", ())
        self._reduce_row = arena if arena is not None and first and first[0] is arena else None

    @property
    def arena(self) -> ShmGroup | None:
        """The group's shared-memory collectives (client.data._shm_coll.ShmGroup), or None."""
        return None if self._arena is None else self._arena.group

    # -- running -----------------------------------------------------------------------------
    def submit(self, op: Operation) -> Work:
        """Run ``op`` on the first row that takes it; returns its Work.

        Raises:
            DistError: the group was destroyed (``destroyed``).
        """
        if self._links_seen != self._links.links_version:  # (and once the group is destroyed)
            self._select_again(op.kind)
        start, retire = self._row_for(op)
        return self._engine.submit_op(self._state, op, start, retire)

    def _row_for(self, op: Operation) -> tuple[Starter, bool]:
        """The starter of the first row that takes ``op``, and whether its tag is retired."""
        for provider, retire in self._by[op.memory].get(op.kind, ()):
            start = provider.prepare(op)
            if start is not None:
                self.ran = provider.name
                return start, retire
        raise DistError(
            f"{op.kind}: no provider of group {self._state.label!r} runs it on {op.memory} memory"
        )

    def all_reduce(self, w: Working, reduce_op: Any, meta: dict[str, Any], tensor: Any, timeout: Any) -> Work:
        """An all_reduce of ``w`` in place (the caller's ``tensor``): on the arena's straight path
        when the arena is the group's first row for it (ArenaProvider.all_reduce), else as
        ``submit``.

        Raises:
            DistError: the group was destroyed.
        """
        if self._links_seen != self._links.links_version:
            self._select_again("all_reduce")
        row = self._reduce_row
        if row is not None and w.memory == HOST:
            self.ran = row.name
            return row.all_reduce(self._engine, self._state, w, reduce_op, meta, tensor, timeout)
        op = all_reduce_operation(meta, w.array, w, reduce_op, tensor, timeout, w.memory)
        start, retire = self._row_for(op)
        return self._engine.submit_op(self._state, op, start, retire)

    def send(self, peer: int, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """A send of host memory (``w``), to global rank ``peer``: on the p2p row, whose
        straight path makes no record for a send the link takes at once (P2PProvider.send).

        Raises:
            DistError: the group was destroyed.
        """
        if self._links_seen != self._links.links_version:
            self._select_again("send")
        self.ran = "p2p"
        return self._p2p.send(peer, tag, w, meta, timeout)

    def recv(self, peer: int | None, tag: int, w: Working, meta: dict[str, Any], timeout: Any) -> Work:
        """A receive into host memory (``w``) from global rank ``peer`` (None: any), as ``send``."""
        if self._links_seen != self._links.links_version:
            self._select_again("recv")
        self.ran = "p2p"
        return self._p2p.recv(peer, tag, w, meta, timeout)

    def _select_again(self, kind: str) -> None:
        """The process's links changed since the rows were chosen (or the group was destroyed):
        choose again, or refuse ``kind``."""
        if self._destroyed:
            raise DistError(f"{kind}: process group {self._state.gid!r} was destroyed")
        self.select()

    async def _run_part(
        self, spec: CollectiveSpec, transport: Transport, tag: Tag, meta: dict[str, Any]
    ) -> None:
        """Run ``spec`` as a step of an operation already running (a staged chunk, an object
        operation's step, a group's formation): over the links, by the group's route."""
        await run_routed(spec, transport, tag, meta, self.layout)

    def destroyed(self) -> None:
        """Refuse every later operation: the group is destroyed (its rows close with ``close``)."""
        self._destroyed = True
        self._links_seen = -2  # never a links version: the next call looks (``submit``)

    # -- groups ------------------------------------------------------------------------------
    def forming(self, members: Sequence[int]) -> Forming:
        """Begin forming a sub-group of ``members`` (global ranks): see ``Forming``."""
        return Forming(self, members)

    def close(self) -> None:
        arena = () if self._arena is None else (self._arena,)
        for provider in (*arena, *self._retired, *self._rows):
            provider.close()


class Forming:
    """A sub-group being formed: the words its providers must agree on (``offers``, ANDed over
    the parent group's ranks by the caller's all_reduce, which is also the formation's barrier),
    then ``formed`` makes the new group's table, and ``release`` frees what was held back."""

    def __init__(self, parent: ProviderTable, members: Sequence[int]) -> None:
        self._parent = parent
        self._members = list(members)
        self._arena = ArenaForming(parent._links, self._members)
        self.offers = np.array([self._arena.offered], np.uint64)

    def formed(self, engine: Engine, state: GroupState) -> ProviderTable:
        return self._table(engine, state, self._arena.formed(int(self.offers[0]), state.gid))

    def bare(self, engine: Engine, state: GroupState) -> ProviderTable:
        """The new group's table before its members agreed (no arena): for a group that agrees
        over itself, its members alone (``ProcessGroup._survivors_group``)."""
        return self._table(engine, state, None)

    def _table(self, engine: Engine, state: GroupState, arena: ArenaProvider | None) -> ProviderTable:
        parent = self._parent
        return ProviderTable(
            engine, state, parent._links, parent._hosts, arena, (*parent._key[:1], state.gid)
        )

    def release(self) -> None:
        self._arena.release()


def select_providers(gid: str, rows: Sequence[Provider]) -> dict[str, dict[str, tuple[Provider, ...]]]:
    """The one selection: for every memory and kind, the rows that serve it, highest priority
    first (rows of one priority in the order given). Logs at DEBUG what was chosen and why."""
    ordered = sorted(rows, key=lambda p: -p.priority)  # (sorted is stable)
    by: dict[str, dict[str, tuple[Provider, ...]]] = {HOST: {}, DEVICE: {}}
    for memory, table in by.items():
        serving = [p for p in ordered if memory in p.memory]
        for kind in sorted({k for p in serving for k in p.kinds}):
            table[kind] = tuple(p for p in serving if kind in p.kinds)
    if log.isEnabledFor(logging.DEBUG):
        for p in ordered:
            log.debug(
                "group %r: provider %s (%s memory, priority %d) serves %s: %s",
                gid,
                p.name,
                "/".join(sorted(p.memory)),
                p.priority,
                sorted(p.kinds),
                p.why,
            )
        log.debug(
            "group %r: providers by memory and kind: %s",
            gid,
            {m: {k: [p.name for p in ps] for k, ps in t.items()} for m, t in by.items()},
        )
    return by


def world_table(
    engine: Engine, state: GroupState, links: LinkTransport, hosts: Mapping[int, str], runtime_key: Any
) -> ProviderTable:
    """The world group's table: its arena (region 0, free on every rank at start, no agreement
    needed) when every other rank is linked by shared memory."""
    arena = ArenaProvider.for_world(links, state.gid)
    return ProviderTable(engine, state, links, hosts, arena, (runtime_key, state.gid))
