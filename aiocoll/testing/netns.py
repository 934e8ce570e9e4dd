"""Several "hosts" on one machine for tests: network + UTS namespaces joined by veth links.

``NamespaceHosts(3)`` makes three namespaces, each with its own hostname, network stack and
address on one private segment: host 0 holds a bridge; every other host is joined to it by a
veth pair. Every address lives only inside those namespaces (nothing is added to the machine's
own network), and ``close()`` (or leaving the ``with`` block) kills what was started in them and
deletes them, also after a failure, so nothing outlives the test. ``prefix(h)`` is the command
prefix that runs a program on host h (``ip netns exec`` plus a fresh UTS namespace with the
host's name), for ``aiocoll.testing.world.World(prefix=...)`` or ``subprocess``.

Needs root (CI runs tests as root), ``ip`` (iproute2) and ``unshare`` (util-linux);
``NamespacesUnavailable`` says which of these is missing so a test can skip with that reason.
Public testing helper: standard library only.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence

__all__ = ["NamespaceHosts", "NamespacesUnavailable"]

SEGMENT = "10.213.7"  # a /24 that exists only inside the namespaces a NamespaceHosts makes


class NamespacesUnavailable(RuntimeError):
    """Namespaces cannot be made here; the message says why (for pytest.skip)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if result.returncode != 0:
        raise NamespacesUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


class NamespaceHosts:
    """``count`` hosts (network + UTS namespaces) on one segment, reachable from each other.

    Args:
        count: how many hosts (at least 1; at most 250).
        hostnames: the hostname of each host (default ``host0``, ``host1``...). Equal names are
            allowed: they model cloned machines, whose ranks must still tell their hosts apart.

    Attributes:
        addresses: each host's IPv4 address on the segment.
        namespaces: each host's network namespace name (unique per instance).

    Raises:
        NamespacesUnavailable: not root, a tool missing, or the kernel refused (all made so far
            are removed first).
    """

    def __init__(self, count: int, *, hostnames: Sequence[str] | None = None) -> None:
        if not 1 <= count <= 250:
            raise ValueError(f"NamespaceHosts: count must be 1..250, got {count}")
        self.hostnames = list(hostnames) if hostnames is not None else [f"host{h}" for h in range(count)]
        if len(self.hostnames) != count:
            raise ValueError(f"NamespaceHosts: {count} hosts but {len(self.hostnames)} hostnames")
        if os.geteuid() != 0:
            raise NamespacesUnavailable("network namespaces need root (CI runs the tests as root)")
        for tool in ("ip", "unshare"):
            if shutil.which(tool) is None:
                raise NamespacesUnavailable(f"`{tool}` is not installed (iproute2 / util-linux)")
        tag = secrets.token_hex(3)
        self.namespaces = [f"aiocoll-{tag}-h{h}" for h in range(count)]
        self.addresses = [f"{SEGMENT}.{h + 1}" for h in range(count)]
        self._made: list[str] = []
        self._outside: list[str] = []  # veths not yet moved out of the machine's namespace
        self._started: list[subprocess.Popen[bytes]] = []
        try:
            self._build(tag)
        except BaseException:
            self.close()
            raise

    def _build(self, tag: str) -> None:
        for ns in self.namespaces:
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        hub = self.namespaces[0]
        _ip("-n", hub, "link", "add", "seg0", "type", "bridge")
        _ip("-n", hub, "addr", "add", f"{self.addresses[0]}/24", "dev", "seg0")
        _ip("-n", hub, "link", "set", "seg0", "up")
        for h, ns in enumerate(self.namespaces[1:], start=1):
            # made in the machine's namespace under unique names, then moved out of it at once
            outer, inner = f"ac{tag}a{h}", f"ac{tag}b{h}"
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._outside.append(outer)  # deleting one end deletes the pair
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "netns", hub)
            self._outside.remove(outer)
            _ip("-n", hub, "link", "set", outer, "master", "seg0", "up")
            _ip("-n", ns, "link", "set", inner, "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.addresses[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program on ``host``: its network namespace, and a UTS
        namespace of its own named after the host (``unshare --uts`` then ``hostname``)."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[host],
            "unshare",
            "--uts",
            "--",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostnames[host],
        ]

    def popen(self, host: int, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host``; it is killed by ``close()`` if still running."""
        proc: subprocess.Popen[bytes] = subprocess.Popen([*self.prefix(host), *argv], **kwargs)  # type: ignore[call-overload]
        self._started.append(proc)
        return proc

    def close(self) -> None:
        """Kill what ``popen`` started and every process left in the namespaces, then delete them."""
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
            for pid in pids.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)
        self._made.clear()
        for link in self._outside:
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=20)
        self._outside.clear()

    def __enter__(self) -> NamespaceHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
