"""aiocoll.sync in a numpy-only process: rendezvous kinds, Work and futures, lifecycle errors.

A world of one process is enough for what these check, so a single subprocess (which never
imports torch: that is part of what is checked) runs them all and reports; the tests assert.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SCRIPT = r"""
import concurrent.futures, json, sys, threading
import numpy as np
import aiocoll.sync as dist

out = {}
rdv = sys.argv[1]
for backend in ("nccl", "mpi", "GLOO", None):
    dist.init_process_group(backend, init_method=f"file://{rdv}.{backend}", rank=0, world_size=1)
    out[f"backend/{backend}"] = [dist.get_backend(), dist.group.WORLD.name()]
    out[f"backend/{backend}/new_group"] = [
        dist.get_backend(dist.new_group([0])), dist.get_backend(dist.new_group([0], backend="mpi"))
    ]
    dist.destroy_process_group()

dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=0, world_size=1)
out["world"] = [dist.get_rank(), dist.get_world_size(), dist.is_initialized()]
out["group_world_is_default"] = dist.GroupMember.WORLD is dist.group.WORLD is not None
try:
    dist.init_process_group("gloo", init_method=f"file://{rdv}.again", rank=0, world_size=1)
    out["init_twice"] = "no error"
except ValueError as exc:
    out["init_twice"] = str(exc)

a = np.arange(4, dtype=np.int64)
work = dist.all_reduce(a, op=dist.ReduceOp.MAX, async_op=True)
callback_thread = []
future = work.get_future()
done = threading.Event()
def on_done(f):
    callback_thread.append(threading.current_thread().name)
    done.set()
future.add_done_callback(on_done)
out["future_type"] = type(future).__module__ + "." + type(future).__name__
out["future_value"] = [x.tolist() for x in future.result(timeout=30)]
done.wait(30)
out["callback_off_loop"] = bool(callback_thread) and callback_thread[0] != "aiocoll-loop"
out["work"] = [work.wait(), work.is_completed(), work.is_success(), work.exception() is None]
out["result"] = [x.tolist() for x in work.result()]

g = dist.new_group([0])
b = np.ones(2)
dist.broadcast(b, src=0, group=g)
out["subgroup"] = [dist.get_rank(g), dist.get_world_size(g), b.tolist()]
for name, call in (
    ("bad_src", lambda: dist.broadcast(np.zeros(1), src=3)),
    ("both_src", lambda: dist.broadcast(np.zeros(1), src=0, group_src=0)),
    ("no_src", lambda: dist.broadcast(np.zeros(1))),
    ("bad_group", lambda: dist.all_reduce(np.zeros(1), group="world")),
    ("bad_p2pop", lambda: dist.P2POp(print, np.zeros(1), 0)),
):
    try:
        call()
        out[name] = "no error"
    except (ValueError, TypeError) as exc:
        out[name] = type(exc).__name__
objs = ["kept"]
dist.broadcast_object_list(objs, src=0)
out["broadcast_object_list"] = objs
dist.destroy_process_group()
out["after_destroy"] = dist.is_initialized()
try:
    dist.all_reduce(np.zeros(1))
    out["use_after_destroy"] = "no error"
except ValueError as exc:
    out["use_after_destroy"] = str(exc)

store = dist.HashStore()
dist.init_process_group(store=store, rank=0, world_size=1)
got = [None]
dist.all_gather_object(got, {"via": "store"})
out["store_init"] = [dist.get_world_size(), got, store.num_keys() > 0]
dist.destroy_process_group()
out["torch_loaded"] = "torch" in sys.modules
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("sync_single")
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env["AIOCOLL_TOKEN"] = "single-process-test"
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(Path(tmp) / "rdv")],
        env=env,
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_get_backend_answers_the_name_the_script_asked_for_and_name_says_aiocoll(
    report: dict[str, Any],
) -> None:
    # A script that branches on get_backend() == "nccl" takes the branch it takes under torch.
    assert report["backend/nccl"] == ["nccl", "aiocoll"]
    assert report["backend/mpi"] == ["mpi", "aiocoll"]
    assert report["backend/GLOO"] == ["gloo", "aiocoll"]
    assert report["backend/None"] == ["aiocoll", "aiocoll"]
    # new_group without a backend has the default group's, as in torch.
    assert report["backend/nccl/new_group"] == ["nccl", "mpi"]
    assert report["backend/None/new_group"] == ["aiocoll", "mpi"]
    assert report["world"] == [0, 1, True]
    assert report["group_world_is_default"]


def test_numpy_only_process_gets_a_concurrent_future_completed_off_the_loop(report: dict[str, Any]) -> None:
    assert report["torch_loaded"] is False
    assert report["future_type"] == "concurrent.futures._base.Future"
    assert report["future_value"] == [[0, 1, 2, 3]]
    assert report["callback_off_loop"]
    assert report["work"] == [True, True, True, True]
    assert report["result"] == [[0, 1, 2, 3]]


def test_bad_arguments_raise_at_call_time(report: dict[str, Any]) -> None:
    assert report["bad_src"] == "ValueError"
    assert report["both_src"] == "ValueError"
    assert report["no_src"] == "ValueError"
    assert report["bad_group"] == "TypeError"
    assert report["bad_p2pop"] == "ValueError"


def test_lifecycle_errors_say_what_to_do(report: dict[str, Any]) -> None:
    assert "twice" in report["init_twice"]
    assert report["after_destroy"] is False
    assert "init_process_group" in report["use_after_destroy"]


def test_groups_objects_and_store_rendezvous(report: dict[str, Any]) -> None:
    assert report["subgroup"] == [0, 1, [1.0, 1.0]]
    assert report["broadcast_object_list"] == ["kept"]
    assert report["store_init"] == [1, [{"via": "store"}], True]


def test_broken_torch_import_under_torchrun_shows_the_real_error(tmp_path: Path) -> None:
    # A module of the script's folder shadows one that torch imports: torch is installed, so
    # "install torch" would mislead; the message carries the import error that happened.
    (tmp_path / "typing_extensions.py").write_text("# the user's own module, shadowing the package\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import aiocoll.sync as dist\n"
        "try:\n"
        "    dist.init_process_group('gloo')\n"
        "except RuntimeError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("AIOCOLL_COORDINATOR",)}
    env.update(TORCHELASTIC_RUN_ID="shadow", RANK="0", WORLD_SIZE="1")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=80
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    message = proc.stdout.split("ERROR", 1)[1]
    assert "is installed but importing it failed with ImportError" in message
    assert str(tmp_path / "typing_extensions.py") in message
    assert "install it" not in message
