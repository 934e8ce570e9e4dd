"""Launch a multi-process job, as torchrun does: `aiocoll run [options] SCRIPT [ARGS...]`.

This module holds the command line (options, their torchrun spellings, --help) and turns it into
a LaunchConfig; the supervision lives in _launch_agent and the rules in _launch_config. Its
top-level imports are the standard library's argparse and os only, so `aiocoll --help` stays fast;
asyncio and subprocess machinery load when the command runs. It never imports the worker
runtime: the launcher starts processes, it does not join the job.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._launch_config import ElasticSpec, LaunchConfig, NodeCount, NodePlacement

__all__ = ["add_arguments", "check_module", "main"]

_DESCRIPTION = """\
Launch a multi-process job, as torchrun does: start --nproc-per-node workers running SCRIPT,
each with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, AIOCOLL_COORDINATOR,
MASTER_ADDR, MASTER_PORT, AIOCOLL_JOB and AIOCOLL_RESTART_COUNT set (AIOCOLL_TOKEN passes through).

AIOCOLL_COORDINATOR names the aiocoll coordinator the workers join: --coordinator, which must
answer with the job's token within --connect-timeout or nothing starts, or without it one the
launcher runs itself on 127.0.0.1, on a free port, with a random token unless one is given.
When the job starts, the launcher prints the 'aiocoll status' command that shows what each rank
is doing (its token is kept in a file only you can read, never on the command line).

MASTER_ADDR:MASTER_PORT is left free for the store that rank 0 of a torch.distributed script
binds (gloo via env://, or "aiocoll" after 'import aiocoll.torch'): on one node 127.0.0.1 and
another free port; on several nodes --master-addr (else the coordinator's host) and
--master-port (else 29500).

Every output line of a worker is prefixed with '[rankN]: '. When one worker fails, the others are
stopped (SIGTERM, then SIGKILL after --grace-period), the launcher names the rank, its exit status
and its last stderr line (its traceback was shown once, as it came), and exits with that
worker's exit code (128+N if signal N killed it) unless --max-restarts allows restarting the
whole generation. SIGINT/SIGTERM/SIGHUP sent to the launcher are forwarded to every worker; a
second one kills them."""

_EPILOG = """\
examples:
  # four workers on this machine, with an embedded coordinator
  aiocoll run --nproc-per-node 4 train.py --epochs 3

  # run a module, as 'python -m', and allow two restarts of the whole generation
  aiocoll run --nproc-per-node 2 --max-restarts 2 -m mypackage.train

  # two nodes with 8 workers each, against a coordinator started with
  # 'aiocoll coordinator --port 29500 --token-file secret' on 10.0.0.1:
  aiocoll run --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
      --coordinator 10.0.0.1:29500 --token-file secret --job exp42 train.py   # on node 0
  aiocoll run --nnodes 2 --node-rank 1 --nproc-per-node 8 \\
      --coordinator 10.0.0.1:29500 --token-file secret --job exp42 train.py   # on node 1

  # a plain torch.distributed gloo script, unchanged (rank 0's store gets a free MASTER_PORT)
  aiocoll run --nproc-per-node 2 train_gloo.py

  # torch-store scripts on several nodes: every launcher also names node 0 (here 10.0.0.2),
  # where rank 0 binds its store (the line for node 1; node 0's differs only in --node-rank)
  aiocoll run --nnodes 2 --node-rank 1 --nproc-per-node 8 --coordinator 10.0.0.1:29500 \\
      --master-addr 10.0.0.2 --master-port 29600 train_gloo.py

  # SLURM: one launcher per node; node rank and node count come from SLURM_PROCID/SLURM_NTASKS
  srun --ntasks-per-node=1 aiocoll run --nproc-per-node 4 --coordinator $HEAD_IP:29500 train.py

  # Kubernetes indexed Job: the node rank comes from JOB_COMPLETION_INDEX
  aiocoll run --nnodes 4 --nproc-per-node 2 --coordinator coordinator-svc-ip:29500 train.py

exit status: 0 when every worker exited 0; a failed worker's exit code (128+N when signal N
killed it) once restarts are used up; 128+N when the launcher itself got signal N; 2 for a bad
command line (a SCRIPT that does not exist, say) or a --coordinator that does not answer, before
any worker starts; 127 when a worker could not be started. See docs/LAUNCHER.md."""


def _whole_number(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive_int = _whole_number(1)
_non_negative_int = _whole_number(0)


def _port(text: str) -> int:
    value = _positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 1..65535, got {value}")
    return value


def _nnodes(text: str) -> NodeCount:
    from ._launch_config import LaunchConfigError, parse_nnodes

    try:
        return parse_nnodes(text)
    except LaunchConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _seconds(minimum_exclusive: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if value != value or value < 0 or (minimum_exclusive and value == 0):
            raise argparse.ArgumentTypeError(f"must be {'more than' if minimum_exclusive else 'at least'} 0")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `aiocoll run`'s options to ``parser`` (its sub-command parser)."""
    parser.description = _DESCRIPTION
    parser.epilog = _EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc_per_node",
        type=_positive_int,
        default=1,
        metavar="N",
        help="workers to start on this node (default: 1)",
    )
    parser.add_argument(
        "--nnodes",
        type=_nnodes,
        default=None,
        metavar="M|MIN:MAX",
        help="nodes in the job: M, a fixed number (default: SLURM_NTASKS inside an srun task, else 1), "
        "or MIN:MAX, elastic as in torchrun: the launchers rendezvous through --coordinator, the job "
        "starts once MIN nodes joined and --rdzv-join-window passed, nodes that come later are "
        "admitted up to MAX, and every change of membership (a node joins, or its launcher dies or "
        "loses the coordinator) stops the workers and starts a new generation with new ranks; "
        "node ranks are assigned at each generation (--node-rank is ignored)",
    )
    parser.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=_non_negative_int,
        default=None,
        metavar="R",
        help="this node's index, 0..M-1 (default: SLURM_PROCID, else JOB_COMPLETION_INDEX, else 0)",
    )
    parser.add_argument(
        "--coordinator",
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        dest="coordinator",
        default=None,
        metavar="HOST:PORT",
        help="the address of a running aiocoll coordinator ('aiocoll coordinator', or the container); "
        "required with --nnodes > 1 and with --nnodes MIN:MAX, where the launchers also rendezvous "
        "through it. If it does not complete aiocoll's handshake with the job's token within "
        "--connect-timeout (nothing answers, another token, not a coordinator), "
        "the launcher exits 2 and starts no worker. Default: run one inside the launcher, on "
        "127.0.0.1 (one node only)",
    )
    parser.add_argument(
        "--connect-timeout",
        "--connect_timeout",
        dest="connect_timeout",
        type=_seconds(True),
        default=None,
        metavar="SECONDS",
        help="how long --coordinator has to answer before the launcher gives up (default: 30)",
    )
    parser.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        default=None,
        metavar="HOST",
        help="MASTER_ADDR for the workers: where rank 0 of a torch.distributed script binds its store "
        "(not the coordinator; that is --coordinator). Default: 127.0.0.1 on one node, else the "
        "coordinator's host; with several nodes pass node 0's address",
    )
    parser.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help="MASTER_PORT for the workers, the port of rank 0's torch store. Default: a free port on "
        "one node, else 29500",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="single node with an embedded coordinator (the default; accepted for torchrun habits)",
    )
    parser.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=_non_negative_int,
        default=0,
        metavar="K",
        help="restart the whole generation up to K times after a worker failure (default: 0); with "
        "--nnodes MIN:MAX the count is the job's, and changes of membership do not use it up",
    )
    parser.add_argument(
        "--rdzv-join-window",
        "--rdzv_join_window",
        dest="rdzv_join_window",
        type=_seconds(False),
        default=None,
        metavar="SECONDS",
        help="with --nnodes MIN:MAX: once MIN nodes joined, how long the first generation waits for "
        "more, up to MAX (default: 5); a node that comes later is admitted by a new generation",
    )
    parser.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        dest="rdzv_timeout",
        type=_seconds(True),
        default=None,
        metavar="SECONDS",
        help="with --nnodes MIN:MAX: how long a node waits to be admitted (for MIN nodes, or as a "
        "spare while MAX nodes run) before its launcher gives up and exits 1 (default: 600)",
    )
    parser.add_argument(
        "--job",
        "--rdzv-id",
        "--rdzv_id",
        dest="job",
        default=None,
        metavar="ID",
        help="job id the workers join (AIOCOLL_JOB; default: $AIOCOLL_JOB, else 'default'); give each "
        "job its own when several share one coordinator",
    )
    parser.add_argument(
        "--token-file",
        "--token_file",
        dest="token_file",
        default=None,
        metavar="FILE",
        help="file holding the shared secret; given to workers as AIOCOLL_TOKEN and to the embedded "
        "coordinator (default: AIOCOLL_TOKEN from the environment; with neither, an embedded "
        "coordinator gets a random secret for this launch)",
    )
    parser.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        dest="monitor_interval",
        type=_seconds(True),
        default=0.1,
        metavar="SECONDS",
        help="how often the launcher checks whether a worker has exited (default: 0.1)",
    )
    parser.add_argument(
        "--grace-period",
        "--grace_period",
        dest="grace_period",
        type=_seconds(False),
        default=10.0,
        metavar="SECONDS",
        help="seconds a worker has to exit after SIGTERM before it gets SIGKILL (default: 10)",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        "--heartbeat_timeout",
        dest="heartbeat_timeout",
        type=_seconds(True),
        default=None,
        metavar="SECONDS",
        help="the embedded coordinator declares a worker lost after this long without a heartbeat "
        "(sets AIOCOLL_HEARTBEAT_TIMEOUT; default: 10). Workers beat from a thread: a busy event loop "
        "is not silence, a frozen or dead process is. With --nnodes MIN:MAX also how long a node's "
        "launcher may go without beating before the other nodes count that node lost",
    )
    parser.add_argument(
        "--progress-after",
        "--progress_after",
        dest="progress_after",
        type=_seconds(True),
        default=None,
        metavar="SECONDS",
        help="a worker reports an operation to the coordinator (shown by aiocoll status) once it has "
        "waited this long (sets AIOCOLL_PROGRESS_AFTER; default: 1)",
    )
    parser.add_argument(
        "--log-dir",
        "--log_dir",
        dest="log_dir",
        default=None,
        metavar="DIR",
        help="also write each worker's raw output to DIR/restart_K/rankN.stdout and .stderr",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="SCRIPT is a module name, run as 'python -m SCRIPT' (checked on the workers' sys.path before "
        "any worker starts)",
    )
    parser.add_argument(
        "--no-python",
        "--no_python",
        dest="no_python",
        action="store_true",
        help="run SCRIPT as a program (found on PATH), not through Python",
    )
    parser.add_argument(
        "script",
        metavar="SCRIPT",
        help="the Python file each worker runs (checked to exist before any worker starts); with -m "
        "a module, with --no-python a program",
    )
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments passed to SCRIPT unchanged"
    )


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> LaunchConfig:
    """Turn parsed arguments (and the scheduler's variables in ``environ``) into a LaunchConfig.

    Raises:
        LaunchConfigError: when the options do not describe a launchable job.
    """
    from ._launch_config import (
        DEFAULT_CONNECT_TIMEOUT,
        LaunchConfig,
        LaunchConfigError,
        build_worker_command,
        default_job,
        parse_coordinator_address,
        read_token_file,
    )

    count = args.nnodes
    elastic, placement = _elastic_or_fixed(args, environ)
    if args.standalone and placement.nnodes > 1:
        raise LaunchConfigError(f"--standalone means a single node; drop it or use --nnodes 1, not {count}")
    # --master-addr/--master-port name torch's rank-0 store (MASTER_ADDR/MASTER_PORT), never the
    # coordinator: the two must differ, or rank 0 of a gloo script cannot bind its store.
    coordinator = parse_coordinator_address(args.coordinator) if args.coordinator is not None else None
    if coordinator is None and placement.nnodes > 1:
        hint = (
            " (--master-addr names the host of torch's rank-0 store, not the coordinator)"
            if args.master_addr is not None
            else ""
        )
        written = count if count is not None else placement.nnodes
        through = "; the launchers rendezvous through it" if elastic is not None else ""
        raise LaunchConfigError(
            f"--nnodes {written} needs --coordinator HOST:PORT, an address every node can reach{through} "
            "(start one with 'aiocoll coordinator --port 29500' on one machine); an embedded coordinator "
            f"serves a single node only{hint}"
        )
    master_addr = args.master_addr.strip() if args.master_addr is not None else None
    if master_addr is not None and not master_addr:
        raise LaunchConfigError("--master-addr is empty; give the host where rank 0's torch store listens")
    token = read_token_file(args.token_file) if args.token_file is not None else None
    command = build_worker_command(
        args.script, args.script_args, module=args.module, no_python=args.no_python
    )
    return LaunchConfig(
        nproc_per_node=args.nproc_per_node,
        placement=placement,
        coordinator=coordinator,
        job=args.job if args.job else default_job(environ),
        max_restarts=args.max_restarts,
        token=token,
        command=command,
        monitor_interval=args.monitor_interval,
        grace_period=args.grace_period,
        log_dir=args.log_dir,
        master_addr=master_addr,
        master_port=args.master_port,
        token_file=os.path.abspath(args.token_file) if args.token_file is not None else None,
        connect_timeout=getattr(args, "connect_timeout", None) or DEFAULT_CONNECT_TIMEOUT,
        elastic=elastic,
    )


def _elastic_or_fixed(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[ElasticSpec | None, NodePlacement]:
    """``--nnodes MIN:MAX`` (MAX above 1): the elastic spec, and a placement that only carries
    MAX and notes (node ranks come from the rendezvous); otherwise no spec and the fixed
    placement from the command line, SLURM or Kubernetes."""
    from dataclasses import replace

    from ._launch_config import (
        DEFAULT_JOIN_WINDOW,
        DEFAULT_NODE_TIMEOUT,
        DEFAULT_RDZV_TIMEOUT,
        ElasticSpec,
        NodePlacement,
        resolve_node_placement,
    )

    count = args.nnodes
    join_window = getattr(args, "rdzv_join_window", None)
    rdzv_timeout = getattr(args, "rdzv_timeout", None)
    if count is None or not count.elastic:
        placement = resolve_node_placement(
            count.max_nodes if count is not None else None, args.node_rank, environ
        )
        unused = [
            name
            for name, value in (("--rdzv-join-window", join_window), ("--rdzv-timeout", rdzv_timeout))
            if value is not None
        ]
        if unused:
            verb = "applies" if len(unused) == 1 else "apply"
            note = f"{' and '.join(unused)} {verb} only to an elastic --nnodes MIN:MAX; ignored"
            placement = replace(placement, warnings=(*placement.warnings, note))
        return None, placement
    heartbeat = getattr(args, "heartbeat_timeout", None)
    spec = ElasticSpec(
        min_nodes=count.min_nodes,
        max_nodes=count.max_nodes,
        join_window=DEFAULT_JOIN_WINDOW if join_window is None else join_window,
        rdzv_timeout=DEFAULT_RDZV_TIMEOUT if rdzv_timeout is None else rdzv_timeout,
        node_timeout=DEFAULT_NODE_TIMEOUT if heartbeat is None else heartbeat,
    )
    warnings: tuple[str, ...] = ()
    if args.node_rank is not None:
        warnings = (
            f"--node-rank {args.node_rank} is ignored with --nnodes {count}: node ranks are assigned "
            "at each generation, in the order the nodes joined (as torchrun does)",
        )
    sources = (f"--nnodes {count}: node ranks and the world size are decided at each generation",)
    return spec, NodePlacement(nnodes=count.max_nodes, node_rank=0, sources=sources, warnings=warnings)


# Run by the workers' interpreter, in their folder and environment, so that it sees their
# sys.path. It finds NAME the way `python -m NAME` does, asking the import system's finders for
# each part without running any package's __init__ (which may import torch, or need RANK); only
# when that walk finds nothing does it import the parents to be sure. Exit 3 and a line of
# words: NAME does not run.
_FIND_MODULE = """
import importlib.util, sys
name = sys.argv[1]
parts = name.split(".")
def walk(full):
    spec, path = None, None
    for i in range(len(parts)):
        part = ".".join(parts[: i + 1])
        if i == 0:
            spec = importlib.util.find_spec(part)
        else:
            if path is None:
                return None
            spec = next(filter(None, (f.find_spec(part, path) for f in sys.meta_path
                                      if hasattr(f, "find_spec"))), None)
        if spec is None:
            return None
        path = spec.submodule_search_locations
    return spec
spec = walk(name)
if spec is None and len(parts) > 1:
    try:
        spec = importlib.util.find_spec(name)
    except Exception:
        sys.exit(0)  # a parent failed to import: the workers will say why, with the traceback
if spec is None:
    print(f"no module named {name!r}")
    sys.exit(3)
if spec.submodule_search_locations is not None:
    parts.append("__main__")
    if walk(name + ".__main__") is None:
        print(f"{name!r} is a package without a __main__ module, so it cannot be run with -m")
        sys.exit(3)
"""


def check_module(name: str, python: str) -> None:
    """Refuse ``-m NAME`` when the workers' Python would not find NAME, before any worker starts.

    Asked of ``python`` in this folder and environment, which the workers inherit, so that a
    typo fails once here instead of once per worker and again at each restart.

    Raises:
        LaunchConfigError: naming the module, where it was looked for and what to do.
    """
    import subprocess

    from ._launch_config import LaunchConfigError

    try:
        found = subprocess.run(
            [python, "-c", _FIND_MODULE, name], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return  # the workers' own start says what is wrong with the interpreter
    if found.returncode != 3:
        return
    path = os.environ.get("PYTHONPATH")
    where = os.getcwd() + (f", PYTHONPATH={path}" if path else "")
    raise LaunchConfigError(
        f"-m {name}: {found.stdout.strip()} (as the workers would look: {python} in {where}); check "
        "the name, run from the folder that holds it, or install the package that provides it"
    )


def main(args: argparse.Namespace) -> int:
    """Run `aiocoll run` with parsed ``args``; returns the launcher's exit status."""
    import asyncio

    from ._launch_agent import Console, run_agent
    from ._launch_config import LaunchConfigError, check_script

    console = Console.from_sys()
    # Read by the embedded coordinator and inherited by every worker.
    if getattr(args, "heartbeat_timeout", None) is not None:
        os.environ["AIOCOLL_HEARTBEAT_TIMEOUT"] = f"{args.heartbeat_timeout:g}"
    if getattr(args, "progress_after", None) is not None:
        os.environ["AIOCOLL_PROGRESS_AFTER"] = f"{args.progress_after:g}"
    try:
        config = build_config(args, os.environ)
        check_script(args.script, module=args.module, no_python=args.no_python)
        if args.module:
            check_module(args.script, config.command[0])
    except LaunchConfigError as exc:
        console.log(f"error: {exc}")
        return 2
    for note in config.placement.sources:
        console.log(note)
    for warning in config.placement.warnings:
        console.log(f"warning: {warning}")
    elastic = None
    if config.elastic is not None:
        from ._launch_elastic import ElasticNode

        elastic = ElasticNode
    return asyncio.run(run_agent(config, console, elastic))


def _standalone(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aiocoll run")
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
