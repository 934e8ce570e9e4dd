"""The data plane: the engine (per-group sequencing, deadlines, failure fan-out, one lifecycle),
the operation records, every group's provider table and its rows (message driver, shared-memory
arena, hierarchical route, staging, CUDA IPC, objects and group formation), shared memory, and
the links to the peers (client/data/transports).

May import foundations and the client's shared modules (client/_progress.py, _recorder.py,
_timeline.py, _stacks.py, _clock.py: what a rank did and when); never the control plane
(client/control) or the bootstrap (client/bootstrap.py), which wires the two planes together.
"""
