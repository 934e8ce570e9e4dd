"""Collective algorithms: pure schedules, the planner, the one step driver, and the Transport they
run over.

Foundation layer: imports only aiocoll's foundations (_errors, _types, _reduce, _buffers), never
client/, server/ or the public surface. The public layer builds a CollectiveSpec of flat arrays
per operation, plans it with ``_plan.prepare`` and starts it with ``_driver.start_collective``
(driven by message callbacks, no task), or awaits ``run_collective`` (the same driver); tests
drive the same code over the in-memory transport and inspect the schedules directly.
"""

from __future__ import annotations

from ._driver import run_collective
from ._plan import ALGORITHMS, KINDS, CollectiveSpec, choose_algorithm
from ._transport import LostPeerHandler, Tag, Transport

__all__ = [
    "ALGORITHMS",
    "KINDS",
    "CollectiveSpec",
    "LostPeerHandler",
    "Tag",
    "Transport",
    "choose_algorithm",
    "run_collective",
]
