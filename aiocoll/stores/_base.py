"""The async Store interface and the argument checks every store shares.

Imports only foundations (_errors, _deadline, protocol constants): stores sit beside the protocol
layer so that the client, the public API and the tests can all use them. This module exists so
that every store — in memory, file, prefix, coordinator — validates keys and values the same way
and raises the same errors, which the conformance suite (aiocoll.testing.store_conformance) checks.
"""

from __future__ import annotations

import abc
import datetime
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from .._deadline import to_seconds
from .._errors import StoreError
from ..protocol._coordinator import MAX_KEY_BYTES, SHORT_KEY_LENGTHS

__all__ = [
    "DEFAULT_TIMEOUT",
    "LocalStore",
    "Store",
    "Value",
    "check_amount",
    "check_key",
    "check_keys",
    "compare_set_result",
    "pair_values",
    "parse_counter",
    "to_value",
]

DEFAULT_TIMEOUT = 300.0

Value = bytes | bytearray | memoryview | str


def check_key(key: object) -> str:
    """Return ``key`` if it is a valid store key.

    Raises:
        TypeError: when the key is not a str.
        ValueError: when it is empty or longer than MAX_KEY_BYTES UTF-8 bytes.
    """
    if type(key) is str and len(key) in SHORT_KEY_LENGTHS:
        return key  # at most 4 UTF-8 bytes a character: no need to encode it to know
    if not isinstance(key, str):
        raise TypeError(f"store key {key!r} must be a str, not {type(key).__name__}")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size == 0 or size > MAX_KEY_BYTES:
        raise ValueError(f"store key {key[:64]!r} must be 1..{MAX_KEY_BYTES} UTF-8 bytes long, not {size}")
    return key


def check_keys(keys: object) -> list[str]:
    """Return ``keys`` as a list of valid keys; a lone str is refused (it would iterate characters).

    Raises:
        TypeError: when keys is a str or bytes, not iterable, or holds a non-str key.
    """
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise TypeError(f"store keys must be a list of str, not {type(keys).__name__} ({keys!r:.80})")
    return [check_key(k) for k in keys]


def to_value(key: str, value: object, what: str = "value") -> bytes:
    """Store values are bytes; a str is encoded as UTF-8.

    Raises:
        TypeError: naming ``key`` when the value is neither bytes-like nor str.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{what} for store key {key!r} must be bytes or str, not {type(value).__name__}")


def check_amount(key: str, amount: object) -> int:
    """Raises TypeError naming ``key`` when ``amount`` is not an int (bool is refused too)."""
    if type(amount) is int:  # the common case, in one test
        return amount
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise TypeError(f"amount added to store key {key!r} must be an int, not {type(amount).__name__}")
    return amount


def parse_counter(key: str, current: bytes | None) -> int:
    """The integer a counter key holds (absent counts as 0), as torch's add stores it: ASCII decimal.

    Raises:
        StoreError: when the key holds something that is not an integer.
    """
    if current is None:
        return 0
    try:
        return int(current.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StoreError(
            f"store key {key!r} holds {current[:32]!r}, not an integer: add() works only on keys "
            f"that were created by add() or hold an ASCII decimal integer"
        ) from None


def compare_set_result(current: bytes | None, expected: bytes, desired: bytes) -> tuple[bytes, bool]:
    """Torch's compareSet rule; returns (the reply value, whether to store ``desired``)."""
    if current is None:
        if expected == b"":
            return desired, True
        return expected, False
    if current == expected:
        return desired, True
    return current, False


class Store(abc.ABC):
    """An async key-value store shared by the ranks of a job (torch.distributed.Store, awaitable).

    Values are bytes (a str value is encoded as UTF-8). ``get``, ``multi_get`` and ``wait`` wait for
    keys that do not exist yet, up to ``timeout`` seconds, then raise StoreTimeout naming the keys.

    Attributes:
        timeout: seconds a waiting operation waits by default (torch's ``store.timeout``).
    """

    def __init__(self, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        self._timeout = self._check_timeout(timeout)

    @staticmethod
    def _check_timeout(timeout: float | datetime.timedelta | None) -> float:
        seconds = to_seconds(timeout)
        if seconds is None:
            raise ValueError("a store needs a finite timeout (every wait has a deadline); got None")
        return seconds

    @property
    def timeout(self) -> float:
        return self._timeout

    @timeout.setter
    def timeout(self, value: float | datetime.timedelta) -> None:
        self._timeout = self._check_timeout(value)

    def set_timeout(self, timeout: float | datetime.timedelta) -> None:
        """Change the default wait of get/multi_get/wait (as torch's ``Store.set_timeout``).

        Raises:
            ValueError: for a negative timeout or None.
        """
        self.timeout = timeout

    def _wait_timeout(self, timeout: float | datetime.timedelta | None) -> float:
        return self._timeout if timeout is None else self._check_timeout(timeout)

    @abc.abstractmethod
    async def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, replacing any value there.

        Raises:
            TypeError: for a non-str key or a value that is neither bytes nor str.
        """

    @abc.abstractmethod
    async def get(self, key: str) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to be set.

        Raises:
            StoreTimeout: when the key was not set in time (``keys`` names it).
        """

    @abc.abstractmethod
    async def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer at ``key`` (absent counts as 0); returns the new value.

        Raises:
            TypeError: when amount is not an int. StoreError: when the key holds a non-integer.
        """

    @abc.abstractmethod
    async def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected`` (or is missing and expected is empty).

        Returns:
            The value now stored; or ``expected`` when the key is missing and expected is not empty.
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        """Wait until every key exists; ``timeout`` None means the store's timeout.

        Raises:
            StoreTimeout: naming the keys still missing.
        """

    @abc.abstractmethod
    async def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists (does not wait)."""

    @abc.abstractmethod
    async def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    async def num_keys(self) -> int:
        """The number of keys in the store (see each store for what it counts)."""

    @abc.abstractmethod
    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting up to ``timeout`` for all of them.

        Raises:
            StoreTimeout: naming the keys still missing.
        """

    @abc.abstractmethod
    async def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set several keys at once.

        Raises:
            ValueError: when keys and values differ in length.
        """

    @abc.abstractmethod
    async def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the bytes at ``key``, creating it when missing."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release the store's resources; calling it twice is fine."""

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def _pair(self, keys: Sequence[str], values: Sequence[Any]) -> tuple[list[str], list[bytes]]:
        return pair_values(keys, values)


def pair_values(keys: Sequence[str], values: Sequence[Any]) -> tuple[list[str], list[bytes]]:
    """multi_set's arguments checked: the keys, and each value as bytes.

    Raises:
        TypeError: values is not a list, or holds something that is not bytes or str.
        ValueError: a key is invalid, or the lists differ in length.
    """
    keys = check_keys(keys)
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"multi_set values must be a list, not {type(values).__name__}")
    if len(keys) != len(values):
        raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
    return keys, [to_value(k, v) for k, v in zip(keys, values, strict=True)]


class LocalStore(Store):
    """A store whose values this process holds in ``_data`` (MemoryStore, FileStore).

    The reads that wait (get, multi_get, wait) are the same for every such store once it can wait
    for keys to appear in ``_data``; each subclass says how with ``_wait_for``.
    """

    def __init__(self, timeout: float | datetime.timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}

    @abc.abstractmethod
    async def _wait_for(self, keys: list[str], timeout: float) -> None:
        """Return once every key is in ``_data``.

        Raises:
            StoreTimeout: naming the keys still missing after ``timeout`` seconds.
        """

    async def get(self, key: str) -> bytes:
        key = check_key(key)
        await self._wait_for([key], self.timeout)
        return self._data[key]

    async def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        await self._wait_for(check_keys(keys), self._wait_timeout(timeout))

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        await self._wait_for(keys, self.timeout)
        return [self._data[k] for k in keys]
