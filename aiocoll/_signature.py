"""An operation's signature: its fields, how it is packed, how it is compared and how a mismatch reads.

Foundation layer: imports the standard library, msgpack and aiocoll._errors only. Every path that
checks that the ranks of a group called the same operation uses this module: the message driver
(aiocoll/algorithms/_driver.py, on every received message), the arenas (client/data/_shm_coll.py,
packed beside each step's data), CUDA IPC (aiocoll/device/_ipc.py) and the coordinator's
progress cross-check (aiocoll/_progress_check.py, fed by client/_progress.py's reports).

A signature is a dict made once per distinct call by the public layer (aiocoll.api
ProcessGroup._meta) and never changed: ``kind``, and where they apply ``root``, ``dtype``,
``count`` and ``op``; the parts of a composite operation add their own keys (``part``), and a
group's formation its ``ranks``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from typing import Any

import msgpack

from ._errors import MismatchError, group_name

__all__ = [
    "FIELDS",
    "PACKED_BYTES",
    "REPORTED",
    "called",
    "describe",
    "differing",
    "mismatch",
    "mismatch_message",
    "pack",
    "same",
    "unpack",
]

FIELDS = ("kind", "root", "dtype", "count", "op")
"""What every rank of a group must agree on, in the order messages name them."""

REPORTED = (*FIELDS, "ranks")
"""The fields progress reports carry to the coordinator (a formation's rank list too)."""

PACKED_BYTES = 256
"""Room for one packed signature (its seq, length and msgpack bytes); larger ones pack a digest."""

_HEAD = struct.Struct("<qH")  # a packed signature's seq and length, before its msgpack bytes
_SEQ = struct.Struct("<q")  # (the head's first field)
_LENGTH = struct.Struct("<H")  # (its second)
_pack_seq = _SEQ.pack
# id(meta) -> the packing after its seq (length and msgpack bytes), and id(meta) -> meta, which
# keeps the dict alive while its packing is kept (so its id is no other dict's)
_PACKED: dict[int, bytes] = {}
_KEPT: dict[int, Mapping[str, Any]] = {}
_PACKED_MAX = 256


def pack(seq: int, meta: Mapping[str, Any]) -> bytes:
    """``meta`` and the operation's ``seq`` as bytes of at most PACKED_BYTES (the arenas publish
    them beside a step's data). A signature is never changed once made, and the public layer
    hands every operation of one signature the same dict, so the packing is kept by the dict's
    identity."""
    known = _PACKED.get(id(meta))
    if known is None:
        known = _packing(meta)
    return _pack_seq(seq) + known


def _packing(meta: Mapping[str, Any]) -> bytes:
    packed = msgpack.packb(meta, use_bin_type=True)
    if _HEAD.size + len(packed) > PACKED_BYTES:
        packed = msgpack.packb({"digest": hashlib.blake2b(packed, digest_size=16).digest()})
    if len(_PACKED) >= _PACKED_MAX:
        _PACKED.clear()
        _KEPT.clear()
    _KEPT[id(meta)] = meta
    known = _PACKED[id(meta)] = _LENGTH.pack(len(packed)) + packed
    return known


def unpack(raw: bytes) -> dict[str, Any]:
    """A packed signature (an authenticated peer's bytes, only ever shown), with its ``seq``."""
    seq, size = _HEAD.unpack_from(raw)
    try:
        meta = msgpack.unpackb(raw[_HEAD.size : _HEAD.size + size], raw=False)
    except Exception:
        return {"unreadable": raw.hex(), "seq": seq}
    return {**meta, "seq": seq} if isinstance(meta, dict) else {"meta": meta, "seq": seq}


def _plain(value: Any) -> Any:
    """What a value looks like after a msgpack round trip: tuples become lists."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def same(theirs: Any, mine: Mapping[str, Any]) -> bool:
    """The one check: whether a peer's signature equals ours (a network transport hands back a
    decoded copy, so they are compared as the wire carries them)."""
    return bool(theirs == mine or _plain(theirs) == _plain(mine))


def differing(mine: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """The fields in which two signatures differ: FIELDS in their order, then any other key."""
    keys = [k for k in FIELDS if _plain(mine.get(k)) != _plain(theirs.get(k))]
    keys += sorted(
        str(k)
        for k in set(mine) | set(theirs)
        if k not in FIELDS and k != "seq" and _plain(mine.get(k)) != _plain(theirs.get(k))
    )
    return keys


def describe(meta: Mapping[str, Any]) -> str:
    """``all_reduce(dtype=float32, count=4, op=sum)``: a call as every message words it."""
    kind = meta.get("kind", "?")
    keys = [k for k in FIELDS if k != "kind" and k in meta]
    keys += sorted(str(k) for k in meta if k not in FIELDS and k != "seq")
    args = ", ".join(f"{k}={meta[k]}" for k in keys if meta[k] is not None)
    return f"{kind}({args})"


def called(calls: Mapping[int, str]) -> str:
    """``ranks 0, 1 called X; rank 3 called Y`` from each rank's described call."""
    by_call: dict[str, list[int]] = {}
    for rank, call in sorted(calls.items()):
        by_call.setdefault(call, []).append(rank)
    return "; ".join(
        f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} called {call}"
        for call, rs in by_call.items()
    )


def mismatch_message(group: str, seq: int, calls: Mapping[int, str], fields: list[str] | None = None) -> str:
    """The one wording of a mismatch: where, in what the calls differ, who called what, what to do."""
    where = f"at seq {seq} of group {group_name(group)!r}" if group else "at one point"
    differ = f" (they differ in {', '.join(fields)})" if fields else ""
    return (
        f"the ranks called different operations {where}{differ}: {called(calls)}. Every rank of a "
        "group must call the same operations, with the same root, dtype, size and reduce op, in "
        "the same order"
    )


def mismatch(
    group: str, seq: int, metas: Mapping[int, Mapping[str, Any]], mine: Mapping[str, Any]
) -> MismatchError:
    """The MismatchError for global ranks' signatures ``metas`` (ours, ``mine``, among them)."""
    fields: list[str] = []
    for meta in metas.values():
        fields += [k for k in differing(mine, meta) if k not in fields]
    with_seq = "seq" in fields or any(
        meta.get("seq") is not None and meta.get("seq") != mine.get("seq") for meta in metas.values()
    )
    if with_seq and "seq" not in fields:
        fields.append("seq")
    calls = {rank: describe(meta) for rank, meta in metas.items()}
    if with_seq:
        calls = {rank: f"{call} at seq {metas[rank].get('seq')}" for rank, call in calls.items()}
    err = MismatchError(
        mismatch_message(group, seq, calls, fields), group=group, seq=seq, ranks=sorted(metas)
    )
    err.fields = fields  # type: ignore[attr-defined]
    return err
