"""MemoryStore: an in-process store on asyncio (torch's HashStore, awaitable).

Imports only the store base and _errors. It exists for single-process worlds and tests, and as
the reference behaviour the conformance suite holds the other stores to. Use it from one event
loop (the loop that first waits on it).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Sequence

from .._errors import StoreTimeout
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

__all__ = ["MemoryStore"]


class MemoryStore(LocalStore):
    """A dict with waits. ``num_keys`` counts every key.

    Args:
        timeout: default wait of get/multi_get/wait, in seconds.
    """

    def __init__(self, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        # Every mutation sets this event and replaces it, waking all waiters to re-check their
        # keys: simple, and waiters are few (ranks of one process), so re-checking is cheap.
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_for(self, keys: list[str], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise StoreTimeout(missing, timeout)
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def set(self, key: str, value: Value) -> None:
        key = check_key(key)
        self._data[key] = to_value(key, value)
        self._notify()

    async def add(self, key: str, amount: int) -> int:
        key = check_key(key)
        amount = check_amount(key, amount)
        result = parse_counter(key, self._data.get(key)) + amount
        self._data[key] = str(result).encode("ascii")
        self._notify()
        return result

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        key = check_key(key)
        exp = to_value(key, expected, "expected value")
        des = to_value(key, desired, "desired value")
        result, store = compare_set_result(self._data.get(key), exp, des)
        if store:
            self._data[key] = des
            self._notify()
        return result

    async def check(self, keys: Sequence[str]) -> bool:
        return all(k in self._data for k in check_keys(keys))

    async def delete_key(self, key: str) -> bool:
        key = check_key(key)
        existed = self._data.pop(key, None) is not None
        if existed:
            self._notify()
        return existed

    async def num_keys(self) -> int:
        return len(self._data)

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        pairs = self._pair(keys, values)
        self._data.update(zip(*pairs, strict=True))
        self._notify()

    async def append(self, key: str, value: Value) -> None:
        key = check_key(key)
        self._data[key] = self._data.get(key, b"") + to_value(key, value)
        self._notify()

    async def aclose(self) -> None:
        """Nothing to release; the data stays readable (torch's HashStore has no close)."""
