"""What `aiocoll run` will launch: node placement, worker command and per-rank environment.

Pure functions over the parsed arguments and an environment mapping; nothing here starts a
process, opens a socket or touches the event loop (check_script only asks whether a path
exists), so every rule (which SLURM or Kubernetes variable wins, what ``--nnodes MIN:MAX``
means, how ranks are numbered, what each worker's environment holds) is unit-testable.
It imports only the standard library: the launcher must start fast and never import torch.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from aiocoll._env import env_text

from .._env import env_int
from .._net import host_port
from ._token_file import read_token_file as _read_token_file

__all__ = [
    "DEFAULT_COORDINATOR_PORT",
    "DEFAULT_JOIN_WINDOW",
    "DEFAULT_NODE_TIMEOUT",
    "DEFAULT_RDZV_TIMEOUT",
    "ElasticSpec",
    "RankLayout",
    "parse_nnodes",
    "DEFAULT_TORCH_STORE_PORT",
    "LaunchConfig",
    "LaunchConfigError",
    "NodeCount",
    "NodePlacement",
    "TorchStoreAddress",
    "DEFAULT_CONNECT_TIMEOUT",
    "build_worker_command",
    "check_script",
    "default_job",
    "format_host_port",
    "parse_coordinator_address",
    "read_token_file",
    "resolve_node_placement",
    "resolve_torch_store_address",
    "elastic_torch_store_address",
    "dump_directory",
    "worker_environment",
]

DEFAULT_COORDINATOR_PORT = 29500
# How long the launcher waits for a --coordinator to accept a connection before it gives up:
# long enough for a coordinator started beside the launchers (one srun step before another).
DEFAULT_CONNECT_TIMEOUT = 30.0
# torchrun's default MASTER_PORT: used for the torch store of a job on several nodes when
# --master-port is not given, so torchrun command lines keep meaning what they meant.
DEFAULT_TORCH_STORE_PORT = 29500
LOOPBACK_HOST = "127.0.0.1"
# --nnodes MIN:MAX: how long the rendezvous waits after the MIN-th node for more to arrive
# (torchrun's last_call_timeout, shorter: a node that arrives later is admitted anyway, by a new
# generation), how long a node waits to be admitted at all (torchrun's join_timeout), and how
# long a node agent may go without beating before the others count its node lost.
DEFAULT_JOIN_WINDOW = 5.0
DEFAULT_RDZV_TIMEOUT = 600.0
DEFAULT_NODE_TIMEOUT = 10.0


class LaunchConfigError(ValueError):
    """The command line (or the scheduler's environment) does not describe a launchable job."""


@dataclass(frozen=True)
class NodePlacement:
    """Where this launcher sits in the job.

    Attributes:
        nnodes: number of launchers (nodes) in the job.
        node_rank: this launcher's index, 0 <= node_rank < nnodes.
        sources: human-readable notes on where each value came from (for the launcher's log).
        warnings: things that look like a mistake but do not stop the launch.
    """

    nnodes: int
    node_rank: int
    sources: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class ElasticSpec:
    """``--nnodes MIN:MAX``: node ranks and the world size are decided at each generation.

    Attributes:
        min_nodes: a generation starts once this many nodes joined (and the join window passed).
        max_nodes: nodes admitted at most; more wait as spares until one leaves.
        join_window: seconds after the MIN-th node for more to arrive (--rdzv-join-window).
        rdzv_timeout: seconds a node waits to be admitted before it gives up (--rdzv-timeout).
        node_timeout: seconds a node agent may go without beating before the other nodes count
            it lost (--heartbeat-timeout).
    """

    min_nodes: int
    max_nodes: int
    join_window: float = DEFAULT_JOIN_WINDOW
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    node_timeout: float = DEFAULT_NODE_TIMEOUT


@dataclass(frozen=True)
class RankLayout:
    """Where one node's workers sit in one generation.

    Attributes:
        node_rank: the node's index in the generation (GROUP_RANK).
        nnodes: nodes in the generation (GROUP_WORLD_SIZE).
        first_rank: the global rank of the node's local rank 0 (the workers of the nodes before
            it come first, each node with its own --nproc-per-node).
        world_size: every node's workers together (WORLD_SIZE).
    """

    node_rank: int
    nnodes: int
    first_rank: int
    world_size: int

    def global_rank(self, local_rank: int) -> int:
        return self.first_rank + local_rank


@dataclass(frozen=True)
class LaunchConfig:
    """Everything the agent needs to run the job on this node.

    Attributes:
        nproc_per_node: workers started by this launcher.
        placement: nnodes and node_rank. With ``elastic``, nnodes is MAX and node_rank 0: the
            real ones are decided at each generation (see ``layout``).
        coordinator: (host, port) of an external coordinator, or None to start an embedded one.
        job: the job id every worker joins (AIOCOLL_JOB).
        max_restarts: how many times a failed generation is restarted.
        token: shared secret read from --token-file, or None (AIOCOLL_TOKEN then passes through
            from the launcher's own environment).
        token_file: the absolute path of --token-file, or None.
        command: the argv each worker runs.
        monitor_interval: seconds between checks of the workers' state.
        grace_period: seconds between the stop signal and SIGKILL.
        log_dir: where raw per-rank output is also written, or None.
        embedded_port: the port an embedded coordinator listens on; 0 lets the kernel pick (no
            command-line option sets it: --master-port names the torch store's port instead).
        master_addr: --master-addr, the host of torch.distributed's rank-0 store, or None.
        master_port: --master-port, the port of that store, or None.
        connect_timeout: seconds an external coordinator (--coordinator) has to accept a
            connection before the launcher gives up, starting no worker.
        elastic: the node range and the rendezvous's timing (--nnodes MIN:MAX), or None for a
            fixed number of nodes.
    """

    nproc_per_node: int
    placement: NodePlacement
    coordinator: tuple[str, int] | None
    job: str
    max_restarts: int
    token: str | None
    command: tuple[str, ...]
    monitor_interval: float = 0.1
    grace_period: float = 10.0
    log_dir: str | None = None
    embedded_port: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    token_file: str | None = None
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    elastic: ElasticSpec | None = None

    @property
    def world_size(self) -> int:
        return self.placement.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        """Rank of a local worker: node_rank * nproc_per_node + local_rank (equal nodes assumed)."""
        return self.placement.node_rank * self.nproc_per_node + local_rank

    def layout(self) -> RankLayout:
        """The fixed layout of a job with a fixed number of nodes (every node runs nproc_per_node)."""
        return RankLayout(
            node_rank=self.placement.node_rank,
            nnodes=self.placement.nnodes,
            first_rank=self.global_rank(0),
            world_size=self.world_size,
        )


@dataclass(frozen=True)
class NodeCount:
    """``--nnodes`` as written: ``M``, or ``MIN:MAX`` (``ranged``).

    A range with MAX above 1 is elastic (torchrun's meaning): the nodes rendezvous, and node
    ranks and the world size are decided at each generation. ``1:1`` is a single node.
    """

    min_nodes: int
    max_nodes: int
    ranged: bool = False

    @property
    def elastic(self) -> bool:
        return self.ranged and self.max_nodes > 1

    def __str__(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}" if self.ranged else str(self.max_nodes)


def parse_nnodes(text: str) -> NodeCount:
    """``--nnodes``: ``M`` (a fixed number of nodes) or ``MIN:MAX`` (torchrun's elastic range).

    Raises:
        LaunchConfigError: naming what is wrong (not a number, below 1, MIN above MAX).
    """
    parts = text.strip().split(":")
    if len(parts) > 2:
        raise LaunchConfigError(f"expected M or MIN:MAX (e.g. 2:4), got {text!r}")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        raise LaunchConfigError(
            f"expected M or MIN:MAX with whole numbers (e.g. 2:4), got {text!r}"
        ) from None
    if any(number < 1 for number in numbers):
        raise LaunchConfigError(f"node counts must be at least 1, got {text!r}")
    low, high = numbers[0], numbers[-1]
    if low > high:
        raise LaunchConfigError(
            f"MIN {low} is above MAX {high} in {text!r}; write MIN:MAX, e.g. {high}:{low}"
        )
    return NodeCount(low, high, ranged=len(numbers) == 2)


def parse_coordinator_address(text: str) -> tuple[str, int]:
    """Split ``HOST:PORT``, ``[V6]:PORT`` or a bare ``HOST`` (port 29500) into (host, port).

    Raises:
        LaunchConfigError: for an empty host or a port that is not an integer in 1..65535.
    """
    value = text.strip()
    if value.startswith("tcp://"):
        value = value[len("tcp://") :]
    host: str
    port_text: str | None
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise LaunchConfigError(f"coordinator address {text!r}: missing ']' after an IPv6 host")
        host, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            raise LaunchConfigError(f"coordinator address {text!r}: expected ':PORT' after ']'")
        port_text = rest[1:] if rest else None
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    elif ":" in value:
        raise LaunchConfigError(
            f"coordinator address {text!r}: write an IPv6 host in brackets, e.g. [::1]:29500"
        )
    else:
        host, port_text = value, None
    if not host:
        raise LaunchConfigError(f"coordinator address {text!r} has no host; expected HOST:PORT")
    if port_text is None or port_text == "":
        return host, DEFAULT_COORDINATOR_PORT
    try:
        port = int(port_text)
    except ValueError:
        raise LaunchConfigError(f"coordinator address {text!r}: port {port_text!r} is not a number") from None
    if not 1 <= port <= 65535:
        raise LaunchConfigError(f"coordinator address {text!r}: port {port} is outside 1..65535")
    return host, port


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    try:
        return env_int(name, environ)
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None


def resolve_node_placement(
    nnodes: int | None, node_rank: int | None, environ: Mapping[str, str]
) -> NodePlacement:
    """Decide nnodes and node_rank: the command line first, then SLURM, then Kubernetes, then 1/0.

    SLURM (an ``srun`` task, recognised by SLURM_PROCID and SLURM_NTASKS both being set): each
    srun task is one launcher, so node_rank = SLURM_PROCID and nnodes = SLURM_NTASKS. With one
    task per node (``srun --ntasks-per-node=1``) these equal SLURM_NODEID and SLURM_NNODES; if
    several tasks share a node (SLURM_NTASKS != SLURM_NNODES) a warning says so, because their
    workers would reuse the same LOCAL_RANKs (and GPUs).

    Kubernetes indexed Job: node_rank = JOB_COMPLETION_INDEX. Kubernetes does not put the number
    of completions in the pod's environment, so --nnodes must be given on the command line.

    Raises:
        LaunchConfigError: for a non-positive nnodes, or a node rank outside 0..nnodes-1.
    """
    sources: list[str] = []
    warnings: list[str] = []
    slurm_procid = _env_int(environ, "SLURM_PROCID")
    slurm_ntasks = _env_int(environ, "SLURM_NTASKS")
    in_slurm_task = slurm_procid is not None and slurm_ntasks is not None
    k8s_index = _env_int(environ, "JOB_COMPLETION_INDEX")

    if nnodes is None and in_slurm_task:
        nnodes = slurm_ntasks
        sources.append(f"nnodes={nnodes} from SLURM_NTASKS")
    if node_rank is None and in_slurm_task:
        node_rank = slurm_procid
        sources.append(f"node rank {node_rank} from SLURM_PROCID")
    if node_rank is None and k8s_index is not None:
        node_rank = k8s_index
        sources.append(f"node rank {node_rank} from JOB_COMPLETION_INDEX")
    if in_slurm_task:
        slurm_nnodes = _env_int(environ, "SLURM_NNODES")
        if slurm_nnodes is not None and slurm_nnodes != slurm_ntasks:
            warnings.append(
                f"SLURM started {slurm_ntasks} tasks on {slurm_nnodes} node(s); aiocoll run expects one "
                "task per node (srun --ntasks-per-node=1), otherwise launchers on the same node "
                "hand out the same LOCAL_RANKs"
            )
    if nnodes is None:
        nnodes = 1
    if node_rank is None:
        node_rank = 0
    if nnodes < 1:
        raise LaunchConfigError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        hint = (
            " (JOB_COMPLETION_INDEX is set: pass --nnodes equal to the Job's completions)"
            if k8s_index is not None
            else ""
        )
        raise LaunchConfigError(
            f"node rank {node_rank} is outside 0..{nnodes - 1} for --nnodes {nnodes}{hint}"
        )
    return NodePlacement(nnodes=nnodes, node_rank=node_rank, sources=tuple(sources), warnings=tuple(warnings))


def build_worker_command(
    target: str,
    args: Sequence[str],
    *,
    module: bool = False,
    no_python: bool = False,
    python: str | None = None,
) -> tuple[str, ...]:
    """The argv of one worker.

    Args:
        target: the script path, the module name (with ``module``) or the program (``no_python``).
        args: arguments passed to it unchanged.
        module: run ``python -m target`` (torchrun's -m).
        no_python: run ``target`` itself instead of through Python.
        python: interpreter to use; the launcher's own by default.

    Raises:
        LaunchConfigError: for ``module`` together with ``no_python``, or an empty target.
    """
    if not target:
        raise LaunchConfigError("no SCRIPT given: say what each worker runs, e.g. 'aiocoll run train.py'")
    if module and no_python:
        raise LaunchConfigError("--module and --no-python cannot be used together")
    if no_python:
        return (target, *args)
    # -u: unbuffered, so each worker's lines reach the launcher (and the user) as they are printed.
    interpreter = python or sys.executable
    if module:
        return (interpreter, "-u", "-m", target, *args)
    return (interpreter, "-u", target, *args)


def check_script(target: str, *, module: bool = False, no_python: bool = False) -> None:
    """Refuse a SCRIPT path that does not exist, before any worker starts.

    A module name (``module``) is found by Python in the worker, and a program (``no_python``) by
    the kernel when it starts (a failure there is exit 127), so only a script path is checked
    here; ``-`` (the script on standard input) is left to Python.

    Raises:
        LaunchConfigError: naming the path, where it was looked for and what to do.
    """
    if module or no_python or target == "-" or os.path.exists(target):
        return
    where = os.path.abspath(target)
    hint = (
        f"; to run the module {target!r}, pass -m {target}"
        if not target.endswith(".py") and os.sep not in target
        else ""
    )
    raise LaunchConfigError(
        f"SCRIPT {target!r} does not exist (looked for {where}); give the path of the Python file "
        f"each worker runs, relative to {os.getcwd()} or absolute{hint}"
    )


def read_token_file(path: str) -> str:
    """The shared secret in ``path`` (see aiocoll.cli._token_file).

    Raises:
        LaunchConfigError: if the file cannot be read or holds only whitespace.
    """
    try:
        return _read_token_file(path)
    except ValueError as exc:
        raise LaunchConfigError(str(exc)) from None


def format_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 host in brackets (``[::1]:29500``), as parse_coordinator_address reads it."""
    return host_port(host, port)


@dataclass(frozen=True)
class TorchStoreAddress:
    """MASTER_ADDR and MASTER_PORT: where rank 0 of a torch.distributed script binds its store.

    Attributes:
        addr: MASTER_ADDR.
        port: MASTER_PORT.
        source: how they were chosen, for the launcher's log.
        warnings: things that will break torch-store scripts but not aiocoll's own rendezvous.
    """

    addr: str
    port: int
    source: str
    warnings: tuple[str, ...] = ()


def resolve_torch_store_address(
    config: LaunchConfig, coordinator: tuple[str, int], pick_free_port: Callable[[], int]
) -> TorchStoreAddress:
    """Decide MASTER_ADDR/MASTER_PORT, which are *not* the coordinator's address.

    torch's env:// rendezvous (``init_process_group("gloo")``, or any backend without a store)
    makes rank 0 listen on MASTER_ADDR:MASTER_PORT, so that must be a port nobody else holds; the
    aiocoll coordinator is named by AIOCOLL_COORDINATOR instead.

    Single node: --master-addr, else 127.0.0.1; --master-port, else ``pick_free_port()``.
    Several nodes: --master-addr, else the coordinator's host; --master-port, else 29500 (the
    launchers on different nodes cannot agree on a free port, so torchrun's fixed default is used).

    Args:
        config: the launch (its placement, master_addr and master_port).
        coordinator: (host, port) of the coordinator the workers use.
        pick_free_port: returns a port free on 127.0.0.1 (called only when one is needed).

    Raises:
        LaunchConfigError: when --master-addr/--master-port name the coordinator's own address,
            where rank 0's store could never bind.
    """
    warnings: list[str] = []
    if config.placement.nnodes == 1:
        addr = config.master_addr or LOOPBACK_HOST
        if config.master_port is not None:
            port, source = config.master_port, "--master-port"
        else:
            port, source = pick_free_port(), "a free port picked by the launcher"
    else:
        addr = config.master_addr or coordinator[0]
        if config.master_port is not None:
            port, source = config.master_port, "--master-port"
        else:
            port, source = DEFAULT_TORCH_STORE_PORT, f"the default port {DEFAULT_TORCH_STORE_PORT}"
        if config.master_addr is None:
            warnings.append(
                f"MASTER_ADDR defaults to the coordinator's host {coordinator[0]}; a torch.distributed "
                "script that uses env:// (gloo, or a store of its own) needs it to be node 0's "
                "address: pass --master-addr NODE0_ADDR to every launcher"
            )
    if (addr, port) == coordinator:
        explicit = config.master_addr is not None and config.master_port is not None
        message = (
            f"MASTER_ADDR:MASTER_PORT {format_host_port(addr, port)} is the coordinator's own address; "
            "rank 0 of a torch.distributed script would fail to bind its store there (EADDRINUSE)"
        )
        if explicit:
            raise LaunchConfigError(
                f"{message}: --master-addr/--master-port name torch's rank-0 store, not the coordinator "
                "(that is --coordinator); choose another port"
            )
        warnings.append(f"{message}; pass --master-port with another port if the script uses one")
    return TorchStoreAddress(addr=addr, port=port, source=source, warnings=tuple(warnings))


def elastic_torch_store_address(
    config: LaunchConfig, node0: tuple[str, int], coordinator: tuple[str, int]
) -> TorchStoreAddress:
    """MASTER_ADDR/MASTER_PORT of one generation of an elastic job (--nnodes MIN:MAX).

    As torchrun does, rank 0's store goes on the node of node rank 0 of the generation, at a port
    that node found free when it joined: --master-addr else that node's address (the one it
    reaches the coordinator from), --master-port else its free port.

    Args:
        config: the launch (its master_addr and master_port).
        node0: (address, free port) that node rank 0 announced.
        coordinator: (host, port) of the coordinator, which the store must not coincide with.
    """
    addr = config.master_addr or node0[0]
    port = config.master_port if config.master_port is not None else node0[1]
    where = "node rank 0's address" if config.master_addr is None else "--master-addr"
    which = "a port node rank 0 found free" if config.master_port is None else "--master-port"
    warnings: tuple[str, ...] = ()
    if (addr, port) == coordinator:
        warnings = (
            f"MASTER_ADDR:MASTER_PORT {format_host_port(addr, port)} is the coordinator's own address; "
            "rank 0 of a torch.distributed script would fail to bind its store there; pass --master-port "
            "with another port",
        )
    return TorchStoreAddress(addr=addr, port=port, source=f"{where}, {which}", warnings=warnings)


def worker_environment(
    config: LaunchConfig,
    base: Mapping[str, str],
    *,
    local_rank: int,
    restart_count: int,
    coordinator: tuple[str, int],
    master_addr: str,
    master_port: int,
    layout: RankLayout | None = None,
    generation: int | None = None,
    max_restarts: int | None = None,
) -> dict[str, str]:
    """The environment of one worker: the launcher's own plus the rank variables.

    torchrun's variables are set as torchrun sets them: TORCHELASTIC_RESTART_COUNT counts the
    restarts after failures (a generation started by a change of membership does not add to
    it), TORCHELASTIC_RUN_ID is the job id, and ROLE_* describe the one role every worker has.
    AIOCOLL_GENERATION counts every generation, membership changes included.

    Args:
        config: the launch.
        base: the launcher's environment (AIOCOLL_TOKEN and everything else pass through).
        local_rank: the worker's index on this node.
        restart_count: restarts after failures so far (0 at first).
        coordinator: (host, port) where the aiocoll coordinator answers (AIOCOLL_COORDINATOR).
        master_addr, master_port: where rank 0 of a torch.distributed script binds its store
            (MASTER_ADDR, MASTER_PORT); see resolve_torch_store_address.
        layout: this generation's ranks (default: the fixed layout, ``config.layout()``).
        generation: the generation's number (default: ``restart_count``, as without
            --nnodes MIN:MAX every new generation is a restart).
        max_restarts: the job's --max-restarts (default: this launcher's own).
    """
    layout = config.layout() if layout is None else layout
    generation = restart_count if generation is None else generation
    max_restarts = config.max_restarts if max_restarts is None else max_restarts
    rank = str(layout.global_rank(local_rank))
    world_size = str(layout.world_size)
    env = dict(base)
    env.update(
        {
            "RANK": rank,
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": world_size,
            "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
            "GROUP_RANK": str(layout.node_rank),
            "GROUP_WORLD_SIZE": str(layout.nnodes),
            "ROLE_NAME": "default",
            "ROLE_RANK": rank,
            "ROLE_WORLD_SIZE": world_size,
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "AIOCOLL_COORDINATOR": format_host_port(*coordinator),
            "AIOCOLL_JOB": config.job,
            "AIOCOLL_RESTART_COUNT": str(restart_count),
            "AIOCOLL_MAX_RESTARTS": str(max_restarts),
            "AIOCOLL_GENERATION": str(generation),
            "TORCHELASTIC_RUN_ID": config.job,
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        }
    )
    # torch's env:// would then expect an agent's store on MASTER_PORT instead of making one on
    # rank 0 (a launcher inside a torchrun worker passes it on); aiocoll run serves none.
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    if config.token is not None:
        env["AIOCOLL_TOKEN"] = config.token
    # The flight recorder's dumps (a rank writes one when an operation fails): a directory of
    # this launch's, unless the user named one.
    if not env_text("AIOCOLL_DUMP_DIR", env):
        env["AIOCOLL_DUMP_DIR"] = dump_directory(config.job)
    # Several multi-threaded math libraries per core oversubscribe the machine; torchrun makes the
    # same choice. A value the user set is kept.
    if config.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        env["OMP_NUM_THREADS"] = "1"
    return env


def dump_directory(job: str, environ: Mapping[str, str] | None = None) -> str:
    """Where this launch's workers write their flight-recorder dumps: AIOCOLL_DUMP_DIR, else a
    directory of this launcher's own under the temporary directory (made by the first dump)."""
    named = env_text("AIOCOLL_DUMP_DIR", environ)
    if named:
        return named
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in job) or "default"
    return os.path.join(tempfile.gettempdir(), f"aiocoll-dumps-{safe}-{os.getpid()}")


def default_job(environ: Mapping[str, str]) -> str:
    """The job id when --job is not given: AIOCOLL_JOB, else ``"default"`` (the contract's default)."""
    return env_text("AIOCOLL_JOB", environ, strip=False) or "default"
