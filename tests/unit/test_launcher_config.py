"""`aiocoll run`'s rules without spawning anything: node placement from the command line, SLURM
and Kubernetes variables, coordinator addresses, worker commands and environments, and the
command-line errors (which must name what is wrong and exit 2)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from aiocoll.cli import run
from aiocoll.cli._launch_agent import describe_returncode, exit_code_of
from aiocoll.cli._launch_config import (
    DEFAULT_JOIN_WINDOW,
    DEFAULT_NODE_TIMEOUT,
    DEFAULT_RDZV_TIMEOUT,
    ElasticSpec,
    LaunchConfigError,
    NodeCount,
    RankLayout,
    build_worker_command,
    check_script,
    elastic_torch_store_address,
    format_host_port,
    parse_coordinator_address,
    parse_nnodes,
    resolve_node_placement,
    resolve_torch_store_address,
    worker_environment,
)
from aiocoll.cli._launch_nodes import (
    CLOSED,
    FAILED,
    FINISHED,
    FORMING,
    JOINED,
    LEFT,
    LOST,
    REJOINED,
    RUNNING,
    Admitted,
    Beats,
    Ended,
    Ending,
    Finished,
    Node,
    NodeState,
    NodeStateError,
    View,
    Wait,
    Write,
    assign_node_ranks,
    close_formation,
    close_run,
    decode_state,
    encode_state,
    end_generation,
    formation_wait,
    join_step,
    layout_of,
    leave,
    mark_done,
    new_run,
    running_step,
    watched_nodes,
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
        "--nnodes",
        "3",
        "--node_rank",
        "2",
        "--nproc_per_node",
        "4",
        "--coordinator",
        "10.1.2.3:4567",
        "--job",
        "exp",
        "--max_restarts",
        "2",
        "--token-file",
        str(token_file),
        "train.py",
    )
    config = run.build_config(args, {})
    env = worker_environment(
        config,
        {"PATH": "/bin", "AIOCOLL_TOKEN": "old", "AIOCOLL_COORDINATOR": "stale:1"},
        local_rank=1,
        restart_count=2,
        coordinator=("10.1.2.3", 4567),
        master_addr="10.9.9.9",
        master_port=29500,
    )
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")} == {
        "RANK": "9",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "12",
        "LOCAL_WORLD_SIZE": "4",
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
        config,
        {"AIOCOLL_TOKEN": "inherited", "OMP_NUM_THREADS": "4"},
        local_rank=0,
        restart_count=0,
        coordinator=("127.0.0.1", 1),
        master_addr="127.0.0.1",
        master_port=2,
    )
    assert env["AIOCOLL_TOKEN"] == "inherited" and env["OMP_NUM_THREADS"] == "4"
    assert env["AIOCOLL_JOB"] == "default"


def test_dash_and_underscore_spellings_mean_the_same() -> None:
    dashed = _parse(
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.5",
        "--rdzv-endpoint",
        "h:1",
        "s.py",
    )
    under = _parse(
        "--nproc_per_node",
        "2",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--max_restarts",
        "3",
        "--monitor_interval",
        "0.5",
        "--rdzv_endpoint",
        "h:1",
        "s.py",
    )
    assert vars(dashed) == vars(under)


def test_options_after_the_script_belong_to_the_script() -> None:
    args = _parse("--nproc-per-node", "2", "train.py", "--nproc-per-node", "7", "-m")
    assert args.nproc_per_node == 2 and args.module is False
    assert args.script == "train.py" and args.script_args == ["--nproc-per-node", "7", "-m"]


def test_worker_environment_brackets_an_ipv6_coordinator() -> None:
    config = run.build_config(_parse("--coordinator", "[fd00::1]:7000", "t.py"), {})
    env = worker_environment(
        config,
        {},
        local_rank=0,
        restart_count=0,
        coordinator=("fd00::1", 7000),
        master_addr="127.0.0.1",
        master_port=3,
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
        _parse(
            "--coordinator", "10.0.0.1:29500", "--master-addr", "10.0.0.2", "--master-port", "29600", "s.py"
        ),
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
        _parse(
            "--coordinator", "127.0.0.1:29600", "--master-addr", "127.0.0.1", "--master-port", "29600", "s.py"
        ),
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


def test_nnodes_is_a_fixed_count_or_an_elastic_range() -> None:
    fixed = run.build_config(_parse("--nnodes", "3", "--node-rank", "1", "--coordinator", "h:1", "s.py"), {})
    assert fixed.elastic is None and (fixed.placement.nnodes, fixed.placement.node_rank) == (3, 1)
    single = run.build_config(_parse("--nnodes", "1:1", "s.py"), {})
    assert single.elastic is None and single.placement.nnodes == 1  # a range of one node is one node
    elastic = run.build_config(_parse("--nnodes", "2:4", "--coordinator", "h:1", "s.py"), {})
    assert elastic.elastic == ElasticSpec(
        min_nodes=2,
        max_nodes=4,
        join_window=DEFAULT_JOIN_WINDOW,
        rdzv_timeout=DEFAULT_RDZV_TIMEOUT,
        node_timeout=DEFAULT_NODE_TIMEOUT,
    )
    assert elastic.placement.nnodes == 4 and "decided at each generation" in elastic.placement.sources[0]
    timed = run.build_config(
        _parse(
            "--nnodes",
            "2:2",
            "--coordinator",
            "h:1",
            "--rdzv-join-window",
            "0.5",
            "--rdzv_timeout",
            "30",
            "--heartbeat-timeout",
            "3",
            "s.py",
        ),
        {},
    )
    assert timed.elastic == ElasticSpec(2, 2, join_window=0.5, rdzv_timeout=30.0, node_timeout=3.0)
    assert parse_nnodes("2:4") == NodeCount(2, 4, ranged=True) and str(parse_nnodes("2:4")) == "2:4"
    assert parse_nnodes(" 3 ") == NodeCount(3, 3) and not parse_nnodes("3").elastic


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("4:2", "MIN 4 is above MAX 2 in '4:2'; write MIN:MAX, e.g. 2:4"),
        ("0:2", "node counts must be at least 1"),
        ("0", "node counts must be at least 1"),
        ("a:b", "expected M or MIN:MAX with whole numbers"),
        ("1:2:3", "expected M or MIN:MAX (e.g. 2:4)"),
        ("2:", "expected M or MIN:MAX with whole numbers"),
    ],
)
def test_bad_node_counts_say_what_is_wrong(
    text: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(LaunchConfigError, match=re.escape(fragment)):
        parse_nnodes(text)
    with pytest.raises(SystemExit) as info:
        _parse("--nnodes", text, "s.py")
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--nnodes" in err and fragment in err


def test_an_elastic_range_needs_a_coordinator_and_ignores_node_rank(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run.main(_parse("--nnodes", "2:4", "s.py")) == 2
    err = capsys.readouterr().err
    assert err.startswith("[aiocoll run] error: --nnodes 2:4 needs --coordinator HOST:PORT")
    assert "the launchers rendezvous through it" in err
    with pytest.raises(LaunchConfigError, match="--standalone means a single node"):
        run.build_config(_parse("--standalone", "--nnodes", "1:2", "--coordinator", "h:1", "s.py"), {})
    config = run.build_config(
        _parse("--nnodes", "2:4", "--node-rank", "1", "--coordinator", "h:1", "s.py"), {}
    )
    assert config.placement.warnings == (
        "--node-rank 1 is ignored with --nnodes 2:4: node ranks are assigned at each generation, in the "
        "order the nodes joined (as torchrun does)",
    )
    # Inside an srun task SLURM's node rank does not apply either: the rendezvous assigns it.
    slurm = run.build_config(
        _parse("--nnodes", "2:4", "--coordinator", "h:1", "s.py"), {"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}
    )
    assert slurm.elastic is not None and slurm.placement.node_rank == 0
    fixed = run.build_config(_parse("--rdzv-join-window", "2", "--coordinator", "h:1", "s.py"), {})
    assert fixed.placement.warnings == (
        "--rdzv-join-window applies only to an elastic --nnodes MIN:MAX; ignored",
    )


def test_worker_environment_of_an_elastic_generation_has_torchruns_variables() -> None:
    config = run.build_config(
        _parse(
            "--nnodes",
            "2:3",
            "--nproc-per-node",
            "2",
            "--coordinator",
            "h:1",
            "--max-restarts",
            "3",
            "--job",
            "exp",
            "s.py",
        ),
        {},
    )
    layout = RankLayout(node_rank=1, nnodes=3, first_rank=4, world_size=7)
    env = worker_environment(
        config,
        {"TORCHELASTIC_USE_AGENT_STORE": "True"},
        local_rank=1,
        restart_count=1,
        coordinator=("h", 1),
        master_addr="10.0.0.5",
        master_port=40000,
        layout=layout,
        generation=5,
        max_restarts=2,
    )
    assert {
        k: env[k]
        for k in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "ROLE_NAME",
        )
    } == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "7",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_RANK": "5",
        "ROLE_WORLD_SIZE": "7",
        "ROLE_NAME": "default",
    }
    # Restarts count failures (torchrun's meaning); generations count membership changes too.
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["AIOCOLL_RESTART_COUNT"] == "1"
    assert env["AIOCOLL_GENERATION"] == "5"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == env["AIOCOLL_MAX_RESTARTS"] == "2"  # the job's, not ours
    assert env["TORCHELASTIC_RUN_ID"] == env["AIOCOLL_JOB"] == "exp"
    # No agent store listens on MASTER_PORT: torch's env:// must make its own on rank 0.
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env
    fixed = run.build_config(_parse("--nproc-per-node", "2", "--coordinator", "h:1", "s.py"), {})
    env = worker_environment(
        fixed, {}, local_rank=0, restart_count=2, coordinator=("h", 1), master_addr="a", master_port=2
    )
    assert env["TORCHELASTIC_RESTART_COUNT"] == env["AIOCOLL_GENERATION"] == "2"
    assert env["TORCHELASTIC_RUN_ID"] == "default" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"


def test_the_torch_store_of_an_elastic_generation_is_on_node_rank_0() -> None:
    config = run.build_config(_parse("--nnodes", "2:3", "--coordinator", "10.0.0.1:29500", "s.py"), {})
    store = elastic_torch_store_address(config, ("10.0.0.7", 41000), ("10.0.0.1", 29500))
    assert (store.addr, store.port, store.warnings) == ("10.0.0.7", 41000, ())
    given = run.build_config(
        _parse(
            "--nnodes",
            "2:3",
            "--coordinator",
            "10.0.0.1:29500",
            "--master-addr",
            "n0",
            "--master-port",
            "29500",
            "s.py",
        ),
        {},
    )
    store = elastic_torch_store_address(given, ("10.0.0.7", 41000), ("n0", 29500))
    assert (store.addr, store.port) == ("n0", 29500) and "coordinator's own address" in store.warnings[0]


def test_exit_status_of_a_failed_worker() -> None:
    assert exit_code_of(3) == 3
    assert exit_code_of(-9) == 137
    assert describe_returncode(-15) == "killed by signal SIGTERM"
    assert describe_returncode(2) == "exit code 2"


def test_help_has_examples_and_both_spellings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--help")
    out = capsys.readouterr().out
    for fragment in (
        "examples:",
        "--nproc-per-node",
        "--nproc_per_node",
        "--max-restarts",
        "SLURM_PROCID",
        "JOB_COMPLETION_INDEX",
        "exit status:",
    ):
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


# -- the node rendezvous of --nnodes MIN:MAX (aiocoll/cli/_launch_nodes.py), without a coordinator --


def _node(name: str, nproc: int = 1) -> Node:
    return Node(id=f"{name}/x", name=name, nproc=nproc, addr=f"10.0.0.{len(name)}", port=40000 + len(name))


A, B, C, D = _node("a"), _node("b"), _node("c"), _node("d")


def _forming(*nodes: Node, min_nodes: int = 2, max_nodes: int = 3, max_restarts: int = 0) -> NodeState:
    state = new_run("r1", nodes[0], min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=max_restarts)
    return dataclasses.replace(state, nodes=nodes)


def _step(
    state: NodeState | None, me: Node, view: View = View(), *, run: str | None = "r1", last_gen: int = -1
) -> object:
    fresh = new_run("r2", me, min_nodes=2, max_nodes=3, max_restarts=0)
    return join_step(state, me, view, run=run, last_gen=last_gen, fresh=fresh)


def _running(*nodes: Node, gen: int = 0, **changes: object) -> NodeState:
    return dataclasses.replace(_forming(*nodes), gen=gen, phase=RUNNING, **changes)  # type: ignore[arg-type]


def test_node_ranks_keep_the_last_generations_order_and_add_newcomers_in_arrival_order() -> None:
    assert assign_node_ranks([], [C, A, B]) == (C, A, B)
    assert assign_node_ranks([B.id, A.id], [A, D, B, C]) == (B, A, D, C)
    assert assign_node_ranks([A.id, B.id, C.id], [C, D]) == (C, D)  # a and b left: c is node 0 now
    wide, narrow = _node("wide", nproc=4), _node("narrow", nproc=2)
    state = _running(wide, narrow, A)
    assert layout_of(state, wide.id) == RankLayout(node_rank=0, nnodes=3, first_rank=0, world_size=7)
    assert layout_of(state, narrow.id) == RankLayout(node_rank=1, nnodes=3, first_rank=4, world_size=7)
    assert layout_of(state, A.id) == RankLayout(node_rank=2, nnodes=3, first_rank=6, world_size=7)


def test_the_first_generation_starts_at_min_after_the_join_window_or_at_once_at_max() -> None:
    first = _step(None, A)
    assert isinstance(first, Write) and first.state.nodes == (A,) and first.state.phase == FORMING
    one = _forming(A)
    assert _step(one, A) == Wait("1 node(s) joined, waiting for at least 2 (--nnodes 2:3)")
    joined = _step(one, B)
    assert isinstance(joined, Write) and joined.state.ids() == [A.id, B.id]
    two = joined.state
    waiting = _step(two, A, View(now=10.5, min_since=10.0, join_window=1.0))
    assert isinstance(waiting, Wait) and "waiting up to 1s (--rdzv-join-window)" in waiting.note
    started = _step(two, A, View(now=11.0, min_since=10.0, join_window=1.0))
    assert isinstance(started, Write) and started.state.phase == RUNNING
    assert started.state.ids() == [A.id, B.id]
    assert started.state.gen == 0 and started.state.serial > two.serial
    full = _step(_forming(A, B, C), A, View(now=0.0, min_since=0.0, join_window=60.0))
    assert isinstance(full, Write) and full.state.phase == RUNNING and len(full.state.nodes) == 3
    # Beyond MAX a node waits as a spare; a node whose beats stopped does not count.
    spare = _step(_forming(A, B, C), D)
    assert isinstance(spare, Write) and spare.state.waiting == (D,) and D not in spare.state.nodes
    dead_c = View(dead=frozenset({C.id}), now=0.0, min_since=0.0, join_window=60.0)
    assert isinstance(_step(_forming(A, B, C), A, dead_c), Wait)
    pruned = close_formation(_forming(A, B, C), dead_c)
    assert pruned.ids() == [A.id, B.id]
    # Once running, a member starts its workers; the same generation is never started twice.
    assert _step(started.state, B) == Admitted(started.state)
    again = _step(started.state, B, last_gen=0)
    assert isinstance(again, Write) and again.state.ended is not None and again.state.ended.kind == REJOINED


def test_a_node_that_arrives_while_a_generation_runs_ends_it_without_using_up_restarts() -> None:
    running = _running(A, B, restarts=1, max_restarts=2)
    asked = _step(running, C)
    assert isinstance(asked, Write) and asked.state.waiting == (C,) and asked.state.gen == 0
    for me in (C, A):  # the newcomer itself or a member: whoever writes first
        ended = (
            _step(asked.state, C)
            if me is C
            else running_step(asked.state, A, View(), run="r1", gen=0, succeeded=False, failure=None)
        )
        assert isinstance(ended, Write)
        nxt = ended.state
        assert (nxt.phase, nxt.gen, nxt.restarts) == (FORMING, 1, 1)
        assert nxt.expected == (A.id, B.id, C.id) and nxt.previous == (A.id, B.id)
        assert nxt.ended == Ending(0, JOINED, "node(s) c asked to join")
    # Everyone expected is back: the generation starts without waiting for the join window.
    back = dataclasses.replace(nxt, nodes=(C, B, A))
    assert formation_wait(back, View(now=0.0, min_since=0.0, join_window=60.0)) is None
    assert close_formation(back, View()).ids() == [A.id, B.id, C.id]
    # One expected node still stopping its workers (beating): the others wait for it...
    partial = dataclasses.replace(nxt, nodes=(C, B))
    assert "waiting for 1 node(s) of the last generation" in str(formation_wait(partial, View(now=99.0)))
    # ...unless its beats stopped.
    assert formation_wait(partial, View(dead=frozenset({A.id}))) is None
    # At MAX, or with a node already done, nobody is admitted: the arrival waits.
    assert _step(dataclasses.replace(asked.state, nodes=(A, B, D)), C) == Wait(
        "generation 0 runs with its 3 nodes (MAX); a spare until one leaves"
    )
    assert isinstance(_step(dataclasses.replace(asked.state, done=(A.id,)), C), Wait)


def test_a_node_seen_dead_ends_the_generation_and_the_rest_go_on_without_it() -> None:
    running = _running(A, B, C, gen=4, restarts=1)
    view = View(dead=frozenset({A.id}), node_timeout=3.0)
    ended = running_step(running, B, view, run="r1", gen=4, succeeded=False, failure=("x", "", 1))
    assert isinstance(ended, Write)  # a lost node explains a failure seen meanwhile: not counted
    nxt = ended.state
    assert (nxt.gen, nxt.phase, nxt.restarts, nxt.expected) == (5, FORMING, 1, (B.id, C.id))
    assert nxt.ended is not None and nxt.ended.kind == LOST
    assert nxt.ended.reason == (
        "node(s) a lost: their launcher stopped beating for 3s (it died, or lost the coordinator)"
    )
    # The node that was lost (or any node of the old generation) only sees that it ended.
    assert running_step(nxt, C, View(), run="r1", gen=4, succeeded=False, failure=None) == Ended(nxt)
    # A node that leaves on a signal ends its generation too, and is not expected back.
    left = leave(running, C, "node c left: its launcher got SIGTERM")
    assert left is not None and left.expected == (A.id, B.id) and left.ended.kind == LEFT  # type: ignore[union-attr]
    forming = leave(nxt, B, "bye")
    assert forming is not None and forming.expected == (C.id,)
    assert leave(_forming(A), B, "bye") is None


def test_failures_use_up_restarts_and_the_last_one_ends_the_job_with_its_status() -> None:
    running = _running(A, B, max_restarts=1)
    failure = ("rank 1 (node 1 b) failed (exit code 3)", "ValueError: nan", 3)
    first = running_step(running, B, View(), run="r1", gen=0, succeeded=False, failure=failure)
    assert isinstance(first, Write)
    restarted = first.state
    assert (restarted.phase, restarted.gen, restarted.restarts) == (FORMING, 1, 1)
    assert restarted.expected == (A.id, B.id)
    assert restarted.ended == Ending(0, FAILED, failure[0], cause="ValueError: nan", node=B.id)
    second = running_step(
        _running(A, B, gen=1, restarts=1, max_restarts=1),
        B,
        View(),
        run="r1",
        gen=1,
        succeeded=False,
        failure=failure,
    )
    assert isinstance(second, Write) and second.state.phase == FINISHED and second.state.exit_code == 3
    assert running_step(second.state, A, View(), run="r1", gen=1, succeeded=False, failure=None) == Finished(
        second.state
    )
    # A node that waited, or finished, when the job ended learns it; a newcomer starts it again.
    assert _step(second.state, C, run="r1") == Finished(second.state)
    again = _step(second.state, C, run=None)
    assert isinstance(again, Write) and again.state.run == "r2" and again.state.nodes == (C,)


def test_the_job_completes_when_every_node_of_a_generation_exited_0() -> None:
    running = _running(A, B, gen=2)
    half = running_step(running, A, View(), run="r1", gen=2, succeeded=True, failure=None)
    assert isinstance(half, Write) and half.state.done == (A.id,) and half.state.phase == RUNNING
    assert running_step(half.state, A, View(), run="r1", gen=2, succeeded=True, failure=None) == Wait()
    done = running_step(half.state, B, View(), run="r1", gen=2, succeeded=True, failure=None)
    assert isinstance(done, Write) and done.state.phase == FINISHED and done.state.exit_code == 0
    assert mark_done(running, A.id).phase == RUNNING


def test_a_closed_job_is_over_for_every_node_and_a_newcomer_starts_it_again() -> None:
    # torchrun's agents close the job when they are done (torch's c10d backend does the same).
    running = _running(A, B, gen=2)
    closed = close_run(running, "node a's agent is done", A.id)
    assert closed is not None and closed.phase == FINISHED and closed.ended is not None
    assert (closed.ended.kind, closed.ended.node, closed.ended.gen) == (CLOSED, A.id, 2)
    assert decode_state(encode_state(closed)) == closed
    assert close_run(closed, "again", B.id) is None and close_run(None, "no job", A.id) is None
    # The other node of that run learns that the job is over, wherever it is.
    assert running_step(closed, B, View(), run="r1", gen=2, succeeded=False, failure=None) == Finished(closed)
    assert _step(closed, B, run="r1") == Finished(closed)
    again = _step(closed, C, run=None)
    assert isinstance(again, Write) and again.state.nodes == (C,) and again.state.phase == FORMING


def test_node_state_round_trips_and_foreign_bytes_are_refused() -> None:
    state = dataclasses.replace(
        _running(A, B, gen=3, restarts=1, max_restarts=2),
        waiting=(C,),
        previous=(B.id,),
        done=(A.id,),
        ended=Ending(2, FAILED, "why", "cause", B.id),
    )
    assert decode_state(encode_state(state)) == state
    forming = end_generation(state, LOST, "gone", gone=[A.id])
    assert decode_state(encode_state(forming)) == forming and forming.expected == (B.id, C.id)
    for raw in (b"", b"not json", b"[]", b'{"f": 99}', encode_state(state).replace(b'"running"', b'"odd"')):
        with pytest.raises(NodeStateError):
            decode_state(raw)


def test_beats_find_a_node_dead_only_after_the_timeout_of_watching_it() -> None:
    beats = Beats(timeout=3.0)
    beats.observe(A.id, 5, now=0.0)
    beats.observe(B.id, 7, now=0.0)
    beats.observe(A.id, 6, now=2.0)
    assert beats.dead([A.id, B.id, C.id], now=2.9) == frozenset()
    assert beats.dead([A.id, B.id, C.id], now=3.0) == {B.id}  # never seen (C): not judged
    assert beats.dead([A.id], now=5.0) == {A.id}
    assert beats.moved_past({A.id: 5}) and not beats.moved_past({A.id: 6, B.id: 7})
    beats.keep([A.id])
    assert beats.value(B.id) is None


def test_a_running_node_watches_the_next_one_and_a_waiting_node_watches_all() -> None:
    running = _running(A, B, C)
    assert [watched_nodes(running, n, running=True) for n in (A, B, C)] == [[B.id], [C.id], [A.id]]
    assert watched_nodes(_running(A), A, running=True) == []
    assert watched_nodes(dataclasses.replace(running, waiting=(D,)), D, running=False) == [A.id, B.id, C.id]
    assert watched_nodes(None, A, running=False) == []
