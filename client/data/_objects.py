"""The object row of a group's provider table: operations on picklable objects, and the
agreement that forms a sub-group, each run in steps (sizes, then the bytes) inside its one
operation, every step by the group's route over the links.

Imports foundations (aiocoll.algorithms, aiocoll._types) and client/data/_operation.py; never the
public surface. client/data/providers.py puts it in every group's table and hands it the route
(``RunPart``, how a step runs). The public layer pickles what it sends (a call with an object that cannot be
pickled fails at once); this row sends it and unpickles what arrives. Objects are unpickled
only from members of the job: every peer link is authenticated with the job's token.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from aiocoll.algorithms import CollectiveSpec, Tag
from aiocoll.device._staged_ops import RunPart

from ._op_record import OpTransport
from ._operation import HOST, OBJECT_KINDS, Body, Operation, Starter, as_starter

__all__ = ["ObjectProvider"]


class ObjectProvider:
    """Object operations and group formation over host memory, in steps run by ``run``.

    Args:
        ranks: the group's global ranks. me: my group rank. gid: the group id (a new group's
        id is the parent's and the formation's sequence number). run: the group's route.
    """

    name: ClassVar[str] = "objects"
    memory: ClassVar[frozenset[str]] = frozenset({HOST})
    priority: ClassVar[int] = 0
    kinds: frozenset[str] = OBJECT_KINDS
    why = "objects and group formation, in steps over the links"

    def __init__(self, ranks: tuple[int, ...], me: int, gid: str, run: RunPart) -> None:
        self._ranks = ranks
        self._me = me
        self._gid = gid
        self._run = run

    def _spec(
        self, kind: str, send: Sequence[np.ndarray], recv: Sequence[np.ndarray], root: int = 0
    ) -> CollectiveSpec:
        return CollectiveSpec(kind, self._ranks, self._me, tuple(send), tuple(recv), root=root)

    def prepare(self, op: Operation) -> Starter:
        return as_starter(_BODIES[op.kind](self, op))

    def _broadcast_object(self, op: Operation) -> Body:
        root, me, run = op.root, self._me, self._run
        data: bytes = op.inputs[0] if me == root else b""

        async def body(tag: Tag, tp: OpTransport) -> Any:
            size = np.array([len(data)], dtype=np.int64)
            meta = {"kind": "broadcast_object", "root": root}
            await run(self._spec("broadcast", (), (size,), root), tp, (*tag, 0), meta)
            buf = (
                np.frombuffer(data, dtype=np.uint8).copy() if me == root else np.empty(int(size[0]), np.uint8)
            )
            await run(self._spec("broadcast", (), (buf,), root), tp, (*tag, 1), meta)
            return op.result if me == root else pickle.loads(buf.tobytes())

        return body

    async def _sizes(self, tp: OpTransport, tag: Tag, n: int, kind: str) -> np.ndarray:
        mine = np.array([n], dtype=np.int64)
        outs = [np.empty(1, np.int64) for _ in self._ranks]
        await self._run(self._spec("all_gather", (mine,), outs), tp, (*tag, 0), {"kind": kind})
        return np.array([int(o[0]) for o in outs], dtype=np.int64)

    def _all_gather_object(self, op: Operation) -> Body:
        data: bytes = op.inputs[0]

        async def body(tag: Tag, tp: OpTransport) -> list[Any]:
            sizes = await self._sizes(tp, tag, len(data), "all_gather_object")
            mine, outs = _padded(data, int(sizes.max()), len(self._ranks))
            meta = {"kind": "all_gather_object"}
            await self._run(self._spec("all_gather", (mine,), outs), tp, (*tag, 1), meta)
            return [pickle.loads(o[: int(s)].tobytes()) for o, s in zip(outs, sizes, strict=True)]

        return body

    def _gather_object(self, op: Operation) -> Body:
        data: bytes = op.inputs[0]
        root, me = op.root, self._me

        async def body(tag: Tag, tp: OpTransport) -> list[Any] | None:
            sizes = await self._sizes(tp, tag, len(data), "gather_object")
            mine, outs = _padded(data, int(sizes.max()), len(self._ranks) if me == root else 0)
            meta = {"kind": "gather_object", "root": root}
            await self._run(self._spec("gather", (mine,), outs, root), tp, (*tag, 1), meta)
            if me != root:
                return None
            return [pickle.loads(o[: int(s)].tobytes()) for o, s in zip(outs, sizes, strict=True)]

        return body

    def _scatter_object(self, op: Operation) -> Body:
        blobs: Sequence[bytes] = op.inputs
        root, me, n = op.root, self._me, len(self._ranks)

        async def body(tag: Tag, tp: OpTransport) -> Any:
            sizes = np.array([len(b) for b in blobs] or [0] * n, dtype=np.int64)
            meta = {"kind": "scatter_object", "root": root}
            await self._run(self._spec("broadcast", (), (sizes,), root), tp, (*tag, 0), meta)
            longest = int(sizes.max())
            send = [_padded(b, longest, 0)[0] for b in blobs] if me == root else []
            out = np.empty(longest, np.uint8)
            await self._run(self._spec("scatter", send, (out,), root), tp, (*tag, 1), meta)
            return pickle.loads(out[: int(sizes[me])].tobytes())

        return body

    def _new_group(self, op: Operation) -> Body:
        """The parent group's agreement on a new group: every rank's offers (what its providers
        could give the new group), ANDed in place (an all_reduce is a barrier too); completes
        with the new group's id."""
        agree = CollectiveSpec(
            "all_reduce", self._ranks, self._me, tuple(op.inputs), tuple(op.outputs), op=op.op
        )
        meta, gid = op.meta, self._gid

        async def body(tag: Tag, tp: OpTransport) -> str:
            await self._run(agree, tp, tag, meta)
            return f"{gid}.{tag[2]}"

        return body

    def close(self) -> None:
        pass


# kind -> the operation's body (every kind of OBJECT_KINDS)
_BODIES: dict[str, Callable[[ObjectProvider, Operation], Body]] = {
    "broadcast_object": ObjectProvider._broadcast_object,
    "all_gather_object": ObjectProvider._all_gather_object,
    "gather_object": ObjectProvider._gather_object,
    "scatter_object": ObjectProvider._scatter_object,
    "new_group": ObjectProvider._new_group,
}
assert set(_BODIES) == OBJECT_KINDS


def _padded(data: bytes, longest: int, slots: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """``data`` as ``longest`` bytes (zeros after it), and ``slots`` buffers of that length."""
    mine = np.zeros(longest, np.uint8)
    mine[: len(data)] = np.frombuffer(data, np.uint8)
    return mine, [np.empty(longest, np.uint8) for _ in range(slots)]
