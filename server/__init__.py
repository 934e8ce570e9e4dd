"""aiocoll.server: the coordinator (key-value store + rendezvous for many jobs), embeddable.

Layering: imports aiocoll foundations (errors, protocol) only; never aiocoll.client or the public
surface (api, sync, torch, cli, testing). ``Coordinator`` is the asyncio service; the pure state
machine behind it lives in ``_state`` and is usable without a loop.

    async with Coordinator("127.0.0.1", 0, token="secret") as coord:
        print(coord.address)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._coordinator import Coordinator
    from ._state import CoordinatorState

__all__ = ["Coordinator", "CoordinatorState"]

_EXPORTS = {"Coordinator": "._coordinator", "CoordinatorState": "._state"}


def __getattr__(name: str) -> Any:
    # Lazy so that `import aiocoll.server` stays cheap (prometheus_client loads only when used).
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocoll.server' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
