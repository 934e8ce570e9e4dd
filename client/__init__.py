"""The worker runtime, installed as aiocoll.client: the bootstrap (bootstrap.py: from an init
method to a running runtime), the control plane (control/: the coordinator session, join, store
clients, beats), the data plane (data/: engine, providers, shared memory, links), and what both
planes share (_progress.py, _recorder.py, _timeline.py, _stacks.py, _clock.py). Never imports
the public surface or the server.
"""
