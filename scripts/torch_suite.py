#!/usr/bin/env python
"""Run torch's own distributed test suite on gloo and on aiocoll, and compare them per test.

torch ships its backend test suite in the wheel (torch/testing/_internal/distributed/
distributed_test.py, the ``_DistTestBase`` tests that torch's test/distributed/
test_distributed_spawn.py drives per backend). This script drives the same class the same way
(one process per rank for each test, a file:// init per test), for a chosen backend and world
size, and prints which tests pass, fail or are skipped on each backend.

Backend "aiocoll" runs the suite as written for gloo (its gloo-only tests included), with every
group that asks for gloo created as an aiocoll group instead: ``init_process_group("gloo")``,
``new_group(..., backend="gloo")`` build an ``aiocoll.torch.AiocollProcessGroup`` that torch
records under the name "aiocoll". That is what a user trying aiocoll on code written for gloo
sees.

    python scripts/torch_suite.py --world-size 2 3 8            # both backends, whole suite
    python scripts/torch_suite.py -k test_all_gather -k barrier  # a subset (substring match)
    python scripts/torch_suite.py --backend aiocoll --world-size 3 --json out.json
    python scripts/torch_suite.py --parallel -k test_all_reduce  # gloo and aiocoll at once

Tests that can pass only for a backend named gloo (NAME_CHECKS: ``dist.get_backend() ==
"gloo"``, and ``dist.monitored_barrier``, which torch refuses for other names) are reported apart.

Every test has a deadline (--timeout, default 120 s): torch's harness kills the ranks of a test
that runs past it and records the test as failed, so nothing hangs; the whole run of one backend
and world size also has a deadline (--budget). Exit status: 0 when aiocoll passes every test
gloo passes (with both run) apart from those name checks, 1 otherwise. See docs/TORCH_SUITE.md
for results and usage.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import unittest
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_WORKER_ENV = "AIOCOLL_TORCH_SUITE_WORKER"  # "gloo" or "aiocoll" inside a worker and its ranks


# ---------------------------------------------------------------------------------------------
# inside a worker (and in every rank process it forks or spawns)


def _groups_asking_for_gloo_become_aiocoll() -> None:
    """Make c10d build an aiocoll group wherever a gloo one is asked for.

    Every group torch makes (init_process_group, new_group, new_subgroups, DeviceMesh) goes
    through ``distributed_c10d._new_process_group_helper(size, rank, ranks, backend, ...)``; the
    wrapper hands it "aiocoll" where the caller said "gloo" (or left the backend undefined, which
    means gloo on CPU). Torch then records the group as "aiocoll", exactly as for a user who
    wrote ``backend="aiocoll"``; tests that assert the recorded name is "gloo", and
    ``dist.monitored_barrier`` (which accepts only a group recorded as gloo), see that name.
    """
    import torch.distributed.distributed_c10d as c10d

    import aiocoll.torch  # noqa: F401  (registers the backend)

    make_group = c10d._new_process_group_helper

    def as_aiocoll(backend: Any) -> Any:
        text = "undefined" if backend is None else str(backend).lower()
        if text in ("gloo", "undefined"):
            return "aiocoll"
        if ":" in text:  # a device map such as "cpu:gloo,cuda:nccl"
            return ",".join(
                p.replace(":gloo", ":aiocoll") if p.endswith(":gloo") else p for p in text.split(",")
            )
        return backend

    @functools.wraps(make_group)
    def make_group_on_aiocoll(
        size: Any, rank: Any, ranks: Any, backend: Any, *args: Any, **kwargs: Any
    ) -> Any:
        return make_group(size, rank, ranks, as_aiocoll(backend), *args, **kwargs)

    c10d._new_process_group_helper = make_group_on_aiocoll


def _suite_class() -> type:
    from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend

    start_method = os.environ.get("AIOCOLL_TORCH_SUITE_START", "fork")

    class TestDistBackendOnCpu(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
        def setUp(self) -> None:
            super().setUp()
            import torch.multiprocessing as tmp

            self._start_processes(tmp.get_context(start_method).Process)

    TestDistBackendOnCpu.__module__ = __name__
    TestDistBackendOnCpu.__qualname__ = "TestDistBackendOnCpu"
    return TestDistBackendOnCpu


if os.environ.get(_WORKER_ENV):
    # Module level on purpose: spawned rank processes re-import this file and must see the same
    # class (by name) and the same substitution.
    os.environ["BACKEND"] = "gloo"  # the suite's gates read it at import
    if os.environ[_WORKER_ENV] == "aiocoll":
        _groups_asking_for_gloo_become_aiocoll()
    TestDistBackendOnCpu = _suite_class()


class _Recorder(unittest.TextTestResult):
    """Writes one JSON line per finished test, as it finishes (a killed worker keeps the rest)."""

    def __init__(self, out: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._out = out
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        row = {"test": name, "outcome": outcome, "seconds": round(time.monotonic() - self._started, 2)}
        if detail:
            row["detail"] = detail
        self._out.write(json.dumps(row) + "\n")
        self._out.flush()

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._record(test, "fail", _summary(self._exc_info_to_string(err, test)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._record(test, "fail", _summary(self._exc_info_to_string(err, test)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._record(test, "skip", reason[:200])

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._record(test, "pass", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._record(test, "fail", "unexpected success")


def _summary(text: str) -> str:
    """The most telling lines of a failure: the ranks' exception lines, else the last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    picked = [
        ln
        for ln in lines
        if ("Error" in ln or "Exception" in ln or "Timing out" in ln or "timed out" in ln)
        and not ln.startswith(("File ", "raise ", "Traceback"))
    ]
    chosen = picked[-3:] if picked else lines[-1:]
    return " | ".join(dict.fromkeys(chosen))[:600]


def _run_worker(args: argparse.Namespace) -> int:
    cls = TestDistBackendOnCpu
    names = sorted(n for n in dir(cls) if n.startswith("test_"))
    if args.k:
        names = [n for n in names if any(k in n for k in args.k)]
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(cls(n) for n in names)
    with open(args.json_lines, "a", buffering=1) as out:
        runner = unittest.TextTestRunner(
            stream=sys.stderr,
            verbosity=2,
            resultclass=lambda *a, **kw: _Recorder(out, *a, **kw),  # type: ignore[arg-type,return-value]
        )
        runner.run(suite)
    return 0


# ---------------------------------------------------------------------------------------------
# the driver


def _run_one(backend: str, world_size: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Run the suite for one backend and world size in a worker process; results by test name."""
    with tempfile.TemporaryDirectory(prefix=f"torch-suite-{backend}-{world_size}-") as tmp:
        lines = Path(tmp) / "results.jsonl"
        env = dict(os.environ)
        env.update(
            {
                _WORKER_ENV: backend,
                "WORLD_SIZE": str(world_size),
                "TEMP_DIR": tmp,
                "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
                "AIOCOLL_TORCH_SUITE_START": args.start_method,
                "MASTER_ADDR": "127.0.0.1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            }
        )
        env.pop("RANK", None)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--json-lines", str(lines)]
        for k in args.k or []:
            cmd += ["-k", k]
        log = Path(tmp) / "worker.log"
        started = time.monotonic()
        with open(log, "w") as logf:
            proc = subprocess.Popen(
                cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True
            )
            try:
                proc.wait(timeout=args.budget)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                print(f"  {backend} world size {world_size}: whole run past --budget {args.budget}s, killed")
        results: dict[str, dict[str, Any]] = {}
        if lines.exists():
            for line in lines.read_text().splitlines():
                row = json.loads(line)
                results[row.pop("test")] = row
        if args.keep_logs:
            dest = Path(args.keep_logs)
            dest.mkdir(parents=True, exist_ok=True)
            (dest / f"{backend}-{world_size}.log").write_text(log.read_text(errors="replace"))
        took = time.monotonic() - started
        print(
            f"  {backend:7s} world size {world_size}: {len(results)} tests in {took:.0f}s: "
            + ", ".join(
                f"{o} {sum(r['outcome'] == o for r in results.values())}" for o in ("pass", "fail", "skip")
            )
        )
        return results


# Tests that can pass only for a backend *named* gloo: torch records an aiocoll group as
# "aiocoll", as for a user who asked for it. Reported apart, not counted as aiocoll's failures.
NAME_CHECKS = {
    "test_get_backend": "asserts dist.get_backend() == 'gloo'",
    "test_monitored_barrier_gloo": "dist.monitored_barrier refuses groups not named gloo (torch's check)",
    "test_monitored_barrier_gloo_subgroup": "dist.monitored_barrier refuses groups not named gloo",
    "test_monitored_barrier_failure_order": "dist.monitored_barrier refuses groups not named gloo",
    "test_monitored_barrier_wait_all_ranks": "dist.monitored_barrier refuses groups not named gloo",
}


def _compare(world_size: int, by_backend: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    gloo, ours = by_backend.get("gloo"), by_backend.get("aiocoll")
    summary: dict[str, Any] = {"world_size": world_size}
    for name, res in by_backend.items():
        summary[name] = {
            o: sorted(t for t, r in res.items() if r["outcome"] == o) for o in ("pass", "fail", "skip")
        }
    if gloo is None or ours is None:
        for name, res in by_backend.items():
            for t, r in sorted(res.items()):
                if r["outcome"] == "fail":
                    print(f"    fails on {name}: {t}: {r.get('detail', '')[:300]}")
        return summary
    gloo_pass = {t for t, r in gloo.items() if r["outcome"] == "pass"}
    ours_pass = {t for t, r in ours.items() if r["outcome"] == "pass"}
    lost = sorted(gloo_pass - ours_pass)
    summary["name_checks"] = {t: ours[t] for t in lost if t in NAME_CHECKS and t in ours}
    summary["regressions"] = {
        t: ours.get(t, {"outcome": "missing"}) for t in lost if t not in summary["name_checks"]
    }
    summary["aiocoll_only"] = sorted(ours_pass - gloo_pass)
    print(
        f"world size {world_size}: gloo passes {len(gloo_pass)}, aiocoll passes "
        f"{len(gloo_pass & ours_pass)} of those"
        + (f" (and {len(ours_pass - gloo_pass)} gloo does not)" if ours_pass - gloo_pass else "")
        + (f"; {len(summary['name_checks'])} others need the name gloo" if summary["name_checks"] else "")
    )
    for t, r in summary["name_checks"].items():
        print(f"    passes on gloo, {r['outcome']} on aiocoll (needs the name gloo: {NAME_CHECKS[t]}): {t}")
    for t, r in summary["regressions"].items():
        print(f"    passes on gloo, {r['outcome']} on aiocoll: {t}: {r.get('detail', '')[:300]}")
    for t in summary["aiocoll_only"]:
        print(f"    passes on aiocoll, {gloo[t]['outcome']} on gloo: {t}: {gloo[t].get('detail', '')[:200]}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run torch's distributed test suite (_DistTestBase) on gloo and on aiocoll "
        "(every group that asks for gloo created as aiocoll) and compare per test.",
    )
    parser.add_argument("--backend", nargs="+", choices=["gloo", "aiocoll"], default=["gloo", "aiocoll"])
    parser.add_argument(
        "--world-size", nargs="+", type=int, default=[2], help="world sizes to run (default 2)"
    )
    parser.add_argument("-k", action="append", help="run only tests whose name contains this (repeatable)")
    parser.add_argument("--timeout", type=int, default=120, help="seconds each test may take (default 120)")
    parser.add_argument(
        "--budget", type=int, default=4 * 3600, help="seconds one backend+world size may take"
    )
    parser.add_argument(
        "--start-method",
        choices=["fork", "spawn"],
        default="fork",
        help="how rank processes start: fork (default, fast on CPU) or spawn (as torch's CI)",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="run the backends at once, each in its own worker (their tests wait on timeouts and "
        "rendezvous much of the time)",
    )
    parser.add_argument("--json", help="write the per-test results and comparison here")
    parser.add_argument("--keep-logs", metavar="DIR", help="keep each worker's full log in DIR")
    parser.add_argument("--list", action="store_true", help="list the selected tests and exit")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-lines", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        return _run_worker(args)
    if args.list:
        env = dict(os.environ, **{_WORKER_ENV: "gloo", "WORLD_SIZE": "2", "TEMP_DIR": tempfile.gettempdir()})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--list"]
        for k in args.k or []:
            cmd += ["-k", k]
        return subprocess.run(cmd, env=env).returncode

    import torch

    record: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "selection": args.k or "all",
        "start_method": args.start_method,
        "runs": [],
    }
    ok = True
    for ws in args.world_size:
        if args.parallel:
            with ThreadPoolExecutor(len(args.backend)) as runs:
                started = {b: runs.submit(_run_one, b, ws, args) for b in args.backend}
                by_backend = {b: run.result() for b, run in started.items()}
        else:
            by_backend = {b: _run_one(b, ws, args) for b in args.backend}
        summary = _compare(ws, by_backend)
        summary["results"] = by_backend
        record["runs"].append(summary)
        ok = ok and not summary.get("regressions")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
