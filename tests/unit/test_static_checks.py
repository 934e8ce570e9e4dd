"""ruff and mypy stay clean: they run as part of the suite so CI enforces them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: pip install -r requirements-test.txt")
    return found


@pytest.mark.timeout(120)
def test_ruff_finds_nothing() -> None:
    command = [_tool("ruff"), "check", "--no-cache", "."]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_mypy_finds_nothing(request: pytest.FixtureRequest) -> None:
    from conftest import background_mypy

    started = background_mypy(request.config)  # by tests/conftest.py, once the tests are collected
    if started is not None and started.started():
        code, output = started.verdict(timeout=280)
    else:
        out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
        code, output = out.returncode, out.stdout + out.stderr
    assert code == 0, output
