"""aiocoll: collective communication for Python on asyncio.

The async API (init_process_group, ProcessGroup, Work, run), errors, ReduceOp and stores. Names are
loaded lazily so that ``import aiocoll`` stays cheap (no torch, no sockets) and so that each
layer can be imported on its own.
"""

from __future__ import annotations

import importlib
from typing import Any

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
