"""The control plane: the coordinator session (its connection, reconnection and request
pipeline), join and membership, heartbeats, the store clients (one sans-IO core with an asyncio
and a blocking driver) and the store's progress checks.

May import foundations and the client's shared modules (client/_progress.py, _recorder.py,
_timeline.py, _stacks.py, _clock.py: what a rank did and when); never the data plane
(client/data) or the bootstrap (client/bootstrap.py), which wires the two planes together.
"""
