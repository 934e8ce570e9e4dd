"""Host identity (aiocoll/_host.py): hostname/boot id/network namespace, stable within a host."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from aiocoll._host import HOST_ID_ENV, host_identity

CHILD = "from aiocoll._host import host_identity; print(host_identity())"


def test_identity_names_the_hostname_boot_and_network_namespace_and_is_stable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(HOST_ID_ENV, raising=False)
    identity = host_identity()
    hostname, boot_id, netns = identity.split("/")
    assert hostname == socket.gethostname()
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        assert boot_id == handle.read().strip()
    assert netns == str(os.stat("/proc/self/ns/net").st_ino)
    # another process of this host, in this namespace, agrees
    child = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30, check=True
    )
    assert child.stdout.strip() == identity


def test_the_environment_overrides_the_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(HOST_ID_ENV, "rack7-node3")
    assert host_identity() == "rack7-node3"


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a new network namespace needs root and unshare",
)
def test_a_process_in_another_network_namespace_with_the_same_hostname_is_another_host() -> None:
    env = {k: v for k, v in os.environ.items() if k != HOST_ID_ENV}
    here = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=30, env=env)
    there = subprocess.run(
        ["unshare", "--net", "--", sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert there.returncode == 0, there.stderr
    assert here.stdout.split("/")[:2] == there.stdout.split("/")[:2]  # same hostname, same boot
    assert here.stdout.strip() != there.stdout.strip()
