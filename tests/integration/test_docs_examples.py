"""The Python examples in README.md and docs/ run as written and exit 0.

Each block marked ``<!-- example: run N -->`` runs under ``aiocoll run --nproc-per-node N``, each
``<!-- example: python -->`` with ``python``; the examples assert their own results. Blocks
marked ``not run`` say why on the page (tests/docs_examples.py; tests/unit/test_docs_site.py
checks that every block has a marker).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_examples import examples

RUNNABLE = [e for e in examples() if e.mode in ("run", "python")]


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", RUNNABLE, ids=[e.label for e in RUNNABLE])
def test_docs_example_runs(example, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(example.code)
    if example.mode == "run":
        command = [
            sys.executable,
            "-m",
            "aiocoll",
            "run",
            "--nproc-per-node",
            str(example.nproc),
            str(script),
        ]
    else:
        command = [sys.executable, str(script)]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, f"{example.label} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
