"""aiocoll.testing.preload: a child forked from the preload server starts as a fresh interpreter
would (arguments, environment, folder, streams, exit status, signals, threads and exit handlers
at its end), and whatever a fork could not honour starts as a plain process instead."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aiocoll.testing.preload import PreloadedProcess, start_python

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

# A module cheap to import and that a fresh interpreter does not load by itself.
LIGHT = ("decimal",)

REPORT = """
import json, os, sys
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("PRELOAD_TEST"),
           "path0": sys.path[0], "name": __name__, "preloaded": "decimal" in sys.modules,
           "sid": os.getsid(0) == os.getpid()}, sys.stdout)
"""


def _run(args: list[str], tmp: Path, **kw: object) -> tuple[PreloadedProcess | subprocess.Popen[bytes], str]:
    out = tmp / "out.txt"
    with open(out, "wb") as fh:
        proc = start_python([sys.executable, *args], preload=LIGHT, stdout=fh, stderr=subprocess.STDOUT, **kw)  # type: ignore[arg-type]
    proc.wait(60)
    return proc, out.read_text()


def test_a_forked_child_gets_its_arguments_environment_folder_and_streams(tmp_path: Path) -> None:
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    env = {**os.environ, "PRELOAD_TEST": "seen"}
    proc, out = _run([str(script), "a", "b"], tmp_path, env=env, cwd=tmp_path)
    assert isinstance(proc, PreloadedProcess) and proc.returncode == 0, out
    report = json.loads(out)
    assert report == {
        "argv": [str(script), "a", "b"],
        "cwd": str(tmp_path),
        "env": "seen",
        "path0": str(tmp_path.resolve()),
        "name": "__main__",
        "preloaded": True,
        "sid": False,
    }
    proc, out = _run(["-c", REPORT, "x"], tmp_path, start_new_session=True)
    report = json.loads(out)
    assert (report["argv"], report["path0"], report["sid"]) == (["-c", "x"], "", True)


def test_exit_status_is_a_fresh_interpreters(tmp_path: Path) -> None:
    cases = {
        "import sys; sys.exit(3)": 3,
        "raise ValueError('boom from the child')": 1,
        "import sys; sys.exit('said and failed')": 1,
        "pass": 0,
    }
    for code, expected in cases.items():
        proc, out = _run(["-c", code], tmp_path)
        assert proc.returncode == expected, (code, out)
    _, out = _run(["-c", "raise ValueError('boom from the child')"], tmp_path)
    assert "ValueError: boom from the child" in out
    # non-daemon threads are waited for, then exit handlers run, then the streams are flushed
    code = (
        "import atexit, sys, threading, time\n"
        "atexit.register(lambda: print('exit handler'))\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()\n"
        "sys.stdout.write('unflushed ')\n"
    )
    proc, out = _run(["-c", code], tmp_path)
    assert proc.returncode == 0 and out.split() == ["unflushed", "thread", "exit", "handler"], out


def test_signals_reach_the_child_and_its_death_is_reported(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = f"import pathlib, time; pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    for sig, expected in (
        (signal.SIGKILL, -signal.SIGKILL),
        (signal.SIGTERM, -signal.SIGTERM),
        (signal.SIGINT, -signal.SIGINT),
    ):
        ready.unlink(missing_ok=True)
        proc = start_python([sys.executable, "-c", code], preload=LIGHT, stderr=subprocess.DEVNULL)
        assert isinstance(proc, PreloadedProcess)
        end = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < end and proc.poll() is None, "the child did not start"
            time.sleep(0.02)
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.05)
        proc.send_signal(sig)
        assert proc.wait(30) == expected


def test_what_a_fork_cannot_honour_starts_plain(tmp_path: Path) -> None:
    # another value of a start-up variable, or nothing to preload: a plain process, not preloaded
    for kw in ({"env": {**os.environ, "PYTHONHASHSEED": "123"}}, {"preload": ()}):
        out = tmp_path / "out.txt"
        with open(out, "wb") as fh:
            proc = start_python([sys.executable, "-c", REPORT], stdout=fh, **{"preload": LIGHT, **kw})  # type: ignore[arg-type]
        assert isinstance(proc, subprocess.Popen) and proc.wait(60) == 0
        assert json.loads(out.read_text())["preloaded"] is False
