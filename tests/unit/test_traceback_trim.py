"""Tracebacks of aiocoll's errors show the user's frames and end at the public call; aiocoll's
internal frames only with AIOCOLL_DEBUG=1. A real uncaught error in a child process (a store wait
that runs out, raised several frames inside aiocoll), printed by Python's own machinery through
the hook aiocoll installs; and ``trim`` on an error caught by the program."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import aiocoll.sync as dist
from aiocoll._errors import trim

pytestmark = pytest.mark.timeout(60)

_SCRIPT = """
import asyncio
import aiocoll

async def main():
    store = aiocoll.MemoryStore()
    await store.wait(["missing-key"], timeout=0.05)  # USER LINE

asyncio.run(main())
"""


def _run(tmp_path: Path, debug: bool) -> str:
    script = tmp_path / "uncaught.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ)
    env.pop("AIOCOLL_DEBUG", None)
    if debug:
        env["AIOCOLL_DEBUG"] = "1"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 1, done.stderr
    return done.stderr


def _aiocoll_frames(text: str) -> list[str]:
    package = os.path.dirname(os.path.abspath(dist.__file__))
    return [line for line in text.splitlines() if line.strip().startswith(f'File "{package}')]


def test_an_uncaught_aiocoll_error_prints_the_user_s_frames_and_the_public_call_only(tmp_path: Path) -> None:
    trimmed = _run(tmp_path, debug=False)
    assert "# USER LINE" in trimmed and trimmed.rstrip().endswith(
        "aiocoll.StoreTimeout: timed out after 0.05s waiting for store key(s) ['missing-key']"
    ), trimmed
    frames = _aiocoll_frames(trimmed)
    assert len(frames) == 1 and frames[0].endswith(", in wait"), trimmed  # the public method
    assert len(_aiocoll_frames(_run(tmp_path, debug=True))) > 1


def test_trim_keeps_the_user_s_frame_and_the_public_function_of_a_caught_error() -> None:
    with pytest.raises(ValueError) as caught:
        dist.all_reduce([1.0])  # no process group: raised a few frames inside aiocoll.sync
    full = traceback.format_exception(caught.value)
    short = "".join(traceback.format_exception(trim(caught.value)))
    assert len(_aiocoll_frames("".join(full))) > 1
    assert [line.split(", in ")[-1] for line in _aiocoll_frames(short)] == ["all_reduce"], short
    assert __file__ in short


_LOST = """
import aiocoll

def step():
    raise aiocoll.PeerLostError(0, "closed the connection")  # USER LINE

step()
"""


@pytest.mark.parametrize("launcher", ["AIOCOLL_MAX_RESTARTS", "TORCHELASTIC_MAX_RESTARTS", None])
def test_a_lost_peer_under_a_launcher_ends_the_rank_with_one_line(
    tmp_path: Path, launcher: str | None
) -> None:
    """An expected failure (a peer lost in a job whose launcher restarts it, starts its next
    generation or ends it, and says which) ends the rank with the error's one line; elsewhere,
    or with AIOCOLL_DEBUG=1, the traceback is printed as usual."""
    script = tmp_path / "lost.py"
    script.write_text(_LOST)
    env = {k: v for k, v in os.environ.items() if not k.endswith("MAX_RESTARTS") and k != "AIOCOLL_DEBUG"}
    if launcher is not None:
        env[launcher] = "0"
    outputs = []
    for debug in (False, True):
        run_env = env | ({"AIOCOLL_DEBUG": "1"} if debug else {})
        done = subprocess.run(
            [sys.executable, str(script)], env=run_env, capture_output=True, text=True, timeout=50
        )
        assert done.returncode == 1, done.stderr
        outputs.append(done.stderr.strip().splitlines())
    quiet, debug_output = outputs
    if launcher is None:
        assert quiet[0] == "Traceback (most recent call last):" and any("# USER LINE" in x for x in quiet)
    else:
        assert quiet == [
            "aiocoll.PeerLostError: lost rank 0: closed the connection (the launcher says what comes "
            "next; AIOCOLL_DEBUG=1 shows the traceback)"
        ], quiet
    assert debug_output[0] == "Traceback (most recent call last):", debug_output
