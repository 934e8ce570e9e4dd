"""MemberTable: the join's member table kept as the coordinator's bytes and decoded once, on
first use, into Members sorted by rank; malformed tables fail with ProtocolError then."""

from __future__ import annotations

import msgpack
import pytest
from aiocoll.client.control.session import Member, MemberTable

from aiocoll import ProtocolError

pytestmark = pytest.mark.timeout(20)


def _raw(entries: list[dict[str, object]]) -> bytes:
    return bytes(msgpack.packb(entries, use_bin_type=True))


def test_a_table_decodes_on_first_use_into_members_sorted_by_rank() -> None:
    table = MemberTable(
        _raw(
            [
                {"rank": 1, "addrs": [["10.0.0.2", 7001]], "host": "b"},
                {"rank": 0, "addrs": [["10.0.0.1", 7000], ["::1", 7000]], "host": "a"},
            ]
        )
    )
    assert table._members is None, "nothing is decoded before first use"
    assert len(table) == 2
    assert table[0] == Member(0, [("10.0.0.1", 7000), ("::1", 7000)], "a")
    assert [m.rank for m in table] == [0, 1] and table[1].host == "b"
    assert table[1].addrs == [("10.0.0.2", 7001)]
    first = Member(0, [("10.0.0.1", 7000), ("::1", 7000)], "a")
    assert table == [first, Member(1, [("10.0.0.2", 7001)], "b")]
    same = [
        {"rank": 0, "addrs": [["10.0.0.1", 7000], ["::1", 7000]], "host": "a"},
        {"rank": 1, "addrs": [["10.0.0.2", 7001]], "host": "b"},
    ]
    assert table == MemberTable(_raw(same))
    assert table != MemberTable(_raw([{"rank": 0, "addrs": [], "host": "a"}]))
    assert {m.rank: m.addrs for m in table}[1] == [("10.0.0.2", 7001)]


@pytest.mark.parametrize(
    "entries",
    [
        [{"rank": "0", "addrs": [], "host": "a"}],
        [{"rank": 0, "addrs": [["h"]], "host": "a"}],
        [{"rank": 0, "addrs": [["h", "port"]], "host": "a"}],
        [{"addrs": [], "host": "a"}],
        [{"rank": 0, "addrs": [], "host": 5}],
        {"rank": 0},
    ],
)
def test_a_malformed_table_raises_protocol_error_when_used(entries: object) -> None:
    table = MemberTable(bytes(msgpack.packb(entries, use_bin_type=True)))
    with pytest.raises(ProtocolError, match="member table"):
        list(table)


def test_undecodable_bytes_raise_protocol_error_when_used() -> None:
    table = MemberTable(b"\xc1\xc1")
    with pytest.raises(ProtocolError, match="undecodable member table"):
        len(table)
