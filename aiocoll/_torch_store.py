"""A ``torch.distributed.Store`` over an aiocoll async store: what torch's default process group
is given when ``aiocoll.sync.init_process_group`` makes it over aiocoll's world, so that torch's
own ``new_group`` calls rendezvous through the same coordinator (or store) the script joined.

Imports torch; the public modules import this one only when torch is in use. Each call runs the
async store's operation on aiocoll's loop thread and blocks the calling thread until it is done:
torch calls its store from the script's threads and, for a new group's rendezvous, from the
worker threads of aiocoll._sync_stores.BlockingStoreAdapter, never from the loop thread.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as td

from ._deadline import to_seconds
from ._sync_loop import get_loop_thread

__all__ = ["TorchStoreOverAiocoll"]

# What torch's stores wait by default (its TCPStore's timeout).
_DEFAULT_WAIT = 300.0


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class TorchStoreOverAiocoll(td.Store):
    """torch's Store interface over ``store``, an aiocoll async Store (a coordinator session, or
    the store the group rendezvoused through). Keys live in the same key space as aiocoll's own;
    torch prefixes its keys per group ("default_pg/...")."""

    def __init__(self, store: Any, timeout: float | None = None) -> None:
        super().__init__()
        self._store = store
        self._loop = get_loop_thread()
        self._wait = timeout if timeout else _DEFAULT_WAIT

    def _run(self, coroutine: Any) -> Any:
        return self._loop.run(coroutine)

    def set(self, key: str, value: Any) -> None:
        self._run(self._store.set(key, _bytes(value)))

    def get(self, key: str) -> bytes:
        self.wait([key])  # torch's get waits for the key, up to the store's timeout
        return bytes(self._run(self._store.get(key)))

    def add(self, key: str, amount: int) -> int:
        return int(self._run(self._store.add(key, int(amount))))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._run(self._store.compare_set(key, _bytes(expected), _bytes(desired))))

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | float | None = None) -> None:
        seconds = to_seconds(timeout) if timeout is not None else None
        self._run(self._store.wait(list(keys), seconds or self._wait))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._run(self._store.check(list(keys))))

    def delete_key(self, key: str) -> bool:
        return bool(self._run(self._store.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._run(self._store.num_keys()))

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        seconds = to_seconds(timeout)
        self._wait = seconds if seconds else _DEFAULT_WAIT
