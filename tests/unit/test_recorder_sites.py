"""The flight recorder's call sites: one kind of call reached through different depths of aiocoll's
frames (aiocoll.ft calls a group's collectives for the user; the user calls them directly) names
the user's line each time, whichever came first. A one-rank group in this process; no peers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiocoll
from aiocoll._net import free_port

pytestmark = pytest.mark.timeout(60)

# Two functions whose code counts as aiocoll's (their file is in the package's folder), as
# aiocoll.ft's do: they reach the engine two frames deeper than a direct call.
_LIBRARY: dict[str, Any] = {}
exec(
    compile(
        "async def via_library(pg, x):\n"
        "    return await _inner(pg, x)\n"
        "async def _inner(pg, x):\n"
        "    return await pg.all_reduce(x)\n",
        os.path.join(os.path.dirname(aiocoll.__file__), "_library_stand_in.py"),
        "exec",
    ),
    _LIBRARY,
)


async def _direct(pg: Any, x: np.ndarray) -> None:
    await pg.all_reduce(x)  # DIRECT


async def _deeper(pg: Any, x: np.ndarray) -> None:
    await _direct(pg, x)


TEST = "test_one_kind_called_at_two_depths_names_the_users_line_each_time"


def _named(dump: str) -> list[tuple[str, str]]:
    """Each all_reduce's site in ``dump``: its function and the end comment of its line here."""
    ops = json.loads(Path(dump).read_text())["ops"]
    source = Path(__file__).read_text().splitlines()
    sites = [op["site"] for op in ops if op["op"].startswith("all_reduce")]
    return [
        ("unknown", "") if s is None else (s["function"], source[s["line"] - 1].rsplit("# ", 1)[-1])
        for s in sites
    ]


async def test_one_kind_called_at_two_depths_names_the_users_line_each_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOCOLL_DUMP_DIR", str(tmp_path))
    pg = await aiocoll.init_process_group(f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, token="t")
    try:
        x = np.ones(4, np.float32)
        await _LIBRARY["via_library"](pg, x)  # LIBRARY: the kind's first call, two frames deeper
        await _deeper(pg, x)
        await _LIBRARY["via_library"](pg, x)  # LIBRARY again: past the function called, another path
        await _deeper(pg, x)
        path = pg._rt.engine.progress.dump("test")
    finally:
        await pg.destroy()
    assert path is not None
    assert _named(path) == [
        (TEST, "LIBRARY: the kind's first call, two frames deeper"),
        ("_direct", "DIRECT"),
        (TEST, "LIBRARY again: past the function called, another path"),
        ("_direct", "DIRECT"),
    ]
