"""FileStore: a store in one shared file, usable by several processes at once (torch's file://).

Imports only the store base and _errors. The file is a log of appended records (set, append,
delete, user count) guarded by ``fcntl.flock``: a writer appends whole records under an exclusive
lock, a reader replays what is new under a shared lock. flock (not lockf) because its locks
belong to the open file, so two FileStores on one path in the same process exclude each other.
The lock is taken with LOCK_NB and retried with backoff under the deadline, so a stuck holder
gives a clear error instead of freezing the event loop. Waits poll the file's size with backoff.

Cleanup follows torch: each FileStore counts itself in the file while open; ``aclose`` counts
itself out, and the last user removes the file — once ``world_size`` users have closed, when
a world size was given, or when no user is left otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import os
import struct
import time
from collections.abc import AsyncIterator, Sequence

from .._errors import StoreError, StoreTimeout
from ._base import (
    DEFAULT_TIMEOUT,
    LocalStore,
    Value,
    check_amount,
    check_key,
    check_keys,
    compare_set_result,
    parse_counter,
    to_value,
)

__all__ = ["FileStore"]

# record: kind (1 byte), key length (u32), value length (u64), key, value
_RECORD = struct.Struct("!cIQ")
_SET, _APPEND, _DELETE, _USERS, _FINISHED = b"S", b"A", b"D", b"U", b"F"
_POLL_FIRST = 0.001
_POLL_MAX = 0.05


class FileStore(LocalStore):
    """A store kept in the file at ``path``, shared by every process that opens the same path.

    Use ``await FileStore.open(path)`` or ``FileStore(path)`` (the file is opened on first use).
    ``num_keys`` counts every key in the file. Values live in memory in each user, and the file
    only grows (deletes append a record), as torch's FileStore does.

    Args:
        path: the shared file; created when missing (mode 0600).
        world_size: how many users will close it; the file is removed once that many have
            closed and none is open. -1 (default): removed when the last open user closes.
        timeout: default wait of get/multi_get/wait, in seconds.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        world_size: int = -1,
        *,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(timeout)
        self.path = os.fspath(path)
        self.world_size = world_size
        self._fd: int | None = None
        self._offset = 0
        self._users = 0
        self._finished = 0
        self._closed = False
        self._opening: asyncio.Lock | None = None

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        world_size: int = -1,
        *,
        timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> FileStore:
        """Create a FileStore and register it as a user of the file now.

        Raises:
            OSError: when the file cannot be created or opened.
        """
        store = cls(path, world_size, timeout=timeout)
        await store._ensure_open()
        return store

    # -- file plumbing -------------------------------------------------------------------
    async def _ensure_open(self) -> int:
        if self._closed:
            raise StoreError(f"FileStore({self.path!r}) is closed")
        if self._fd is not None:
            return self._fd
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._fd is not None:
                return self._fd
            deadline = time.monotonic() + self.timeout
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
                try:
                    await self._flock(fd, fcntl.LOCK_EX, deadline)
                    try:
                        # The last user may have removed the path between our open and our lock:
                        # then we hold a dead inode and must open the new file instead.
                        try:
                            same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
                        except FileNotFoundError:
                            same = False
                        if same:
                            self._fd = fd
                            self._replay()
                            self._write(_USERS, "", b"1")
                            return fd
                    finally:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                except BaseException:
                    if self._fd != fd:
                        os.close(fd)
                    raise
                os.close(fd)

    async def _flock(self, fd: int, mode: int, deadline: float) -> None:
        delay = _POLL_FIRST
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreError(
                        f"could not lock the FileStore file {self.path!r} within {self.timeout:.3g}s: "
                        f"another process holds it; check for a stuck process using the same file"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, _POLL_MAX)

    @contextlib.asynccontextmanager
    async def _locked(self, exclusive: bool) -> AsyncIterator[None]:
        """Hold the file lock with the log replayed; the body must not await (it runs atomically)."""
        fd = await self._ensure_open()
        await self._flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, time.monotonic() + self.timeout)
        try:
            self._replay()
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _replay(self) -> None:
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        data = os.pread(self._fd, size - self._offset, self._offset)
        view = memoryview(data)
        pos = 0
        while pos + _RECORD.size <= len(view):
            kind, klen, vlen = _RECORD.unpack_from(view, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > len(view):
                break
            key = bytes(view[pos + _RECORD.size : pos + _RECORD.size + klen]).decode("utf-8", "surrogatepass")
            value = bytes(view[pos + _RECORD.size + klen : end])
            self._apply(kind, key, value)
            pos = end
        if pos != len(view):
            raise StoreError(
                f"the FileStore file {self.path!r} ends in a torn record at byte {self._offset + pos}: "
                f"it was written by something other than aiocoll's FileStore, or truncated"
            )
        self._offset += pos

    def _apply(self, kind: bytes, key: str, value: bytes) -> None:
        if kind == _SET:
            self._data[key] = value
        elif kind == _APPEND:
            self._data[key] = self._data.get(key, b"") + value
        elif kind == _DELETE:
            self._data.pop(key, None)
        elif kind == _USERS:
            self._users += int(value)
        elif kind == _FINISHED:
            self._finished += int(value)
        else:
            raise StoreError(f"the FileStore file {self.path!r} holds an unknown record kind {kind!r}")

    def _write(self, kind: bytes, key: str, value: bytes) -> None:
        """Append one record and apply it to this user's view of the data, as replay would.

        The caller holds the exclusive lock and has replayed the log.
        """
        assert self._fd is not None
        raw_key = key.encode("utf-8", "surrogatepass")
        record = memoryview(_RECORD.pack(kind, len(raw_key), len(value)) + raw_key + value)
        while record:
            written = os.write(self._fd, record)
            record = record[written:]
        self._offset = os.fstat(self._fd).st_size
        self._apply(kind, key, value)

    async def _wait_for(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = _POLL_FIRST
        while True:
            fd = await self._ensure_open()
            if os.fstat(fd).st_size > self._offset:
                async with self._locked(exclusive=False):
                    pass
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreTimeout(missing, timeout)
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)

    # -- Store ---------------------------------------------------------------------------
    async def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        raw = to_value(key, value)
        async with self._locked(exclusive=True):
            self._write(_SET, key, raw)

    async def add(self, key: str, amount: int) -> int:
        key = check_key(key)
        amount = check_amount(key, amount)
        async with self._locked(exclusive=True):
            result = parse_counter(key, self._data.get(key)) + amount
            raw = str(result).encode("ascii")
            self._write(_SET, key, raw)
        return result

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        exp = to_value(key, expected, "expected value")
        des = to_value(key, desired, "desired value")
        async with self._locked(exclusive=True):
            result, store = compare_set_result(self._data.get(key), exp, des)
            if store:
                self._write(_SET, key, des)
        return result

    async def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        async with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    async def delete_key(self, key: str) -> bool:
        key = check_key(key)
        async with self._locked(exclusive=True):
            if key not in self._data:
                return False
            self._write(_DELETE, key, b"")
            return True

    async def num_keys(self) -> int:
        async with self._locked(exclusive=False):
            return len(self._data)

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        pairs = list(zip(*self._pair(keys, values), strict=True))
        async with self._locked(exclusive=True):
            for key, raw in pairs:
                self._write(_SET, key, raw)

    async def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        raw = to_value(key, value)
        async with self._locked(exclusive=True):
            self._write(_APPEND, key, raw)

    async def aclose(self) -> None:
        """Count this user out of the file; the last user removes it. Twice is fine."""
        if self._closed:
            return
        fd = self._fd
        if fd is None:
            self._closed = True
            return
        try:
            async with self._locked(exclusive=True):
                self._write(_USERS, "", b"-1")
                self._write(_FINISHED, "", b"1")
                if self._users <= 0 and (self.world_size <= 0 or self._finished >= self.world_size):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)
        finally:
            self._closed = True
            self._fd = None
            os.close(fd)

    def __repr__(self) -> str:
        return f"FileStore({self.path!r}, world_size={self.world_size})"
