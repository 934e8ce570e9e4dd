"""PrefixStore: a view of another store with every key under ``prefix/`` (torch's PrefixStore).

Imports only the store base. Process groups use it to give each group its own key space inside
the job's store without a second connection.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from ._base import Store, Value, check_amount, check_key, check_keys, to_value

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Forward every operation to ``store`` with keys renamed ``f"{prefix}/{key}"``.

    The timeout is the wrapped store's (reading or setting it here reads or sets it there).
    ``num_keys`` returns the wrapped store's count of all keys, prefixed or not, as torch's
    PrefixStore does. ``aclose`` does not close the wrapped store, which the caller owns.

    Args:
        prefix: a non-empty str. store: the store to forward to.

    Raises:
        TypeError: when prefix is not a str or store is not a Store.
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str) or not prefix:
            raise TypeError(f"PrefixStore prefix must be a non-empty str, got {prefix!r}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore wraps an aiocoll Store, not {type(store).__name__}")
        # Store.__init__ is not called: the timeout lives in the wrapped store.
        self.prefix = prefix
        self.underlying_store = store

    @property
    def timeout(self) -> float:
        return self.underlying_store.timeout

    @timeout.setter
    def timeout(self, value: float | datetime.timedelta) -> None:
        self.underlying_store.timeout = value

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def _ks(self, keys: Sequence[str]) -> list[str]:
        return [f"{self.prefix}/{k}" for k in check_keys(keys)]

    def _unprefix(self, exc: BaseException) -> None:
        # Errors from the wrapped store name the full keys; name the caller's keys instead.
        keys = getattr(exc, "keys", None)
        if isinstance(keys, list):
            cut = len(self.prefix) + 1
            exc.keys = [k[cut:] if k.startswith(self.prefix + "/") else k for k in keys]  # type: ignore[attr-defined]

    async def set(self, key: str, value: Value) -> None:
        # Values are checked here so that errors name the caller's key, not the prefixed one.
        await self.underlying_store.set(self._k(key), to_value(key, value))

    async def get(self, key: str) -> bytes:
        try:
            return await self.underlying_store.get(self._k(key))
        except Exception as exc:
            self._unprefix(exc)
            raise

    async def add(self, key: str, amount: int) -> int:
        full = self._k(key)
        return await self.underlying_store.add(full, check_amount(key, amount))

    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        full = self._k(key)
        return await self.underlying_store.compare_set(
            full, to_value(key, expected, "expected value"), to_value(key, desired, "desired value")
        )

    async def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        try:
            await self.underlying_store.wait(self._ks(keys), timeout)
        except Exception as exc:
            self._unprefix(exc)
            raise

    async def check(self, keys: Sequence[str]) -> bool:
        return await self.underlying_store.check(self._ks(keys))

    async def delete_key(self, key: str) -> bool:
        return await self.underlying_store.delete_key(self._k(key))

    async def num_keys(self) -> int:
        return await self.underlying_store.num_keys()

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        try:
            return await self.underlying_store.multi_get(self._ks(keys))
        except Exception as exc:
            self._unprefix(exc)
            raise

    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        keys, raw = self._pair(keys, values)
        await self.underlying_store.multi_set([f"{self.prefix}/{k}" for k in keys], raw)

    async def append(self, key: str, value: Value) -> None:
        full = self._k(key)
        await self.underlying_store.append(full, to_value(key, value))

    async def aclose(self) -> None:
        """Nothing to release: the wrapped store belongs to the caller."""

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.underlying_store!r})"
