"""aiocoll under torchrun's own launcher: what its users see.

Real torchrun agents (``python -m torch.distributed.run``) on loopback start real workers that
run ``aiocoll.sync`` scripts.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiocoll._net import free_port

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
pytest.importorskip("torch.distributed.run")

ALL_REDUCE = """
import numpy as np
import aiocoll.sync as dist
dist.init_process_group("gloo")
t = np.ones(2)
dist.all_reduce(t)
print("SUM", int(t[0]), flush=True)
dist.destroy_process_group()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIOCOLL_", "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def test_without_a_token_only_rank_0_warns(tmp_path: Path) -> None:
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
    ]  # fmt: skip
    proc = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=150)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert proc.stdout.count("SUM 3") == 3, output[-3000:]
    # Every rank is equally open; the job says so once, in torchrun's one terminal.
    assert output.count("aiocoll: no token") == 1, output[-3000:]
