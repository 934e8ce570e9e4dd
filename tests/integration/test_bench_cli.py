"""`aiocoll bench` end to end: real ranks over loopback, the table, --json and --plot.

One spawned world (2 ranks, 2 sizes, 2 iterations) serves the table, JSON and PNG checks; the
numbers themselves are never asserted (a benchmark measures, tests check truth) — only that the
right rows and columns come out and that the bandwidth follows its definition from the time.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aiocoll.cli._bench_common import bus_factor, parse_sizes, rounded_size, summarize

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "aiocoll", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.timeout(30)
def test_bench_help_lists_the_options_of_the_contract() -> None:
    result = _bench("--help", timeout=25)
    assert result.returncode == 0, result.stderr
    for option in ("--op", "--sizes", "--world-size", "--vs", "--plot", "--iters", "--warmup", "--json"):
        assert option in result.stdout
    assert "busbw" in result.stdout


@pytest.mark.timeout(30)
def test_bench_rejects_tcpstore_comparison_for_a_collective_with_a_usage_error() -> None:
    result = _bench("--op", "all_reduce", "--vs", "tcpstore", timeout=25)
    assert result.returncode == 2
    assert "--vs tcpstore" in result.stderr and "--vs gloo" in result.stderr


@pytest.mark.timeout(60)
def test_bench_torch_cuda_fails_clearly_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: tests/integration/test_cuda.py runs the CUDA bench")
    result = _bench("--tensor", "torch-cuda", "--sizes", "4K", timeout=55)
    assert result.returncode == 1
    assert "--tensor torch-cuda needs a CUDA device" in result.stderr
    result = _bench("--vs", "nccl", "--sizes", "4K", timeout=55)
    assert result.returncode == 1 and "add --tensor torch-cuda" in result.stderr


@pytest.mark.timeout(30)
def test_bench_rejects_a_malformed_size_sweep_naming_it() -> None:
    result = _bench("--sizes", "64M:4", "--world-size", "2", timeout=25)
    assert result.returncode == 1
    assert "64M:4" in result.stderr


@pytest.mark.timeout(90)
def test_bench_all_reduce_two_ranks_prints_table_and_writes_json_and_png(tmp_path: Path) -> None:
    json_path = tmp_path / "bench.json"
    png_path = tmp_path / "bench.png"
    result = _bench(
        "--op",
        "all_reduce",
        "--sizes",
        "4,64K",
        "--world-size",
        "2",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--timeout",
        "60",
        "--json",
        str(json_path),
        "--plot",
        str(png_path),
        "--quiet",
    )
    assert result.returncode == 0, result.stdout + result.stderr

    header = next(line for line in result.stdout.splitlines() if "size(B)" in line).split()
    assert header == ["size(B)", "count", "algo", "time(us)", "avg(us)", "min(us)", "algbw", "busbw"]
    rows = _table_rows(result.stdout)
    rows = [r for r in rows if r != header]
    assert [int(r[0]) for r in rows] == [4, 65536]
    assert [int(r[1]) for r in rows] == [1, 16384]  # float32 elements
    for row in rows:
        assert row[2] in ("ring", "rhd", "tree", "shm")  # shm: both ranks share this host
        assert float(row[3]) >= float(row[5]) > 0 and float(row[4]) > 0  # median >= min; a mean

    report = json.loads(json_path.read_text())
    assert report["meta"]["world_size"] == 2 and report["meta"]["ops"] == ["all_reduce"]
    results = report["results"]
    assert [r["size"] for r in results] == [4, 65536]
    for r in results:
        ours = r["aiocoll"]
        assert ours["iters"] == 2
        algbw = r["size"] / (ours["time_us"] * 1e-6) / 1e9
        assert math.isclose(ours["algbw"], algbw, rel_tol=1e-9)
        assert math.isclose(ours["busbw"], algbw * 2 * (2 - 1) / 2, rel_tol=1e-9)

    data = png_path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or importlib.util.find_spec("torch") is None,
    reason="--vs gloo,mpi needs torch and mpi4py with an MPI (pip install 'aiocoll[torch,mpi]')",
)
def test_bench_against_gloo_and_mpi_at_once_under_cpu_hogs(tmp_path: Path) -> None:
    """One invocation: aiocoll, gloo and MPI in one table and one JSON, with a hog beside them
    that is gone afterwards; each contender's result was checked by the bench before timing.
    (One hog: it spins for the whole bench, and the suite's other tests run beside it.)"""
    json_path = tmp_path / "bench.json"
    result = _bench(
        *("--op", "all_reduce", "--sizes", "4,64K", "--world-size", "2", "--iters", "2", "--warmup", "1"),
        *("--vs", "gloo,mpi", "--hog", "1", "--transport", "tcp", "--timeout", "60", "--quiet"),
        *("--json", str(json_path)),
        timeout=110,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    header = next(line for line in result.stdout.splitlines() if "size(B)" in line).split()
    for column in ("gloo(us)", "mpi(us)", "mpi_busbw", "time/gloo", "time/mpi", "busbw/gloo", "busbw/mpi"):
        assert column in header
    assert "1 CPU hog(s)" in result.stdout and "transport tcp" in result.stdout
    report = json.loads(json_path.read_text())
    meta = report["meta"]
    assert meta["vs"] == ["gloo", "mpi"] and meta["hog"] == 1 and meta["transport"] == "tcp"
    assert len(meta["hog_pids"]) == 1
    assert [r["size"] for r in report["results"]] == [4, 65536]
    for row in report["results"]:
        for contender in ("gloo", "mpi"):
            assert row[contender]["iters"] == 2
            ratio = row["aiocoll"]["time_us"] / row[contender]["time_us"]
            assert math.isclose(row["ratios"][contender]["time"], ratio, rel_tol=1e-9)
    for pid in meta["hog_pids"]:  # ended by the bench, not left spinning
        assert not Path(f"/proc/{pid}").exists() or "1000003" not in Path(f"/proc/{pid}/cmdline").read_text()


@pytest.mark.timeout(150)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="--api torch and --vs gloo need torch")
def test_bench_api_measures_sync_and_the_torch_backend_beside_async_and_gloo(tmp_path: Path) -> None:
    """One invocation: the async API, aiocoll.sync, the torch backend and gloo in one table; each
    API's result was checked by the bench before timing, and its ratios are to the async API."""
    json_path = tmp_path / "bench.json"
    result = _bench(
        *("--op", "all_reduce", "--sizes", "4,64K", "--world-size", "2", "--iters", "2", "--warmup", "1"),
        *("--api", "async,sync,torch", "--vs", "gloo", "--tensor", "torch", "--timeout", "60", "--quiet"),
        *("--json", str(json_path)),
        timeout=140,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    header = next(line for line in result.stdout.splitlines() if "size(B)" in line).split()
    for column in ("sync(us)", "torch(us)", "gloo(us)", "time:sync/async", "time:torch/async", "time/gloo"):
        assert column in header
    report = json.loads(json_path.read_text())
    assert report["meta"]["api"] == ["async", "sync", "torch"] and report["meta"]["vs"] == ["gloo"]
    assert [r["size"] for r in report["results"]] == [4, 65536]
    for row in report["results"]:
        for api in ("sync", "torch"):
            assert row[api]["iters"] == 2
            ratio = row[api]["time_us"] / row["aiocoll"]["time_us"]
            assert math.isclose(row["ratios"][api]["time"], ratio, rel_tol=1e-9)
        assert math.isclose(
            row["ratios"]["gloo"]["time"], row["aiocoll"]["time_us"] / row["gloo"]["time_us"], rel_tol=1e-9
        )


@pytest.mark.timeout(30)
def test_bench_rejects_an_unknown_api_or_one_beside_the_store() -> None:
    unknown = _bench("--api", "async,bogus", timeout=25)
    assert unknown.returncode == 2 and "--api 'async,bogus'" in unknown.stderr
    misplaced = _bench("--op", "store", "--api", "sync", timeout=25)
    assert misplaced.returncode == 2 and "--api goes with the collectives" in misplaced.stderr


@pytest.mark.timeout(30)
def test_bench_rejects_an_unknown_or_misplaced_contender() -> None:
    unknown = _bench("--vs", "gloo,bogus", timeout=25)
    assert unknown.returncode == 2 and "gloo,bogus" in unknown.stderr
    misplaced = _bench("--op", "store", "--vs", "mpi", timeout=25)
    assert misplaced.returncode == 2 and "tcpstore" in misplaced.stderr


def test_size_sweep_doubles_and_lists_parse_with_suffixes() -> None:
    assert parse_sizes("4:64") == [4, 8, 16, 32, 64]
    assert parse_sizes("1K:4K") == [1024, 2048, 4096]
    assert parse_sizes("4,64K,16M,1G") == [4, 65536, 16 << 20, 1 << 30]
    assert parse_sizes("4:64M")[-1] == 64 << 20 and len(parse_sizes("4:64M")) == 25
    with pytest.raises(ValueError, match="MIN"):
        parse_sizes("8:4")
    with pytest.raises(ValueError, match="bad size"):
        parse_sizes("4X")


def test_bus_factors_follow_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == bus_factor("reduce", 3) == 1.0
    assert math.isnan(bus_factor("barrier", 4))


def test_split_ops_round_sizes_to_whole_elements_per_rank() -> None:
    assert rounded_size("all_gather", 4, 4, 4) == 16
    assert rounded_size("all_to_all", 100, 3, 4) == 96
    assert rounded_size("all_reduce", 6, 4, 4) == 4


def test_summary_takes_the_slowest_rank_per_iteration_then_the_median() -> None:
    row = summarize("all_reduce", 1000, 2, [[1.0, 3.0, 2.0], [2.0, 1.0, 5.0]])
    # per iteration: max(1,2)=2, max(3,1)=3, max(2,5)=5 -> median 3, min 2
    assert row["time_us"] == pytest.approx(3e6)
    assert row["min_us"] == pytest.approx(2e6)
    assert row["algbw"] == pytest.approx(1000 / 3.0 / 1e9)


@pytest.mark.timeout(90)
def test_bench_store_measures_async_and_sync_clients_and_records_the_mode(tmp_path: Path) -> None:
    json_path = tmp_path / "store.json"
    for acked in (False, True):
        result = _bench(
            "--op",
            "store",
            "--clients",
            "1",
            "--store-ops",
            "50",
            "--rounds",
            "1",
            *(["--acked-sets", "--state-dir"] if acked else []),
            "--json",
            str(json_path),
        )
        assert result.returncode == 0, result.stderr[-3000:]
        rows = _table_rows(result.stdout)
        ops = ["set", "get", "add", "check", "wait", "multi_get", "compare_set"]
        assert [row[:2] for row in rows] == [["1", op] for op in ops]
        assert all(float(row[2]) > 0 and float(row[3]) > 0 for row in rows), "async and sync clients"
        data = json.loads(json_path.read_text())
        assert data["meta"]["pipeline_sets"] is not acked and data["meta"]["state_dir"] is acked
        if acked:
            assert "wait for their acknowledgement (--acked-sets)" in result.stdout
            assert "runs with --state-dir" in result.stdout
        else:
            assert "sets are not answered" in result.stdout
    assert [r["op"] for r in data["results"]] == ops


@pytest.mark.timeout(120)
def test_bench_simulated_rendezvous_reports_both_ends_cpu_time(tmp_path: Path) -> None:
    # 64 simulated hosts of 8 ranks on 2 processes: the row, the probe's answers, and the CPU time
    # of the coordinator and of the simulated hosts between the release and the last table
    # (read from /proc and from each process), with the lower bound they put on the wall time.
    json_path = tmp_path / "sim.json"
    result = _bench(
        "--op", "rendezvous", "--procs", "", "--simulated", "512", "--ranks-per-host", "8",
        "--sim-procs", "2", "--rounds", "1", "--json", str(json_path), timeout=100,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (table_row,) = _table_rows(result.stdout)
    assert table_row[:4] == ["cold,", "simulated", "2", "512"] and float(table_row[4]) > 0
    (row,) = json.loads(json_path.read_text())["results"]
    coordinator, hosts = row["coordinator_cpu_s"], row["hosts_cpu_s"]
    assert isinstance(coordinator, float) and isinstance(hosts, float)
    assert coordinator >= 0 and hosts >= 0
    cores = os.cpu_count() or 1
    assert (
        f"coordinator {coordinator:.2f} s ({coordinator / 512 * 1e6:.0f} us per rank), simulated hosts "
        f"{hosts:.2f} s ({hosts / 64 * 1e3:.2f} ms per host); on {cores} cores the rendezvous takes at "
        f"least their sum / {cores} = {(coordinator + hosts) / cores:.2f} s"
    ) in result.stdout
    assert "slowest answers of the coordinator meanwhile: /healthz" in result.stdout
