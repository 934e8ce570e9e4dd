"""Collective algorithms: pure schedules, the one executor, and the Transport they run over.

Foundation layer: imports only aiocoll's foundations (_errors, _types, _reduce), never client/,
server/ or the public surface. The engine (client/) builds a CollectiveSpec of flat numpy
arrays per operation and awaits ``run_collective``, or, for small single-lane operations, starts
them with ``_eager.start_eager`` (the same schedules driven by message callbacks, no task); tests
drive the same code over the in-memory transport and inspect the schedules directly.
"""

from __future__ import annotations

from ._executor import ALGORITHMS, KINDS, CollectiveSpec, choose_algorithm, run_collective
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
