"""The member table of a completed round, as the coordinator sends it: encoded once for everyone
(msgpack, sorted by rank, with a BLAKE2b-128 digest), a slice of it by rank, and the join reply
of a one-member join in its three forms. Pure encoding: imports _model and msgpack only.

Why here: every member of a round reads the same table, so it is encoded once (a 10,000-member
table is ~0.5 MB, and encoding it per member would cost seconds), and large jobs read slices of it
(the ranks their links need) instead of all of it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import msgpack

from ._model import EncodedHeader

__all__ = ["encode_rows", "one_member_reply", "table_digest"]

_MEMBERS_KEY = msgpack.packb("members", use_bin_type=True)


def encode_rows(members: Iterable[Any]) -> bytes:
    """The msgpack list of ``{rank, addrs, host}`` rows of ``members`` (in the order given)."""
    return msgpack.packb(
        [{"rank": m.rank, "addrs": m.addrs, "host": m.host} for m in members], use_bin_type=True
    )


def table_digest(table: bytes) -> bytes:
    return hashlib.blake2b(table, digest_size=16).digest()


def one_member_reply(
    fields: dict[str, Any], table: bytes, digest: bytes, *, ref: bool, in_payload: bool
) -> tuple[EncodedHeader, bytes]:
    """The reply to a one-member join: ``fields`` (id, ok, rank, world_size, round, session, and
    beat for a round of many connections) with the table by reference (digest and size: the
    client may hold it already, else it asks with ``table``), as the payload (with its digest, so
    the client need not hash it), or inline in the header under "members". Returns (header,
    payload); the table is not copied."""
    head = msgpack.packb(fields, use_bin_type=True)
    n = len(fields)
    assert n <= 13 and head[0] == 0x80 | n, "a fixmap, extended below by changing its first byte"
    if ref:
        extra = msgpack.packb({"table_digest": digest, "table_size": len(table)}, use_bin_type=True)
        return EncodedHeader((bytes((0x80 | n + 2,)) + head[1:], extra[1:])), b""
    if in_payload:
        digest_field = msgpack.packb("table_digest", use_bin_type=True) + msgpack.packb(
            digest, use_bin_type=True
        )
        return EncodedHeader((bytes((0x80 | n + 1,)) + head[1:], digest_field)), table
    return EncodedHeader((bytes((0x80 | n + 1,)) + head[1:], _MEMBERS_KEY, table)), b""  # the table inline
