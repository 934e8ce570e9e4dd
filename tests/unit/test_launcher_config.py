"""`aiocoll run`'s rules without spawning anything: node placement from the command line, SLURM
and Kubernetes variables, coordinator addresses, worker commands and environments, and the
command-line errors (which must name what is wrong and exit 2)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from aiocoll.cli import run
from aiocoll.cli._launch_agent import describe_returncode, exit_code_of
from aiocoll.cli._launch_config import (
    LaunchConfigError,
    build_worker_command,
    check_script,
    format_host_port,
    parse_coordinator_address,
    resolve_node_placement,
    resolve_torch_store_address,
    worker_environment,
)

pytestmark = pytest.mark.timeout(30)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="aiocoll run")
    run.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_placement_defaults_to_one_node_of_rank_zero() -> None:
    placement = resolve_node_placement(None, None, {})
    assert (placement.nnodes, placement.node_rank) == (1, 0)
    assert placement.sources == () and placement.warnings == ()


def test_placement_reads_srun_task_variables() -> None:
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_NNODES": "3", "SLURM_NODEID": "2"}
    placement = resolve_node_placement(None, None, env)
    assert (placement.nnodes, placement.node_rank) == (3, 2)
    assert any("SLURM_PROCID" in s for s in placement.sources)
    assert placement.warnings == ()


def test_placement_warns_when_srun_puts_several_launchers_on_one_node() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2"}
    placement = resolve_node_placement(None, None, env)
    assert (placement.nnodes, placement.node_rank) == (4, 1)
    assert len(placement.warnings) == 1 and "--ntasks-per-node=1" in placement.warnings[0]


def test_placement_ignores_slurm_outside_an_srun_task() -> None:
    # An salloc shell has SLURM_NNODES but no SLURM_PROCID: that is not a launcher task.
    placement = resolve_node_placement(None, None, {"SLURM_NNODES": "4", "SLURM_NTASKS": "4"})
    assert (placement.nnodes, placement.node_rank) == (1, 0)


def test_command_line_wins_over_scheduler_variables() -> None:
    env = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "JOB_COMPLETION_INDEX": "1"}
    placement = resolve_node_placement(5, 4, env)
    assert (placement.nnodes, placement.node_rank) == (5, 4)


def test_placement_reads_kubernetes_completion_index_with_explicit_nnodes() -> None:
    placement = resolve_node_placement(4, None, {"JOB_COMPLETION_INDEX": "3"})
    assert (placement.nnodes, placement.node_rank) == (4, 3)
    assert any("JOB_COMPLETION_INDEX" in s for s in placement.sources)


def test_kubernetes_index_without_nnodes_says_to_pass_nnodes() -> None:
    with pytest.raises(LaunchConfigError, match=r"node rank 2 is outside 0\.\.0.*--nnodes"):
        resolve_node_placement(None, None, {"JOB_COMPLETION_INDEX": "2"})


def test_node_rank_outside_nnodes_is_refused() -> None:
    with pytest.raises(LaunchConfigError, match=r"node rank 2 is outside 0\.\.1"):
        resolve_node_placement(2, 2, {})


def test_non_integer_scheduler_variable_is_named() -> None:
    with pytest.raises(LaunchConfigError, match="SLURM_PROCID='x'"):
        resolve_node_placement(None, None, {"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:29501", ("10.0.0.1", 29501)),
        ("10.0.0.1", ("10.0.0.1", 29500)),
        ("tcp://127.0.0.1:4000", ("127.0.0.1", 4000)),
        ("[::1]:7000", ("::1", 7000)),
        ("[fe80::1]", ("fe80::1", 29500)),
    ],
)
def test_coordinator_addresses_parse(text: str, expected: tuple[str, int]) -> None:
    assert parse_coordinator_address(text) == expected


@pytest.mark.parametrize(
    ("text", "fragment"),
    [(":29500", "no host"), ("h:abc", "not a number"), ("h:70000", "outside"), ("::1:5", "brackets")],
)
def test_bad_coordinator_addresses_say_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(LaunchConfigError, match=fragment):
        parse_coordinator_address(text)


def test_worker_commands_for_script_module_and_program() -> None:
    assert build_worker_command("t.py", ["--a", "1"], python="py") == ("py", "-u", "t.py", "--a", "1")
    module_command = build_worker_command("pkg.mod", ["x"], module=True, python="py")
    assert module_command == ("py", "-u", "-m", "pkg.mod", "x")
    assert build_worker_command("/bin/prog", ["x"], no_python=True) == ("/bin/prog", "x")
    with pytest.raises(LaunchConfigError, match="cannot be used together"):
        build_worker_command("m", [], module=True, no_python=True)


def test_worker_environment_numbers_ranks_by_node_and_passes_the_rest_through(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    args = _parse(
        "--nnodes", "3", "--node_rank", "2", "--nproc_per_node", "4", "--coordinator", "10.1.2.3:4567",
        "--job", "exp", "--max_restarts", "2", "--token-file", str(token_file), "train.py",
    )
    config = run.build_config(args, {})
    env = worker_environment(
        config, {"PATH": "/bin", "AIOCOLL_TOKEN": "old", "AIOCOLL_COORDINATOR": "stale:1"}, local_rank=1,
        restart_count=2, coordinator=("10.1.2.3", 4567), master_addr="10.9.9.9", master_port=29500,
    )
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4",
    }
    assert env["GROUP_RANK"] == "2" and env["GROUP_WORLD_SIZE"] == "3"
    # The coordinator and torch's rank-0 store are two different addresses, each in its variable.
    assert env["AIOCOLL_COORDINATOR"] == "10.1.2.3:4567"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.9.9.9", "29500")
    assert env["AIOCOLL_JOB"] == "exp" and env["AIOCOLL_RESTART_COUNT"] == "2"
    assert env["AIOCOLL_MAX_RESTARTS"] == "2"
    assert env["AIOCOLL_TOKEN"] == "s3cret"  # the token file wins over the inherited variable
    assert env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1"


def test_worker_environment_keeps_inherited_token_and_thread_settings() -> None:
    config = run.build_config(_parse("--nproc-per-node", "2", "--coordinator", "127.0.0.1:1", "t.py"), {})
    env = worker_environment(
        config, {"AIOCOLL_TOKEN": "inherited", "OMP_NUM_THREADS": "4"}, local_rank=0, restart_count=0,
        coordinator=("127.0.0.1", 1), master_addr="127.0.0.1", master_port=2,
    )
    assert env["AIOCOLL_TOKEN"] == "inherited" and env["OMP_NUM_THREADS"] == "4"
    assert env["AIOCOLL_JOB"] == "default"


def test_dash_and_underscore_spellings_mean_the_same() -> None:
    dashed = _parse("--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--max-restarts", "3",
                    "--monitor-interval", "0.5", "--rdzv-endpoint", "h:1", "s.py")
    under = _parse("--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--max_restarts", "3",
                   "--monitor_interval", "0.5", "--rdzv_endpoint", "h:1", "s.py")
    assert vars(dashed) == vars(under)


def test_options_after_the_script_belong_to_the_script() -> None:
    args = _parse("--nproc-per-node", "2", "train.py", "--nproc-per-node", "7", "-m")
    assert args.nproc_per_node == 2 and args.module is False
    assert args.script == "train.py" and args.script_args == ["--nproc-per-node", "7", "-m"]


def test_worker_environment_brackets_an_ipv6_coordinator() -> None:
    config = run.build_config(_parse("--coordinator", "[fd00::1]:7000", "t.py"), {})
    env = worker_environment(
        config, {}, local_rank=0, restart_count=0, coordinator=("fd00::1", 7000),
        master_addr="127.0.0.1", master_port=3,
    )
    assert env["AIOCOLL_COORDINATOR"] == "[fd00::1]:7000"
    assert parse_coordinator_address(env["AIOCOLL_COORDINATOR"]) == ("fd00::1", 7000)
    assert format_host_port("10.0.0.1", 5) == "10.0.0.1:5"


def test_master_addr_and_port_name_the_torch_store_not_the_coordinator() -> None:
    config = run.build_config(_parse("--master_addr", "10.0.0.9", "--master_port", "1234", "s.py"), {})
    # No --coordinator: the launcher embeds one, on a port of its own choosing.
    assert config.coordinator is None and config.embedded_port == 0
    assert (config.master_addr, config.master_port) == ("10.0.0.9", 1234)
    store = resolve_torch_store_address(config, ("127.0.0.1", 40000), _no_free_port)
    assert (store.addr, store.port, store.warnings) == ("10.0.0.9", 1234, ())
    # Both may be given together now: they name two different things.
    config = run.build_config(
        _parse("--coordinator", "10.0.0.1:29500", "--master-addr", "10.0.0.2", "--master-port", "29600",
               "s.py"),
        {},
    )
    assert config.coordinator == ("10.0.0.1", 29500)
    assert (config.master_addr, config.master_port) == ("10.0.0.2", 29600)


def _no_free_port() -> int:
    raise AssertionError("no free port should be picked when --master-port is given")


def test_single_node_store_is_loopback_on_a_free_port_distinct_from_the_coordinator() -> None:
    config = run.build_config(_parse("--nproc-per-node", "2", "s.py"), {})
    picked: list[int] = []

    def pick() -> int:
        picked.append(41001)
        return 41001

    store = resolve_torch_store_address(config, ("127.0.0.1", 41000), pick)
    assert (store.addr, store.port) == ("127.0.0.1", 41001) and picked == [41001]
    assert store.warnings == ()
    # An external coordinator changes nothing: the workers are local, so is rank 0's store.
    config = run.build_config(_parse("--coordinator", "10.0.0.1:29500", "s.py"), {})
    store = resolve_torch_store_address(config, ("10.0.0.1", 29500), lambda: 41002)
    assert (store.addr, store.port) == ("127.0.0.1", 41002)
    # --master-port alone keeps the loopback address.
    config = run.build_config(_parse("--master-port", "29511", "s.py"), {})
    store = resolve_torch_store_address(config, ("127.0.0.1", 41000), _no_free_port)
    assert (store.addr, store.port) == ("127.0.0.1", 29511)


def test_several_nodes_default_to_the_coordinator_host_and_29500_and_say_to_pass_master_addr() -> None:
    argv = ("--nnodes", "2", "--node-rank", "1", "--coordinator", "10.0.0.1:7000", "s.py")
    config = run.build_config(_parse(*argv), {})
    store = resolve_torch_store_address(config, ("10.0.0.1", 7000), _no_free_port)
    assert (store.addr, store.port) == ("10.0.0.1", 29500)
    assert len(store.warnings) == 1 and "--master-addr NODE0_ADDR" in store.warnings[0]
    config = run.build_config(_parse("--master-addr", "10.0.0.2", *argv), {})
    store = resolve_torch_store_address(config, ("10.0.0.1", 7000), _no_free_port)
    assert (store.addr, store.port, store.warnings) == ("10.0.0.2", 29500, ())


def test_a_store_address_equal_to_the_coordinators_is_refused_or_flagged() -> None:
    explicit = run.build_config(
        _parse("--coordinator", "127.0.0.1:29600", "--master-addr", "127.0.0.1", "--master-port", "29600",
               "s.py"),
        {},
    )
    with pytest.raises(LaunchConfigError, match=r"127\.0\.0\.1:29600 is the coordinator's own address"):
        resolve_torch_store_address(explicit, ("127.0.0.1", 29600), _no_free_port)
    # Several nodes with the defaults and a coordinator on 29500: aiocoll scripts work, torch-store
    # scripts would not, so the launcher says so rather than refusing.
    derived = run.build_config(_parse("--nnodes", "2", "--coordinator", "10.0.0.1:29500", "s.py"), {})
    store = resolve_torch_store_address(derived, ("10.0.0.1", 29500), _no_free_port)
    assert (store.addr, store.port) == ("10.0.0.1", 29500)
    assert any("coordinator's own address" in w and "--master-port" in w for w in store.warnings)


def test_job_defaults_to_the_environment_then_default() -> None:
    assert run.build_config(_parse("s.py"), {"AIOCOLL_JOB": "from-env"}).job == "from-env"
    assert run.build_config(_parse("s.py"), {}).job == "default"
    assert run.build_config(_parse("--job", "j", "s.py"), {"AIOCOLL_JOB": "from-env"}).job == "j"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--nnodes", "2", "--node-rank", "0", "s.py"], "--nnodes 2 needs --coordinator HOST:PORT"),
        (["--standalone", "--nnodes", "2", "--coordinator", "h:1", "s.py"], "--standalone means a single"),
        (["--nnodes", "2", "--master-addr", "h", "s.py"], "--master-addr names the host of torch's rank-0"),
        (["--master-addr", " ", "s.py"], "--master-addr is empty"),
        (["-m", "--no-python", "s"], "cannot be used together"),
        (["--token-file", "/nonexistent/token", "s.py"], "cannot read --token-file"),
    ],
)
def test_bad_command_lines_exit_2_naming_the_problem(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run.main(_parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("[aiocoll run] error: ") and fragment in err


def test_empty_token_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t").write_text("  \n")
    assert run.main(_parse("--token-file", str(tmp_path / "t"), "s.py")) == 2
    assert "is empty" in capsys.readouterr().err


def test_master_port_must_be_a_port_number(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse("--master-port", "70000", "s.py")
    assert info.value.code == 2 and "1..65535" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_nproc_per_node_must_be_a_positive_integer(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parse("--nproc-per-node", value, "s.py")
    assert info.value.code == 2 and "--nproc-per-node" in capsys.readouterr().err


def test_elastic_node_ranges_are_refused_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--nnodes", "1:4", "s.py")
    assert "elastic node ranges" in capsys.readouterr().err


def test_exit_status_of_a_failed_worker() -> None:
    assert exit_code_of(3) == 3
    assert exit_code_of(-9) == 137
    assert describe_returncode(-15) == "killed by signal SIGTERM"
    assert describe_returncode(2) == "exit code 2"


def test_help_has_examples_and_both_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--help")
    out = capsys.readouterr().out
    for fragment in ("examples:", "--nproc-per-node", "--nproc_per_node", "--max-restarts", "SLURM_PROCID",
                     "JOB_COMPLETION_INDEX", "exit status:"):
        assert fragment in out, fragment


def test_a_missing_script_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert run.main(_parse("--nproc-per-node", "2", "nosuch.py")) == 2
    err = capsys.readouterr().err
    assert err.startswith("[aiocoll run] error: SCRIPT 'nosuch.py' does not exist")
    assert str(tmp_path / "nosuch.py") in err
    assert run.main(_parse("train")) == 2
    assert "to run the module 'train', pass -m train" in capsys.readouterr().err
    (tmp_path / "there.py").write_text("")
    (tmp_path / "package").mkdir()
    check_script("there.py")
    check_script(str(tmp_path / "package"))  # a directory (or zip) with __main__.py runs too
    check_script("-")  # the script on standard input
    check_script("some.module", module=True)  # found by Python in the worker
    check_script("no-such-program", no_python=True)  # a spawn failure is exit 127, per worker


def test_connect_timeout_defaults_to_30_seconds_and_must_be_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run.build_config(_parse("--coordinator", "h:1", "s.py"), {}).connect_timeout == 30.0
    config = run.build_config(_parse("--coordinator", "h:1", "--connect-timeout", "2.5", "s.py"), {})
    assert config.connect_timeout == 2.5
    with pytest.raises(SystemExit):
        _parse("--connect-timeout", "0", "s.py")
    assert "--connect-timeout" in capsys.readouterr().err


def test_the_container_docs_start_workers_against_the_containers_coordinator() -> None:
    """docs/CONTAINER.md: every `aiocoll run` line names the container's coordinator (an
    `aiocoll run` without --coordinator runs one of its own and ignores the container) and
    reads the token from a file, as the `aiocoll status` line beside it does."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "CONTAINER.md").read_text()
    commands = [
        line.split("aiocoll run", 1)[1].split("#")[0]
        for line in text.replace("\\\n", " ").splitlines()
        if "aiocoll run " in line and not line.lstrip().startswith("#")
    ]
    assert commands, "CONTAINER.md shows how workers use the container"
    for command in commands:
        args = _parse(*command.replace("<host>", "coordinator-host").split())
        assert args.coordinator is not None, command
        assert parse_coordinator_address(args.coordinator) == ("coordinator-host", 29500), command
        assert args.token_file is not None, command
    status = [line for line in text.splitlines() if "aiocoll status --coordinator <host>:29500" in line]
    assert status and all("--token-file" in line for line in status)
