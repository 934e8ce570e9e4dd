"""The coordinator image's recipe stays reproducible: the base pinned by digest, every package
from a lock with hashes, the locks in step with pyproject.toml.

scripts/check_container.sh builds and runs the image (it needs root and minutes); these read the
files it builds from, so that a change that unpins something fails the suite at once.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()

pytestmark = pytest.mark.timeout(30)


def _pins(lock: Path) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes) of a pip-compile lock."""
    pins: dict[str, tuple[str, int]] = {}
    name = ""
    for line in lock.read_text().splitlines():
        pinned = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if pinned:
            name = pinned.group(1).lower().replace("_", "-")
            pins[name] = (pinned.group(2), 0)
        elif "--hash=sha256:" in line and name:
            version, count = pins[name]
            pins[name] = (version, count + len(re.findall(r"--hash=sha256:[0-9a-f]{64}", line)))
    return pins


def test_the_base_is_pinned_by_digest_and_both_stages_start_from_it() -> None:
    base = re.search(r"^ARG BASE=(\S+)$", DOCKERFILE, re.M)
    assert base and re.fullmatch(r"python:3\.11-slim-bookworm@sha256:[0-9a-f]{64}", base.group(1)), base
    assert re.findall(r"^FROM (\S+)", DOCKERFILE, re.M) == ["${BASE}", "${BASE}"]


def test_every_package_comes_from_a_lock_with_hashes() -> None:
    for lock in ("requirements.txt", "build-requirements.txt"):
        pins = _pins(ROOT / "container" / lock)
        assert pins and all(count > 0 for _, count in pins.values()), (lock, pins)
        assert f"container/{lock}" in DOCKERFILE
    commands = DOCKERFILE.replace("\\\n", " ").split("&&")
    installs = [command for command in commands if "-r /tmp/lock/" in command]
    assert len(installs) == 2 and all("--require-hashes" in line for line in installs), installs
    assert "--no-build-isolation" in DOCKERFILE  # the wheel is built with the locked backend


def test_the_locks_satisfy_pyproject_and_keep_build_tools_out_of_the_image() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = _pins(ROOT / "container" / "requirements.txt")
    for text in project["project"]["dependencies"]:
        requirement = Requirement(text)
        name = requirement.name.lower().replace("_", "-")
        assert name in runtime, f"{name} is a dependency of aiocoll but not in container/requirements.txt"
        assert requirement.specifier.contains(runtime[name][0]), (text, runtime[name])
    build = _pins(ROOT / "container" / "build-requirements.txt")
    for text in project["build-system"]["requires"]:
        requirement = Requirement(text)
        assert requirement.specifier.contains(build[requirement.name.lower()][0]), (text, build)
    assert not {"pip", "setuptools", "wheel"} & set(runtime)
    # The image's venv is made without pip, and the base's own tools are uninstalled.
    assert "python3 -m venv --without-pip /opt/aiocoll" in DOCKERFILE
    assert "pip uninstall -y -q pip setuptools wheel" in DOCKERFILE
    final = DOCKERFILE.split("\nFROM ${BASE}\n", 1)[1]
    assert "COPY --from=build /opt/aiocoll /opt/aiocoll" in final and "pip install" not in final
