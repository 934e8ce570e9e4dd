"""Operations on device tensors, run chunk by chunk through the pinned staging pipeline.

Foundation layer: imports this package's _staging, _ipc and _device, the algorithms
(run_collective, CollectiveSpec, the Transport interface) and numpy; never client/, server/ or
the public surface. The staged provider (client/data/_device_rows.py) hands it an operation as the
public layer built it (send and receive lists cut from its tensors' Working arrays); when some
of those are DeviceSpans it builds a StagedOp at call time (which records the caller's event
then) and awaits ``collective`` in the operation's body (``send_to`` and ``recv_from`` for the
point-to-point calls), each chunk's host operation run by the route the provider hands in (the
group's route over the links). A multi-chunk all_reduce or broadcast between ranks of one host
goes device to device instead when the group can (_ipc); the rest is staged.

Chunking: every array of a collective is cut into the same element ranges
[c*m, (c+1)*m), and chunk c runs as an ordinary collective over the chunk's host views, tagged
``(*tag, c)``. The chunk length m depends only on what every rank agrees on (kind, group size,
dtype, the pool's buffer size), and so does the number of chunks: the operation's element
count, or for all_to_all (whose blocks differ in size) the largest block of any rank, agreed
by a small all_reduce first. A point-to-point message is cut the same way, one message per chunk;
staged messages on one tag and peer go one after another, in call order.

Where chunks meet host tensors: a collective of one chunk and a message's first chunk carry the
operation's own tag, so a rank with a host tensor interoperates with one using a device tensor
up to one chunk (``CHUNK_BYTES`` in total, less for multi-block kinds). Beyond that every rank
must stage (the host path does not chunk), else the operation runs into its deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from aiocoll._types import ReduceOp
from aiocoll.algorithms import CollectiveSpec, Transport, run_collective
from aiocoll.device._device import Device, DeviceTensor
from aiocoll.device._ipc import IPC_KINDS, IPC_OPS, ipc_groups
from aiocoll.device._staging import (
    CallerStreamContext,
    DeviceSpan,
    Piece,
    Staging,
    caller_context,
    chunk_bounds,
    ready_event,
    run_pipeline,
    staging_for,
)

__all__ = ["RunPart", "StagedOp"]

log = logging.getLogger("aiocoll.staging")

# Kinds whose send and receive lists are one array (or the same array): a chunk stages one
# range. The others stage up to one range per rank in each direction.
_SINGLE_ARRAY_KINDS = frozenset({"all_reduce", "broadcast", "reduce", "send", "recv"})


# How a staged chunk's host operation runs: (spec, transport, tag, meta), as run_collective.
RunPart = Callable[[CollectiveSpec, Transport, tuple[Any, ...], dict[str, Any]], Awaitable[None]]


class StagedOp:
    """One operation with device tensors, set up at call time.

    ``StagedOp.last_path`` names the device path the latest operation of this process took
    ("staged" or "ipc"), for ``aiocoll bench``; each operation logs it at DEBUG too.

    Args:
        kind: the operation ("all_reduce", "send", ...). group_size: ranks in the group.
        send, recv: the operation's arrays (DeviceSpans and host numpy arrays, any mix).
        rank: this process's global rank, for log lines.
        group_key: names the group for its IPC state (aiocoll.device._ipc); None: never IPC.
    Raises:
        ValueError: device tensors on more than one device.
    """

    last_path = "-"

    def __init__(
        self,
        kind: str,
        group_size: int,
        send: Sequence[Any],
        recv: Sequence[Any],
        *,
        rank: int,
        group_key: tuple[Any, ...] | None = None,
    ) -> None:
        self.kind = kind
        self.group_key = group_key
        self.send = list(send)
        self.recv = list(recv)
        self.rank = rank
        spans = [a for a in (*self.send, *self.recv) if isinstance(a, DeviceSpan)]
        devices = {id(s.tensor.device): s.tensor.device for s in spans}
        if len(devices) != 1:
            names = sorted(d.name for d in devices.values())
            raise ValueError(
                f"{kind}: every device tensor of one operation must be on one device, got {names}; "
                "move them to one device"
            )
        self.device: Device = next(iter(devices.values()))
        self.staging: Staging = staging_for(self.device)
        self.tensors: dict[int, tuple[DeviceTensor, bool]] = {}
        for s in spans:
            tensor, read = self.tensors.get(id(s.tensor), (s.tensor, False))
            self.tensors[id(s.tensor)] = (tensor, read or s.read)
        itemsize = spans[0].itemsize
        ranges = 1 if kind in _SINGLE_ARRAY_KINDS else 2 * max(1, group_size)
        self.chunk_elems = max(1, self.staging.pool.buffer_bytes // (itemsize * ranges))
        # Recorded now, at call time: the values the caller computed so far are what is sent.
        self.ready = ready_event(self.device)
        context = caller_context.get()
        # Where to leave completion events for the caller's stream; None: complete once the
        # results landed on the device.
        self.context: CallerStreamContext | None = context if context and not context.wait_on_host else None
        self.path = "staged"
        self._ipc_off = ""

    # -- the pieces of one chunk -------------------------------------------------------------
    def _cut(self, a: int, b: int) -> tuple[list[Piece], list[Any], list[Any]]:
        """Chunk [a, b) of every array: the device pieces to stage, and the send and receive
        lists with, for now, the DeviceSpan slices in place of host views."""
        pieces: list[Piece] = []

        def piece_of(span: DeviceSpan, in_recv: bool) -> int:
            for i, p in enumerate(pieces):
                if p.span.same_range(span):
                    p.write = p.write or (in_recv and span.write)
                    return i
            pieces.append(Piece(span, span.read, in_recv and span.write))
            return len(pieces) - 1

        def cut(arrays: list[Any], in_recv: bool) -> list[Any]:
            out: list[Any] = []
            for arr in arrays:
                part = arr[min(a, arr.size) : min(b, arr.size)]
                out.append(("piece", piece_of(part, in_recv)) if isinstance(part, DeviceSpan) else part)
            return out

        return pieces, cut(self.send, False), cut(self.recv, True)

    @staticmethod
    def _fill(arrays: list[Any], views: list[np.ndarray]) -> tuple[np.ndarray, ...]:
        return tuple(views[a[1]] if isinstance(a, tuple) else a for a in arrays)

    def _bounds(self, count: int) -> list[tuple[int, int]]:
        return chunk_bounds(count, self.chunk_elems)

    def _prepare(self, stream: Any) -> None:
        for tensor, read in self.tensors.values():
            tensor.prepare(stream, read=read)

    def _finish(self, stream: Any) -> None:
        for tensor, _ in self.tensors.values():
            tensor.finish(stream)

    def _log(self, what: str, chunks: int, how: str) -> None:
        StagedOp.last_path = self.path
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "rank %s: %s on %s via %s (%s): %d chunk(s) of up to %d elements",
                self.rank,
                what,
                self.device.name,
                self.path,
                how,
                chunks,
                self.chunk_elems,
            )

    async def _run(self, bounds: list[tuple[int, int]], move: Any, what: str) -> None:
        cuts = [self._cut(a, b) for a, b in bounds]

        async def transfer(k: int, views: list[np.ndarray]) -> None:
            _, send, recv = cuts[k]
            await move(k, self._fill(send, views), self._fill(recv, views))

        context = self.context
        off = f"; IPC off: {self._ipc_off}" if self._ipc_off else ""
        self._log(what, len(bounds), f"pinned host buffers{off}")
        done = await run_pipeline(
            self.staging,
            [c[0] for c in cuts],
            transfer,
            ready=self.ready,
            lease=self.staging.pool.lease(),
            what=what,
            prepare=self._prepare,
            finish=self._finish,
            host_wait=context is None,
        )
        if context is not None:
            context.completion.append((self.device, done))

    async def _try_ipc(
        self,
        transport: Transport,
        tag: tuple[Any, ...],
        meta: dict[str, Any],
        bounds: list[tuple[int, int]],
        *,
        ranks: tuple[int, ...],
        me: int,
        root: int,
        op: ReduceOp,
        what: str,
    ) -> bool:
        """Run the operation device to device through IPC when the group can (aiocoll.device._ipc);
        False when it cannot (the caller stages it). Every rank reaches the same answer: the
        conditions are the operation's signature, and the group's setup is collective."""
        if (
            self.group_key is None
            or self.kind not in IPC_KINDS
            or op not in IPC_OPS
            or len(bounds) < 2  # one chunk: a peer may be using a host tensor (module header)
            or len(self.tensors) != 1
        ):
            return False
        group = ipc_groups.get((*self.group_key, self.device.name), self.staging)
        async with group.lock:  # one IPC operation of a group at a time, in call order
            if group.enabled is None:
                await group.setup(transport, tag, ranks, me)
            if not group.enabled:
                self.path = "staged"
                self._ipc_off = group.why
                return False
            self.path = "ipc"
            self._log(what, len(bounds), "device to device")
            whole = next(a for a in (*self.send, *self.recv) if isinstance(a, DeviceSpan))
            done = await group.run(
                self.kind,
                whole,
                bounds,
                transport,
                tag,
                meta,
                ranks=ranks,
                me=me,
                root=root,
                op=op,
                ready=self.ready,
                prepare=self._prepare,
                finish=self._finish,
                host_wait=self.context is None,
                what=what,
            )
        if self.context is not None:
            self.context.completion.append((self.device, done))
        return True

    # -- operations --------------------------------------------------------------------------
    async def collective(
        self,
        transport: Transport,
        tag: tuple[Any, ...],
        meta: dict[str, Any],
        *,
        ranks: tuple[int, ...],
        me: int,
        root: int,
        op: ReduceOp,
        what: str,
        run: Callable[
            [CollectiveSpec, Transport, tuple[Any, ...], dict[str, Any]], Awaitable[None]
        ] = run_collective,
    ) -> None:
        """Run the collective ``self.kind`` chunk by chunk (see the module header); each chunk's
        host operation runs by ``run`` (the wrapped provider's route; by default the algorithms
        over the links)."""
        if self.kind == "all_to_all":
            longest = np.array([max([a.size for a in (*self.send, *self.recv)] or [0])], np.int64)
            agree = CollectiveSpec("all_reduce", ranks, me, (longest,), (longest,), op=ReduceOp.MAX)
            await run(agree, transport, (*tag, "n"), {"kind": "all_to_all_chunks"})
            count = int(longest[0])
        else:
            count = int(meta.get("count", 0))
        dtype = meta.get("dtype")

        async def move(k: int, send: tuple[np.ndarray, ...], recv: tuple[np.ndarray, ...]) -> None:
            spec = CollectiveSpec(self.kind, ranks, me, send, recv, root=root, op=op, dtype=dtype)
            await run(spec, transport, chunk_tag(tag, k, total), meta)

        bounds = self._bounds(count)
        total = len(bounds)
        if await self._try_ipc(transport, tag, meta, bounds, ranks=ranks, me=me, root=root, op=op, what=what):
            return
        await self._run(bounds, move, what)

    def chain(self, key: tuple[Any, ...]) -> Callable[[], None]:
        """Order this point-to-point operation after earlier staged ones on ``key``; call when it
        starts, in call order. Returns what lets the next one go: call it when the operation
        ends, however it ends (even if its transfer never began)."""
        self._chain = _Chain(key)
        return self._chain.end

    async def send_to(
        self, transport: Transport, tag: tuple[Any, ...], peer: int, meta: dict[str, Any], what: str
    ) -> None:
        """Send the one tensor to ``peer``, one message per chunk. A message of several chunks
        says so in its meta (``chunks``, ``chunk_bytes``, ``nbytes``), so that a receiver with a
        host tensor can tell why the first chunk does not fit, and take the rest off the wire."""
        bounds = self._bounds(self.send[0].size)
        if len(bounds) > 1:
            itemsize = self.send[0].itemsize
            meta = {
                **meta,
                "chunks": len(bounds),
                "chunk_bytes": self.chunk_elems * itemsize,
                "nbytes": self.send[0].size * itemsize,
            }

        async def move(k: int, send: tuple[np.ndarray, ...], recv: tuple[np.ndarray, ...]) -> None:
            await transport.send(peer, p2p_chunk_tag(tag, k), send[0].reshape(-1).view(np.uint8).data, meta)

        async with self._chain:
            await self._run(bounds, move, what)

    async def recv_from(
        self, transport: Transport, tag: tuple[Any, ...], peer: int | None, what: str
    ) -> tuple[int, dict[str, Any]]:
        """Receive into the one tensor from ``peer`` (None: any; the first chunk decides)."""
        source: list[int | None] = [peer]
        first: list[dict[str, Any]] = []

        async def move(k: int, send: tuple[np.ndarray, ...], recv: tuple[np.ndarray, ...]) -> None:
            into = recv[0].reshape(-1).view(np.uint8).data
            got, meta = await transport.recv(source[0], p2p_chunk_tag(tag, k), into)
            if k == 0:
                source[0] = got
                first.append(meta)

        async with self._chain:
            await self._run(self._bounds(self.recv[0].size), move, what)
        got = source[0]
        assert got is not None
        return got, first[0] if first else {}


def chunk_tag(tag: tuple[Any, ...], k: int, total: int) -> tuple[Any, ...]:
    """Chunk k's tag. The first chunk of a point-to-point message and the only chunk of a small
    collective keep the operation's own tag, so they look on the wire exactly like the same
    operation on host tensors (a rank may use a CPU tensor where its peer uses a device one)."""
    return tag if k == 0 and total == 1 else (*tag, k)


def p2p_chunk_tag(tag: tuple[Any, ...], k: int) -> tuple[Any, ...]:
    return tag if k == 0 else (*tag, k)


class _Chain:
    """Staged point-to-point operations on one (direction, group, tag, peer) run one after
    another in call order, so the chunks of two messages never interleave on the wire. A link
    ends when its transfer ends, or when its operation ends however it ends (``end``: even if its
    transfer never began)."""

    tails: dict[tuple[Any, ...], asyncio.Future[None]] = {}

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        self.before = self.tails.get(key)
        self.mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.tails[key] = self.mine

    def end(self) -> None:
        if not self.mine.done():
            self.mine.set_result(None)
        if self.tails.get(self.key) is self.mine:
            del self.tails[self.key]

    async def __aenter__(self) -> None:
        if self.before is not None and not self.before.done():
            await asyncio.shield(self.before)

    async def __aexit__(self, *exc: object) -> None:
        self.end()
