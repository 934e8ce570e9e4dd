"""The process's file-descriptor budget: raising the soft limit to the hard one at start, and
counting the descriptors open now. Standard library only; the Coordinator uses it to refuse
connections it has no descriptor for, saying so, instead of failing accept() silently.
"""

from __future__ import annotations

import os
import resource

__all__ = ["open_descriptors", "raise_descriptor_limit"]


def raise_descriptor_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (a server of thousands of
    connections needs it, and raising the hard one is not ours to do); returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def open_descriptors() -> int:
    """How many file descriptors this process holds now (an estimate where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 64
