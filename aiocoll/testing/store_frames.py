"""Store requests by their names, in the compact wire form the coordinator speaks
(aiocoll.protocol._store), and its compact replies read back as maps: for tests and probes that
talk to a coordinator without a session (raw sockets, the state machine itself).

SET, APPEND and MSET are answered only when refused; a later reply on the same connection
acknowledges them. A raw client that wants an answer for one sends a SYNC right behind it
(``request_frames`` does) and reads the SYNC's reply as that request's "ok".

Public testing surface: imports the protocol only.
"""

from __future__ import annotations

from typing import Any

import msgpack

from aiocoll.protocol._store import (
    ADD,
    APPEND,
    CAS,
    CHECK,
    DEL,
    ERROR,
    GET,
    MGET,
    MSET,
    NKEYS,
    NO_REPLY,
    OK,
    SET,
    SYNC,
    WAIT,
    encode_request,
)

__all__ = ["CODES", "as_map", "request_frames", "store_header"]

_pack = msgpack.Packer(use_bin_type=True).pack

CODES = {
    "set": SET,
    "get": GET,
    "add": ADD,
    "cas": CAS,
    "wait": WAIT,
    "check": CHECK,
    "del": DEL,
    "nkeys": NKEYS,
    "mget": MGET,
    "mset": MSET,
    "append": APPEND,
    "sync": SYNC,
}


def store_header(op: str, req_id: int, fields: dict[str, Any], ack: int = 0) -> list[Any]:
    """The compact header of store request ``op`` (fields by their old map names)."""
    code = CODES[op]
    key, keys, timeout = fields.get("key"), fields.get("keys"), fields.get("timeout")
    if code in (SET, APPEND, DEL):
        return [code, req_id, ack, key]
    if code == ADD:
        return [code, req_id, ack, key, fields.get("amount")]
    if code == CAS:
        sizes = fields.get("sizes") or [0, 0]
        return [code, req_id, ack, key, sizes[0]]
    if code == MSET:
        return [code, req_id, ack, keys, fields.get("sizes")]
    if code == GET:
        return [code, req_id, key, timeout]
    if code in (WAIT, MGET):
        return [code, req_id, keys, timeout]
    if code == CHECK:
        return [code, req_id, keys]
    return [code, req_id]


def as_map(op: str, header: Any) -> dict[str, Any]:
    """A reply as a map: compact replies become {"id", "ok", "value" | "sizes"} or
    {"id", "ok": False, "err", "msg", "keys"}; maps (control replies, events) stay as they are."""
    if type(header) is dict:
        return header
    if header[1] == ERROR:
        return {"id": header[0], "ok": False, "err": header[2], "msg": header[3], "keys": header[4]}
    reply: dict[str, Any] = {"id": header[0], "ok": header[1] == OK}
    if len(header) > 2:
        reply["sizes" if op == "mget" else "value"] = header[2]
    return reply


def request_frames(op: str, req_id: int, payload: bytes = b"", **fields: Any) -> tuple[bytes, int | None]:
    """The bytes to send for store request ``op`` (fields by their map names, ``ack`` too), and
    the id of the SYNC sent right behind it when ``op`` is answered only when refused (its reply
    is then this request's "ok"), else None. The SYNC takes the id ``-req_id``."""
    ack = fields.pop("ack", 0)
    frame = encode_request(_pack, store_header(op, req_id, fields, ack), payload)
    if CODES[op] not in NO_REPLY:
        return frame, None
    return frame + encode_request(_pack, [SYNC, -req_id]), -req_id
