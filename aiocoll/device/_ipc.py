"""Device-to-device all_reduce and broadcast between ranks that share a host, through IPC.

Foundation layer: imports aiocoll.device._device (the interface), aiocoll.device._staging, the algorithms
(run_collective, the Transport interface), _errors and msgpack; never torch, client/ or the
public surface. aiocoll.device._staged_ops asks ``IpcGroups.for_op`` whether an operation can take this
path and falls back to pinned staging when it cannot.

Setup, once per group and device, at the group's first eligible operation (every rank reaches
it at the same sequence number): each rank allocates its mailbox (a device buffer of two slots
of one pool buffer's size) and an interprocess event per slot, and the ranks all-gather a record
(host and device identity, the IPC handles, or why this rank cannot) over their authenticated
links; each opens its peers' handles, and an all_reduce(MIN) of "opened everything" makes the
decision the same everywhere. Records are msgpack, never pickle.

One chunk c of an all_reduce (a broadcast is the same with one writer, the root):
1. the rank copies its chunk into slot c % 2 of its mailbox on the side stream (after the
   caller's event) and records that slot's event there, then tells every peer "posted";
   it posts chunk c+1 before it reads chunk c, so peers never wait a round trip for it;
2. once every peer posted c, the side stream waits for the peers' slot events (cross-process
   order: the peer's copy has landed) and computes mailbox_0 (op) mailbox_1 (op) ... in rank
   order straight from the peers' mailboxes (the same order on every rank, so every rank gets the
   same bits), into the caller's tensor; a peer on another device is first copied device to
   device into a local scratch buffer; AVG then divides. These copies and reductions go through
   the step driver's buffer interface, implemented for device memory (aiocoll.device._device_buffers);
3. when those reads are done (an event, waited for on the host) it tells every peer "done".
A rank overwrites a slot (chunk c+2), and an operation ends, only after every peer said "done"
with what the slot held: producers outlive their consumers. A group's IPC operations run one at
a time (they share the mailbox), in call order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np

import aiocoll._signature as _signature
from aiocoll._env import env_text
from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec, Transport, run_collective
from aiocoll.device._device import Device, DeviceError, DeviceTensor, Event, Stream
from aiocoll.device._device_buffers import DeviceBuffers
from aiocoll.device._staging import DeviceSpan, Staging

__all__ = ["IPC_OPS", "IPC_KINDS", "IpcGroup", "ipc_groups"]

log = logging.getLogger("aiocoll.staging")

IPC_KINDS = frozenset({"all_reduce", "broadcast"})
IPC_OPS = frozenset({ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG})
_RECORD_BYTES = 4096  # an exchanged record's bound (handles are ~100-200 bytes)
SLOTS = 2  # mailbox slots: chunk c+1 is posted while peers still read chunk c


class IpcGroup:
    """One group's IPC state on one device: own mailbox and event, peers' opened ones.

    Attributes:
        enabled: None until set up; then True, or False with ``why`` saying what prevented it.
    """

    def __init__(self, key: tuple[Any, ...], staging: Staging) -> None:
        self.key = key
        self.staging = staging
        self.device: Device = staging.device
        self.enabled: bool | None = None
        self.why = ""
        self.lock = asyncio.Lock()
        self.mailbox: DeviceTensor | None = None  # SLOTS slots of ``size`` bytes
        self.events: list[Event] = []  # one interprocess event per slot
        # group rank -> (its mailbox, its events, on this very device)
        self.peers: dict[int, tuple[DeviceTensor, list[Event], bool]] = {}
        self.scratch: DeviceTensor | None = None
        self.size = staging.pool.buffer_bytes

    # -- setup -------------------------------------------------------------------------------
    def _local_record(self) -> list[Any]:
        why = "disabled by AIOCOLL_CUDA_IPC=0" if env_text("AIOCOLL_CUDA_IPC") == "0" else None
        why = why or self.device.ipc_supported()
        if why is None:
            try:
                self.mailbox = self.device.empty(SLOTS * self.size)
                self.events = [self.device.new_event(interprocess=True) for _ in range(SLOTS)]
                return [
                    self.device.identity(),
                    "",
                    self.device.ipc_export(self.mailbox),
                    [self.device.ipc_event_export(e) for e in self.events],
                ]
            except (DeviceError, RuntimeError, OSError) as exc:
                why = f"could not share a buffer: {exc}"
        return [self.device.identity(), why, b"", []]

    async def setup(
        self, transport: Transport, tag: tuple[Any, ...], ranks: tuple[int, ...], me: int
    ) -> None:
        """Exchange records and decide (see the module header); every rank of the group calls it."""
        mine = bytes(msgpack.packb(self._local_record()))
        if len(mine) > _RECORD_BYTES:
            mine = bytes(msgpack.packb([self.device.identity(), "record too large", b"", []]))
        padded = np.zeros(_RECORD_BYTES + 8, np.uint8)
        padded[:8] = np.frombuffer(np.int64(len(mine)).tobytes(), np.uint8)
        padded[8 : 8 + len(mine)] = np.frombuffer(mine, np.uint8)
        gathered = [np.empty_like(padded) for _ in ranks]
        meta = {"kind": "ipc_setup"}
        await run_collective(
            CollectiveSpec("all_gather", ranks, me, (padded,), tuple(gathered)),
            transport,
            (*tag, "ipc", 0),
            meta,
        )
        records = []
        for g in gathered:
            length = int(np.frombuffer(g[:8].tobytes(), np.int64)[0])
            records.append(msgpack.unpackb(g[8 : 8 + min(length, _RECORD_BYTES)].tobytes()))
        hosts = {str(r[0]).rsplit("/", 1)[0] for r in records}
        refusals = [f"rank {i}: {r[1]}" for i, r in enumerate(records) if r[1]]
        why = "; ".join(refusals) if refusals else ("ranks on different hosts" if len(hosts) > 1 else "")
        if not why:
            try:
                for i, record in enumerate(records):
                    if i == me:
                        continue
                    assert self.mailbox is not None
                    box = self.device.ipc_open(bytes(record[2]), self.mailbox)  # same size as ours
                    events = [self.device.ipc_event_open(bytes(h)) for h in record[3]]
                    if len(events) != SLOTS:
                        raise ValueError(f"rank {i} shared {len(events)} events, not {SLOTS}")
                    self.peers[i] = (box, events, record[0] == self.device.identity())
            except (DeviceError, RuntimeError, OSError, ValueError) as exc:
                why = f"rank {me} could not open a peer's IPC handle: {exc}"
        agree = np.array([0 if why else 1], np.int64)
        await run_collective(
            CollectiveSpec("all_reduce", ranks, me, (agree,), (agree,), op=ReduceOp.MIN),
            transport,
            (*tag, "ipc", 1),
            meta,
        )
        self.enabled = bool(agree[0])
        if not self.enabled:
            self.why = why or "another rank could not open the IPC handles"
            self.close()
        elif any(not same for _, _, same in self.peers.values()):
            self.scratch = self.device.empty(self.size)
        log.debug(
            "rank %s: group %s on %s: CUDA IPC %s",
            ranks[me],
            self.key[1],
            self.device.name,
            "on" if self.enabled else f"off ({self.why})",
        )

    def close(self) -> None:
        """Drop the opened peer buffers and our own (peers said done with ours: every operation
        ends only after that)."""
        self.peers.clear()
        self.mailbox = self.scratch = None
        self.events = []

    # -- operations ----------------------------------------------------------------------------
    async def run(
        self,
        kind: str,
        whole: DeviceSpan,
        bounds: Sequence[tuple[int, int]],
        transport: Transport,
        tag: tuple[Any, ...],
        meta: dict[str, Any],
        *,
        ranks: tuple[int, ...],
        me: int,
        root: int,
        op: ReduceOp,
        ready: Event,
        prepare: Callable[[Stream], None],
        finish: Callable[[Stream], None],
        host_wait: bool,
        what: str,
    ) -> Event:
        """all_reduce or broadcast of ``whole`` (a prepared tensor's span) chunk by chunk; see
        the module header."""
        assert self.enabled and self.mailbox is not None and self.events
        device, side, waiter = self.device, self.staging.side, self.staging.waiter
        bufs = DeviceBuffers(device, side)
        dtype = str(meta.get("dtype"))
        slot_elems = self.size // whole.itemsize
        peers = [i for i in range(len(ranks)) if i != me]
        writers = peers if kind == "all_reduce" else ([root] if root != me else [])
        readers = peers if kind == "all_reduce" or me == root else []
        posting = kind == "all_reduce" or me == root
        side.wait_event(ready)
        prepare(side)

        def slot(memory: DeviceTensor, c: int, count: int) -> DeviceSpan:
            start = (c % SLOTS) * slot_elems
            return DeviceSpan(memory, whole.dtype, start, start + count, read=False, write=False)

        async def tell(to: Sequence[int], step: str, c: int) -> None:
            await asyncio.gather(
                *(transport.send(ranks[i], (*tag, "ipc", step, c), memoryview(b""), meta) for i in to)
            )

        async def hear(frm: Sequence[int], step: str, c: int) -> None:
            got = await asyncio.gather(
                *(transport.recv(ranks[i], (*tag, "ipc", step, c), memoryview(bytearray(0))) for i in frm)
            )
            for i, (_, theirs) in zip(frm, got, strict=True):
                if not _signature.same(theirs, meta):
                    seq = int(tag[2]) if len(tag) > 2 and isinstance(tag[2], int) else -1
                    group = str(tag[1]) if len(tag) > 1 else ""
                    raise _signature.mismatch(group, seq, {ranks[me]: meta, ranks[i]: theirs}, meta)

        async def post(c: int) -> None:
            a, b = bounds[c]
            if c >= SLOTS and readers:
                await hear(readers, "done", c - SLOTS)  # every reader finished with this slot
            assert self.mailbox is not None
            bufs.copy(slot(self.mailbox, c, b - a), bufs.view(whole, a, b))
            self.events[c % SLOTS].record(side)
            await tell(readers, "posted", c)

        if posting:
            await post(0)
        for c, (a, b) in enumerate(bounds):
            if posting and c + 1 < len(bounds):
                await post(c + 1)  # peers may start on the next chunk while this one is read
            if not writers:
                continue
            x, count = bufs.view(whole, a, b), b - a
            await hear(writers, "posted", c)
            for i in writers:
                side.wait_event(self.peers[i][1][c % SLOTS])
            if kind == "broadcast":
                bufs.copy(x, self._readable(bufs, root, c, count, whole))
            else:
                # rank order on every rank: the same bits everywhere
                if me != 0:
                    bufs.copy(x, self._readable(bufs, 0, c, count, whole))
                for i in range(1, len(ranks)):
                    bufs.reduce_into(op, x, self._readable(bufs, i, c, count, whole), dtype, src_first=False)
                if op == ReduceOp.AVG:
                    bufs.finish_avg(x, len(ranks), dtype)
            reads = device.new_event()
            reads.record(side)
            try:
                await waiter.wait(reads)
            except DeviceError as exc:
                raise DeviceError(f"{what}: reading peers' chunk {c + 1} failed: {exc}") from exc
            await tell(writers, "done", c)
        if readers:  # the last slots' readers: our mailbox is free for the next operation after this
            for c in range(max(0, len(bounds) - SLOTS), len(bounds)):
                await hear(readers, "done", c)
        finish(side)
        done = device.new_event()
        done.record(side)
        if host_wait:
            await waiter.wait(done)
        return done

    def _readable(self, bufs: DeviceBuffers, i: int, c: int, count: int, like: DeviceSpan) -> DeviceSpan:
        """Rank ``i``'s slot of chunk ``c`` (``count`` elements of ``like``'s dtype) as this device
        can read it: our own mailbox or a peer's on this device directly, else first copied device
        to device into local scratch."""
        start = (c % SLOTS) * (self.size // like.itemsize)
        if i not in self.peers:
            assert self.mailbox is not None
            return DeviceSpan(self.mailbox, like.dtype, start, start + count, read=False, write=False)
        memory, _events, same = self.peers[i]
        peer = DeviceSpan(memory, like.dtype, start, start + count, read=False, write=False)
        if same:
            return peer
        assert self.scratch is not None
        local = DeviceSpan(self.scratch, like.dtype, 0, count, read=False, write=False)
        bufs.copy(local, peer)
        return local


class _Registry:
    """The process's IpcGroups by (runtime, group, device)."""

    def __init__(self) -> None:
        self.groups: dict[tuple[Any, ...], IpcGroup] = {}

    def get(self, key: tuple[Any, ...], staging: Staging) -> IpcGroup:
        found = self.groups.get(key)
        if found is None:
            found = self.groups[key] = IpcGroup(key, staging)
        return found

    def forget(self, prefix: tuple[Any, ...]) -> None:
        """Close the IpcGroups of a destroyed group (or of a whole runtime: a shorter prefix)."""
        for key in [k for k in self.groups if k[: len(prefix)] == prefix]:
            self.groups.pop(key).close()


ipc_groups = _Registry()
