"""Key-value stores: the async Store interface and its local implementations.

Imports only foundations (_errors, _deadline, protocol constants), never client/ or the public
surface. The coordinator-backed store lives in aiocoll.client (it needs a session) and is
reached through ``aiocoll.connect_store``.
"""

from ._base import DEFAULT_TIMEOUT, Store
from ._file import FileStore
from ._memory import MemoryStore
from ._prefix import PrefixStore

__all__ = ["DEFAULT_TIMEOUT", "FileStore", "MemoryStore", "PrefixStore", "Store"]
