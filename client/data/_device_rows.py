"""The device rows of a group's provider table: ``staged`` (every collective and send/recv of
device tensors, chunk by chunk through pinned host staging) and ``ipc`` (all_reduce and
broadcast device to device by CUDA IPC, where the group can).

Imports foundations (aiocoll._errors, aiocoll.algorithms, the device staging and IPC modules of
aiocoll.device) and the client's engine, operation record and p2p row (its check of a received
message); never the public surface or the table (client/data/providers.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

from aiocoll._errors import MismatchError
from aiocoll.algorithms import Tag
from aiocoll.device._ipc import IPC_KINDS, IPC_OPS, ipc_groups
from aiocoll.device._staged_ops import RunPart, StagedOp

from ._operation import (
    COLLECTIVE_KINDS,
    DEVICE,
    P2P_KINDS,
    Finish,
    Operation,
    Starter,
    as_starter,
    copying_back,
)
from ._p2p_row import received
from .engine import OpTransport, Stoppable

__all__ = ["IpcProvider", "StagedProvider"]


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
