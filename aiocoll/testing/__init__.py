"""Test helpers that ship with aiocoll: real multi-process worlds, a fault-injecting TCP proxy,
and the conformance suites every Store and Transport must pass.

Public testing surface: its modules may import the public API and pytest, and nothing in the
library imports them. The package exists so that aiocoll's own tests and users' tests of their
own stores and transports hold them to the same checks.
"""
