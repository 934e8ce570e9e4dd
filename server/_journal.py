"""The coordinator's durable storage in ``--state-dir``: an append-only journal of acknowledged
mutations plus periodic snapshots. Blocking file I/O only (the asyncio shell calls the writing
methods from a worker thread); imports msgpack and the standard library, nothing above.

Layout of the state directory::

    snapshot        msgpack {"seq": S, "state": CoordinatorState.snapshot()}, replaced atomically
    journal         records, each  u32 length | u32 crc32 | msgpack [seq, record]

A record is written and fsynced before the mutation it describes is acknowledged (see
docs/COORDINATOR.md). Loading reads the snapshot, then replays journal records with seq > S; a torn
or corrupt tail (a crash mid-write, never acknowledged) is cut off. Installing a snapshot writes it
to a temporary file, fsyncs, renames it over the old one, fsyncs the directory, and only then
empties the journal; a crash between the rename and the truncation is harmless because records
at or below the snapshot's seq are skipped on replay.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Any

import msgpack

__all__ = ["Journal"]

log = logging.getLogger("aiocoll.server")

_RECORD = struct.Struct("!II")
# A single record holds at most a few values of max_value_bytes; anything claiming more than this
# is corruption, not data.
_MAX_RECORD = 1 << 34
SNAPSHOT_AFTER_BYTES = 64 * 1024 * 1024
SNAPSHOT_AFTER_RECORDS = 200_000


class Journal:
    """Append-only journal and snapshots in one directory.

    Args:
        path: the state directory (created if missing).
        snapshot_after_bytes, snapshot_after_records: journal size that makes ``snapshot_due`` true.
    """

    def __init__(
        self,
        path: str,
        *,
        snapshot_after_bytes: int = SNAPSHOT_AFTER_BYTES,
        snapshot_after_records: int = SNAPSHOT_AFTER_RECORDS,
    ) -> None:
        self.path = os.path.abspath(path)
        os.makedirs(self.path, exist_ok=True)
        self._snap_path = os.path.join(self.path, "snapshot")
        self._journal_path = os.path.join(self.path, "journal")
        self.seq = 0  # last seq handed out
        self._journal_bytes = 0
        self._journal_records = 0
        self._snapshot_after_bytes = snapshot_after_bytes
        self._snapshot_after_records = snapshot_after_records
        self._fd: int | None = None

    def load(self) -> tuple[dict[str, Any] | None, list[list[Any]]]:
        """Read the snapshot and the journal records after it; open the journal for appending.

        Returns:
            (snapshot state or None, records to replay in order).
        Raises:
            ValueError: the snapshot file is unreadable (refuse to start rather than lose state).
        """
        snap_state: dict[str, Any] | None = None
        snap_seq = 0
        if os.path.exists(self._snap_path):
            with open(self._snap_path, "rb") as f:
                raw = f.read()
            try:
                snap = msgpack.unpackb(raw, raw=False, strict_map_key=False)
                snap_seq, snap_state = int(snap["seq"]), snap["state"]
            except Exception as exc:
                raise ValueError(
                    f"coordinator snapshot {self._snap_path} is unreadable ({exc}); move it "
                    f"away to start empty, or restore it from a backup"
                ) from exc
        records: list[list[Any]] = []
        good_end = 0
        last_seq = snap_seq
        if os.path.exists(self._journal_path):
            with open(self._journal_path, "rb") as f:
                data = f.read()
            pos = 0
            while pos + _RECORD.size <= len(data):
                length, crc = _RECORD.unpack_from(data, pos)
                body = data[pos + _RECORD.size : pos + _RECORD.size + length]
                if length > _MAX_RECORD or len(body) != length or zlib.crc32(body) != crc:
                    break
                try:
                    seq, rec = msgpack.unpackb(body, raw=False, strict_map_key=False)
                except Exception:
                    break
                pos += _RECORD.size + length
                good_end = pos
                if seq > snap_seq:
                    records.append(rec)
                    last_seq = max(last_seq, seq)
                self._journal_records += 1
            if good_end != len(data):
                log.warning(
                    "event=journal_tail_cut path=%s kept_bytes=%d dropped_bytes=%d reason=torn or "
                    "corrupt record (written by a crash before it was acknowledged)",
                    self._journal_path,
                    good_end,
                    len(data) - good_end,
                )
        self.seq = last_seq
        self._fd = os.open(self._journal_path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.ftruncate(self._fd, good_end)
        os.lseek(self._fd, good_end, os.SEEK_SET)
        self._journal_bytes = good_end
        _fsync_dir(self.path)
        return snap_state, records

    def encode(self, records: list[list[Any]]) -> bytes:
        """Serialise records (assigning seqs); call on the loop thread, in mutation order."""
        parts = []
        for rec in records:
            self.seq += 1
            body = msgpack.packb([self.seq, rec], use_bin_type=True)
            parts.append(_RECORD.pack(len(body), zlib.crc32(body)))
            parts.append(body)
        self._journal_records += len(records)
        return b"".join(parts)

    def write(self, data: bytes) -> None:
        """Append encoded records and fsync (blocking: run it in a worker thread)."""
        assert self._fd is not None, "load() first"
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        os.fsync(self._fd)
        self._journal_bytes += len(data)

    def snapshot_due(self) -> bool:
        return (
            self._journal_bytes >= self._snapshot_after_bytes
            or self._journal_records >= self._snapshot_after_records
        )

    def encode_snapshot(self, state: dict[str, Any]) -> bytes:
        """Serialise a snapshot covering every record encoded so far (call on the loop thread)."""
        return msgpack.packb({"seq": self.seq, "state": state}, use_bin_type=True)

    def install_snapshot(self, blob: bytes) -> None:
        """Atomically replace the snapshot, then empty the journal (blocking: worker thread).

        Every record encoded before ``encode_snapshot`` must already be written.
        """
        assert self._fd is not None, "load() first"
        tmp = self._snap_path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snap_path)
        _fsync_dir(self.path)
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.fsync(self._fd)
        self._journal_bytes = 0
        self._journal_records = 0

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
