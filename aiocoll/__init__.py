"""aiocoll: collective communication for Python on asyncio.

The async API (init_process_group, ProcessGroup, Work, run), errors, ReduceOp and stores. Names are
loaded lazily so that ``import aiocoll`` stays cheap (no torch, no sockets) and so that each
layer can be imported on its own.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the public names where tools that read the source (mypy, the docs) see them
    from ._connect import connect_store as connect_store
    from ._errors import AuthenticationError as AuthenticationError
    from ._errors import CollectiveTimeout as CollectiveTimeout
    from ._errors import DistError as DistError
    from ._errors import MismatchError as MismatchError
    from ._errors import PeerLostError as PeerLostError
    from ._errors import ProtocolError as ProtocolError
    from ._errors import RendezvousError as RendezvousError
    from ._errors import StoreError as StoreError
    from ._errors import StoreTimeout as StoreTimeout
    from ._run import run as run
    from ._types import ReduceOp as ReduceOp
    from ._work import Work as Work
    from .api import ProcessGroup as ProcessGroup
    from .api import init_process_group as init_process_group
    from .stores import FileStore as FileStore
    from .stores import MemoryStore as MemoryStore
    from .stores import PrefixStore as PrefixStore
    from .stores import Store as Store

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "DistError": "aiocoll._errors",
    "CollectiveTimeout": "aiocoll._errors",
    "PeerLostError": "aiocoll._errors",
    "MismatchError": "aiocoll._errors",
    "AuthenticationError": "aiocoll._errors",
    "RendezvousError": "aiocoll._errors",
    "StoreTimeout": "aiocoll._errors",
    "StoreError": "aiocoll._errors",
    "ProtocolError": "aiocoll._errors",
    "ReduceOp": "aiocoll._types",
    "Store": "aiocoll.stores",
    "MemoryStore": "aiocoll.stores",
    "FileStore": "aiocoll.stores",
    "PrefixStore": "aiocoll.stores",
    "connect_store": "aiocoll._connect",
    "init_process_group": "aiocoll.api",
    "ProcessGroup": "aiocoll.api",
    "Work": "aiocoll._work",
    # an addition to the contract: asyncio.run on uvloop when installed (README, "Async quick start")
    "run": "aiocoll._run",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocoll' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
