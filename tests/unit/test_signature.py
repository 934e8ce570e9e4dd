"""aiocoll._signature.pack: the bytes the arenas publish beside a step (seq, length, msgpack)."""

from __future__ import annotations

import struct

import msgpack

from aiocoll import _signature


def test_a_packed_signature_is_its_seq_length_and_msgpack_bytes_and_unpacks_with_its_seq() -> None:
    meta = {"kind": "all_reduce", "dtype": "float32", "count": 3, "op": "sum"}
    body = msgpack.packb(meta, use_bin_type=True)
    for seq in (0, 7, 2**40):  # the second call of one dict takes its kept packing
        packed = _signature.pack(seq, meta)
        assert packed == struct.pack("<qH", seq, len(body)) + body
        assert _signature.unpack(packed) == {**meta, "seq": seq}


def test_each_dict_is_packed_as_it_reads_and_a_large_one_as_a_digest() -> None:
    first = {"kind": "broadcast", "root": 0}
    other = {"kind": "broadcast", "root": 1}
    assert _signature.pack(1, first) != _signature.pack(1, other)
    assert _signature.pack(1, dict(first)) == _signature.pack(1, first)
    large = {"kind": "new_group", "ranks": list(range(300))}
    packed = _signature.pack(5, large)
    assert len(packed) <= _signature.PACKED_BYTES
    assert set(_signature.unpack(packed)) == {"digest", "seq"}
