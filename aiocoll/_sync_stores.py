"""Blocking torch-style stores over aiocoll's async stores, and the reverse adapter.

Holds ``TCPStore``, ``FileStore``, ``HashStore``, ``PrefixStore`` with torch.distributed's
constructors and methods (each call forwards to an async store on the loop thread), and
``BlockingStoreAdapter``, an async ``aiocoll.Store`` over any object with torch's store methods
(a ``torch.distributed.Store``) that calls it from worker threads. Imports aiocoll foundations
(stores, errors), the loop thread, and — only inside ``TCPStore`` — the coordinator and the
coordinator client; never torch, so it works in numpy-only processes.

It exists so that aiocoll.sync can offer torch's store classes and accept torch's stores, and so
that aiocoll.torch can rendezvous through the store torch hands a backend.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import os
import time
from collections.abc import Sequence
from typing import Any

from aiocoll._env import env_text

from ._deadline import to_seconds
from ._errors import DistError, StoreTimeout
from ._sync_loop import get_loop_thread
from .stores import DEFAULT_TIMEOUT
from .stores import FileStore as AsyncFileStore
from .stores import MemoryStore as AsyncMemoryStore
from .stores import PrefixStore as AsyncPrefixStore
from .stores import Store as AsyncStore
from .stores._base import check_keys

__all__ = [
    "BlockingStoreAdapter",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "Store",
    "TCPStore",
    "as_async_store",
]

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=DEFAULT_TIMEOUT)
# torch's TCPStore counts its workers in this key (so num_keys includes it, as in torch).
_INIT_KEY = "init/"
_WORKER_POLL = 0.01


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Store:
    """Base of the blocking stores: torch.distributed.Store's methods over an aiocoll Store.

    Values are returned as bytes; values passed in may be bytes or str. Waiting operations wait up
    to the store's timeout and then raise ``aiocoll.StoreTimeout`` naming the keys.
    """

    def __init__(self, async_store: AsyncStore) -> None:
        self._async = async_store

    @property
    def async_store(self) -> AsyncStore:
        """The aiocoll async store this one forwards to (lives on the aiocoll loop thread)."""
        return self._async

    def _run(self, coro: Any) -> Any:
        return get_loop_thread().run(coro)

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key``."""
        self._run(self._async.set(key, value))

    def get(self, key: str) -> bytes:
        """The value at ``key``, waiting up to the store's timeout for it.

        Raises:
            StoreTimeout: when the key was not set in time.
        """
        return self._run(self._async.get(key))

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key``; returns the new value."""
        return self._run(self._async.add(key, amount))

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Torch's compareSet: set ``desired_value`` if the key holds ``expected_value``."""
        return self._run(self._async.compare_set(key, expected_value, desired_value))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | float | None = None) -> None:
        """Wait until every key exists (up to ``timeout``, default the store's).

        Raises:
            StoreTimeout: naming the keys still missing.
        """
        self._run(self._async.wait(keys, timeout))

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists; does not wait."""
        return self._run(self._async.check(keys))

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True when it existed."""
        return self._run(self._async.delete_key(key))

    def num_keys(self) -> int:
        """The number of keys in the store."""
        return self._run(self._async.num_keys())

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting for all of them."""
        return self._run(self._async.multi_get(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set several keys at once."""
        self._run(self._async.multi_set(keys, values))

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (created when missing)."""
        self._run(self._async.append(key, value))

    def set_timeout(self, timeout: datetime.timedelta | float) -> None:
        """Change the default wait of get/multi_get/wait."""
        self._async.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        """The default wait, as a timedelta (torch's ``Store.timeout``)."""
        return _timedelta(self._async.timeout)

    def has_extended_api(self) -> bool:
        """True: append, multi_get and multi_set are supported."""
        return True

    def close(self) -> None:
        """Release the store's connection or file (idempotent)."""
        self._run(self._async.aclose())


class HashStore(Store):
    """An in-process store (torch's HashStore): for threads of one process and tests."""

    def __init__(self) -> None:
        super().__init__(get_loop_thread().call(AsyncMemoryStore))


class FileStore(Store):
    """A store in a shared file (torch's FileStore), usable by processes on one host.

    Args:
        file_name: the shared file. world_size: how many users close it before it is removed
            (-1: when the last open user closes).
    """

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        self.path = os.fspath(file_name)
        super().__init__(get_loop_thread().call(lambda: AsyncFileStore(self.path, world_size=world_size)))


class PrefixStore(Store):
    """Every key of ``store`` under ``prefix/`` (torch's PrefixStore).

    Args:
        prefix: a non-empty str. store: an aiocoll.sync store or a torch.distributed.Store.
    """

    def __init__(self, prefix: str, store: Any) -> None:
        self.underlying_store = store
        inner = as_async_store(store)
        super().__init__(get_loop_thread().call(lambda: AsyncPrefixStore(prefix, inner)))


class TCPStore(Store):
    """A store served by an aiocoll coordinator (torch's TCPStore).

    Calls go straight to the coordinator on a socket of this object's own, from the calling
    thread (client/control/_blocking_store.py): no hop to a loop thread. As with torch's TCPStore,
    ``set`` (and ``append``, ``multi_set``) sends the request and returns without waiting for an
    answer; this object's later calls see the value, and a refused set is raised by the next
    call that starts after the refusal arrived (at the latest by ``flush`` or ``close``). Any
    number of threads may share one.

    With ``is_master=True`` this process starts a coordinator on ``host_name:port`` (on the aiocoll
    loop thread; port 0 picks a free one, see ``.port``); every instance then connects to it as a
    client. When ``world_size`` is given and ``wait_for_workers`` is true, each instance counts
    itself in the key ``init/`` (as torch does) and the master waits until all have joined.

    Args:
        host_name: IP address or name of the master.
        port: the master's port.
        world_size: how many instances will connect (None: not counted).
        is_master: start the coordinator here.
        timeout: default wait, and the connect deadline.
        wait_for_workers: whether the master waits for ``world_size`` instances.
        multi_tenant: accepted for torch compatibility; ignored.
        master_listen_fd: accepted for torch compatibility; ignored.
        use_libuv: accepted for torch compatibility; ignored.
        token: aiocoll shared secret (default env ``AIOCOLL_TOKEN``).
        job: key space (default env ``AIOCOLL_JOB``).

    Raises:
        StoreTimeout: when the master did not see ``world_size`` workers within ``timeout``.
        OSError: when the master cannot listen on the address.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: datetime.timedelta | float = _DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        token: str | None = None,
        job: str | None = None,
    ) -> None:
        from aiocoll.client.control._blocking_store import BlockingStoreClient

        seconds = to_seconds(timeout)
        if seconds is None:
            raise ValueError("TCPStore needs a finite timeout")
        if token is None:  # the coordinator we start and our connection must agree on it
            token = env_text("AIOCOLL_TOKEN", strip=False)
        self.host = host_name
        self.libuvBackend = use_libuv
        self._coordinator: Any = None
        if is_master:
            self._coordinator, port = get_loop_thread().run(_start_coordinator(host_name, port, token))
        self.port = port
        try:
            self._client = BlockingStoreClient(
                host_name,
                port,
                token=token,
                job=job or env_text("AIOCOLL_JOB", strip=False) or "default",
                timeout=seconds,
            )
        except BaseException:
            self._stop_coordinator()
            raise
        self._adapter: BlockingStoreAdapter | None = None
        if world_size is not None and wait_for_workers:
            try:
                self._join_workers(world_size, is_master, seconds)
            except BaseException:
                self.close()
                raise

    def _join_workers(self, world_size: int, is_master: bool, timeout: float) -> None:
        joined = self._client.add(_INIT_KEY, 1)
        if not is_master:
            return
        deadline = time.monotonic() + timeout
        while joined < world_size:
            if time.monotonic() >= deadline:
                raise StoreTimeout(
                    [_INIT_KEY],
                    timeout,
                    f"TCPStore master timed out after {timeout:.3g}s waiting for workers: {joined} of "
                    f"{world_size} joined. Start the other ranks, or check world_size.",
                )
            time.sleep(_WORKER_POLL)
            joined = self._client.add(_INIT_KEY, 0)

    @property
    def async_store(self) -> AsyncStore:
        """An aiocoll async store over this one's connection.

        Its calls run on worker threads, so they keep this object's order of requests.
        """
        if self._adapter is None:
            self._adapter = BlockingStoreAdapter(self._client)
        return self._adapter

    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` under ``key`` (sent; not answered unless refused)."""
        self._client.set(key, value)

    def get(self, key: str) -> bytes:
        """The value at ``key``, waiting up to the store's timeout for it.

        Raises:
            StoreTimeout: when the key was not set in time.
        """
        return self._client.get(key)

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter at ``key``; returns the new value."""
        return self._client.add(key, amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Torch's compareSet: set ``desired_value`` if the key holds ``expected_value``."""
        return self._client.compare_set(key, expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | float | None = None) -> None:
        """Wait until every key exists (up to ``timeout``, default the store's).

        Raises:
            StoreTimeout: naming the keys still missing.
        """
        self._client.wait(keys, None if timeout is None else to_seconds(timeout))

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists; does not wait."""
        return self._client.check(keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True when it existed."""
        return self._client.delete_key(key)

    def num_keys(self) -> int:
        """The number of keys in the store."""
        return self._client.num_keys()

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``, waiting for all of them."""
        return self._client.multi_get(keys)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        """Set several keys at once (sent; not answered unless refused)."""
        self._client.multi_set(keys, values)

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes at ``key`` (created when missing; sent, not answered)."""
        self._client.append(key, value)

    def flush(self) -> None:
        """Wait until every set of this store is acknowledged by the coordinator.

        Raises:
            StoreError: a set was refused (too large, too many keys).
        """
        self._client.flush()

    def set_timeout(self, timeout: datetime.timedelta | float) -> None:
        """Change the default wait of get/multi_get/wait."""
        seconds = to_seconds(timeout)
        if seconds is None or seconds <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        self._client.timeout = seconds

    @property
    def timeout(self) -> datetime.timedelta:
        """The default wait, as a timedelta (torch's ``Store.timeout``)."""
        return _timedelta(self._client.timeout)

    def _stop_coordinator(self) -> None:
        if self._coordinator is not None:
            coordinator, self._coordinator = self._coordinator, None
            get_loop_thread().run(_stop(coordinator))

    def close(self) -> None:
        """Close the connection, after the sets not yet acknowledged; idempotent.

        On the master, this also stops the coordinator.
        """
        try:
            if self._adapter is not None:
                get_loop_thread().run(self._adapter.aclose())
            self._client.close()
        finally:
            self._stop_coordinator()


async def _start_coordinator(host: str, port: int, token: str | None) -> tuple[Any, int]:
    from aiocoll.server import Coordinator

    coordinator = Coordinator(host=host, port=port, token=token)
    await coordinator.start()
    return coordinator, int(coordinator.port)


async def _stop(coordinator: Any) -> None:
    await coordinator.stop()


def as_async_store(store: Any) -> AsyncStore:
    """The aiocoll async Store to use for ``store``.

    Args:
        store: an aiocoll.sync store (its async store is used), an aiocoll async Store (as is), or
            any object with torch.distributed.Store's methods (wrapped in BlockingStoreAdapter).

    Raises:
        TypeError: for anything else.
    """
    if isinstance(store, Store):
        return store.async_store
    if isinstance(store, AsyncStore):
        return store
    if all(callable(getattr(store, name, None)) for name in ("set", "get", "add", "wait", "check")):
        return BlockingStoreAdapter(store)
    raise TypeError(
        f"expected a store (aiocoll.sync.TCPStore/FileStore/HashStore/PrefixStore, an aiocoll.Store or "
        f"a torch.distributed.Store), not {type(store).__name__}"
    )


class BlockingStoreAdapter(AsyncStore):
    """An aiocoll async Store over a blocking store with torch's methods (e.g. torch's TCPStore).

    Each call runs on a small pool of worker threads so the event loop never blocks. The blocking
    store keeps its own default timeout; ``timeout``/``set_timeout`` read and set it. Its timeout
    errors become ``StoreTimeout`` naming the keys.

    Args:
        store: the blocking store (not closed by ``aclose``: the caller owns it).
    """

    # Waits block a thread each, so allow a few at once; torch's stores are thread-safe.
    _THREADS = 4

    def __init__(self, store: Any) -> None:
        self._blocking = store
        self._pool = concurrent.futures.ThreadPoolExecutor(self._THREADS, thread_name_prefix="aiocoll-store")
        self._closed = False

    @property
    def timeout(self) -> float:
        value = getattr(self._blocking, "timeout", None)
        seconds = to_seconds(value) if isinstance(value, (datetime.timedelta, int, float)) else None
        return DEFAULT_TIMEOUT if seconds is None else seconds

    @timeout.setter
    def timeout(self, value: float | datetime.timedelta) -> None:
        seconds = self._check_timeout(value)
        self._blocking.set_timeout(_timedelta(seconds))

    async def _call(self, keys: Sequence[str], fn: Any, *args: Any) -> Any:
        if self._closed:
            raise DistError("this store adapter was closed")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, fn, *args)
        except StoreTimeout:
            raise  # aiocoll's own (the sync TCPStore's): it names the keys still missing
        except Exception as exc:
            if _is_store_timeout(exc):
                raise StoreTimeout(list(keys), self.timeout, f"{exc} (store keys {list(keys)!r})") from exc
            raise

    async def set(self, key: str, value: Any) -> None:
        await self._call([key], self._blocking.set, key, value)

    async def get(self, key: str) -> bytes:
        return bytes(await self._call([key], self._blocking.get, key))

    async def add(self, key: str, amount: int) -> int:
        return int(await self._call([key], self._blocking.add, key, amount))

    async def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(await self._call([key], self._blocking.compare_set, key, expected, desired))

    async def wait(self, keys: Sequence[str], timeout: float | datetime.timedelta | None = None) -> None:
        keys = check_keys(keys)  # a lone str is refused, not waited for letter by letter
        if timeout is None:
            await self._call(keys, self._blocking.wait, keys)
        else:
            await self._call(keys, self._blocking.wait, keys, _timedelta(self._check_timeout(timeout)))

    async def check(self, keys: Sequence[str]) -> bool:
        keys = check_keys(keys)
        return bool(await self._call(keys, self._blocking.check, keys))

    async def delete_key(self, key: str) -> bool:
        return bool(await self._call([key], self._blocking.delete_key, key))

    async def num_keys(self) -> int:
        return int(await self._call([], self._blocking.num_keys))

    async def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = check_keys(keys)
        values = await self._call(keys, self._blocking.multi_get, keys)
        return [bytes(v) for v in values]

    async def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        keys, encoded = self._pair(keys, values)
        await self._call(keys, self._blocking.multi_set, keys, encoded)

    async def append(self, key: str, value: Any) -> None:
        await self._call([key], self._blocking.append, key, value)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=False)


def _is_store_timeout(exc: BaseException) -> bool:
    # torch raises DistStoreError (a RuntimeError) whose message says "timeout"/"Timed out".
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return type(exc).__name__ in ("DistStoreError", "RuntimeError") and (
        "timeout" in text or "timed out" in text
    )
