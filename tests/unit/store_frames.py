"""Store requests by name sent to ``CoordinatorState`` itself, and its frames taken back as the
maps the state-machine tests assert on (aiocoll.testing.store_frames does the encoding). Shared by
the tests that drive the state machine directly (test_server_state, test_server_dedupe).

SET, APPEND and MSET are answered only when refused; a later reply on the same connection
acknowledges them. ``StateDriver.send`` therefore follows each of them with a SYNC and reads the
SYNC's reply as that request's own "ok" (dropping it when the request was refused): exactly what
a client does to learn that its set was applied.
"""

from __future__ import annotations

from typing import Any

from aiocoll.server import CoordinatorState
from aiocoll.server._state import EncodedHeader

from aiocoll.protocol._store import ERROR, NO_REPLY, SYNC
from aiocoll.testing.store_frames import CODES, as_map, store_header


class StateDriver:
    """Sends requests by name to a CoordinatorState and takes its frames as maps."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self.ops: dict[tuple[int, int], str] = {}  # (conn, request id) -> op, to read replies
        self.syncs: dict[tuple[int, int], int] = {}  # (conn, SYNC id) -> the no-reply request's id

    def send(self, conn: int, op: str, payload: bytes = b"", **fields: Any) -> None:
        req_id = fields.pop("id", 7)
        rid = fields.pop("rid", None)
        ack = fields.pop("ack", 0)
        if op not in CODES:
            self.state.request(conn, {"op": op, "id": req_id, **fields}, payload)
            return
        if rid is not None:
            req_id = rid  # a numbered mutation's id is its number
        self.ops[(conn, req_id)] = op
        self.state.request(conn, store_header(op, req_id, fields, ack), payload)
        if CODES[op] in NO_REPLY:
            sync_id = -(len(self.syncs) + 1)  # ids of their own, apart from the tests'
            self.syncs[(conn, sync_id)] = req_id
            self.state.request(conn, [SYNC, sync_id], b"")

    def take(self, conn: int | None = None) -> list[tuple[dict[str, Any], bytes]]:
        """Take the frames sent (to ``conn`` only, when given) since they were last taken."""
        outbox = self.state.outbox
        taken = []
        refused: set[tuple[int, int]] = set()
        for c, h, p in outbox:
            if conn is not None and c != conn:
                continue
            if type(h) is list:
                sync_of = self.syncs.pop((c, h[0]), None)
                if sync_of is not None:  # the acknowledgement of a SET/APPEND/MSET
                    if (c, sync_of) not in refused:
                        taken.append(({"id": sync_of, "ok": True}, b""))
                    continue
                if h[1] == ERROR:
                    refused.add((c, h[0]))
                taken.append((as_map(self.ops.get((c, h[0]), ""), h), bytes(p)))
            else:
                taken.append((h.decode() if isinstance(h, EncodedHeader) else h, bytes(p)))
        outbox[:] = [f for f in outbox if conn is not None and f[0] != conn]
        return taken
