"""Host identity: the string a rank publishes in the membership table to say which machine it is on.

Ranks with equal identities are taken to share a machine: the link factory may join them by
shared memory, and collectives may split a group by host (hierarchical all_reduce). So the
identity must differ wherever that would be wrong, and agree wherever it is right:

- the hostname (UTS namespace) alone is not enough: two containers, or two network namespaces
  made by a test, may carry the same name, and cloned machines often do;
- the kernel's boot id (/proc/sys/kernel/random/boot_id, random per boot) tells machines apart,
  even ones with the same hostname, and is the same for every process of one running kernel;
- the network namespace's inode (/proc/self/ns/net) tells apart containers and namespaces on one
  kernel: processes there cannot reach each other's loopback or abstract Unix sockets, so
  treating them as one host would be wrong; a shared-memory link would also want to confirm it.

The identity is ``HOSTNAME/BOOT_ID/NET_NS_INODE`` (hostname first, so logs stay readable;
`aiocoll status` shows the hostname alone, from host_label). ``AIOCOLL_HOST_ID`` overrides it for
setups these facts cannot see through. Where a file cannot be read (not Linux), its part is left
empty. Foundation module: the standard library and aiocoll._env only.
"""

from __future__ import annotations

import os
import re
import socket

from aiocoll._env import env_text

__all__ = ["HOST_ID_ENV", "host_identity", "host_label"]

HOST_ID_ENV = "AIOCOLL_HOST_ID"
_MAX_CHARS = 256  # the coordinator's bound on a member's host field
# HOSTNAME/BOOT_ID/NET_NS_INODE as host_identity builds it (either id may be empty off Linux).
_IDENTITY = re.compile(r"(?P<name>[^/]*)/(?:[0-9a-fA-F-]{36})?/[0-9]*")


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii") as handle:
            return handle.read().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _net_namespace() -> str:
    """The inode of this process's network namespace ("4026531840"), or "" where there is none."""
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def host_identity() -> str:
    """This process's host identity: ``AIOCOLL_HOST_ID`` if set, else hostname/boot id/net namespace.

    Read afresh on every call (cheap; done once per rendezvous), so a process that moved into
    another namespace before joining reports where it is now.
    """
    override = env_text(HOST_ID_ENV)
    if override:
        return override[:_MAX_CHARS]
    boot_id = _read("/proc/sys/kernel/random/boot_id")
    identity = f"{socket.gethostname()}/{boot_id}/{_net_namespace()}"
    return identity[-_MAX_CHARS:]  # an absurdly long hostname loses its start, never the ids


def host_label(identity: str) -> str:
    """The part of a host identity a person reads: the hostname of ``HOSTNAME/BOOT_ID/NET_NS``
    (`aiocoll status`'s HOST column; ``--json`` keeps the whole identity). An identity of another
    shape (``AIOCOLL_HOST_ID``, a name written by hand) is returned whole."""
    match = _IDENTITY.fullmatch(identity)
    if match is None or not match.group("name"):
        return identity
    return match.group("name")
