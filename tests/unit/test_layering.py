"""The import graph points down only (docs/design/index.md): foundations < server, client < public
surface; no two modules import each other in a circle; the public layer names no provider; only
aiocoll/_env.py reads AIOCOLL_* variables."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = {"aiocoll": "aiocoll", "server": "aiocoll.server", "client": "aiocoll.client"}
SURFACE = (
    "aiocoll.api",
    "aiocoll.sync",
    "aiocoll.torch",
    "aiocoll.torchrun",
    "aiocoll.cli",
    "aiocoll.testing",
    "aiocoll._connect",
    "aiocoll.__main__",
    "aiocoll.ft",
    "aiocoll.ft_torch",
)


def _module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(ROOT)
    package = SOURCE_DIRS[rel.parts[0]]
    parts = [package, *rel.parts[1:-1]]
    is_package = rel.name == "__init__.py"
    if not is_package:
        parts.append(rel.stem)
    return ".".join(parts), is_package


def _within(module: str, package: str) -> bool:
    """Whole dotted segments only: aiocoll.client is not within aiocoll.cli."""
    return module == package or module.startswith(package + ".")


# Private helper modules of a surface module (aiocoll/_sync_loop.py serves aiocoll/sync.py) are surface.
SURFACE_HELPER_PREFIXES = ("aiocoll._sync", "aiocoll._torch")


def _layer(module: str) -> str:
    if module == "aiocoll" or any(_within(module, top) for top in SURFACE):
        return "surface"
    if module.startswith(SURFACE_HELPER_PREFIXES):
        return "surface"
    if _within(module, "aiocoll.server"):
        return "server"
    if _within(module, "aiocoll.client"):
        return "client"
    return "foundation"


ALLOWED = {
    "foundation": {"foundation"},
    "server": {"foundation", "server"},
    "client": {"foundation", "client"},
    "surface": {"foundation", "server", "client", "surface"},
}


@functools.cache
def _tree(path: Path) -> ast.Module:
    """``path`` parsed, once for all the checks of this file."""
    return ast.parse(path.read_text(), str(path))


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of ``path``'s tree (``ast.walk`` once: it is most of these checks' time)."""
    return tuple(ast.walk(_tree(path)))


@functools.cache
def _imports(path: Path) -> tuple[str, ...]:
    """What ``path`` imports of aiocoll, wherever it does (at the top, inside a function, or only
    for type checkers under ``if TYPE_CHECKING``)."""
    module, is_package = _module_name(path)
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module is None or not node.level:
                # `from . import x` / `from aiocoll import x`: x may be a sub-module
                found += [f"{target}.{alias.name}" for alias in node.names]
            found.append(target)
    return tuple(name for name in found if name == "aiocoll" or name.startswith("aiocoll."))


def _resolve(name: str) -> str:
    """The longest existing module a dotted name refers to (`aiocoll._errors.X` -> aiocoll._errors)."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        rel = candidate.split(".")
        for folder, package in SOURCE_DIRS.items():
            pkg = package.split(".")
            if rel[: len(pkg)] == pkg:
                tail = rel[len(pkg) :]
                base = ROOT / folder / Path(*tail) if tail else ROOT / folder
                if base.with_suffix(".py").exists() or (base / "__init__.py").exists():
                    if folder == "aiocoll" and tail and tail[0] in ("server", "client"):
                        continue
                    return candidate
        parts.pop()
    return name


def test_imports_point_down_only() -> None:
    violations = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module, _ = _module_name(path)
            here = _layer(module)
            for imported in _imports(path):
                target = _resolve(imported)
                if target == module:
                    continue
                if _layer(target) not in ALLOWED[here]:
                    violations.append(
                        f"{path.relative_to(ROOT)} ({here}) imports {target} ({_layer(target)})"
                    )
    assert not violations, "upward imports:\n" + "\n".join(sorted(set(violations)))


def test_importing_the_server_loads_neither_client_nor_torch() -> None:
    code = (
        "import sys, aiocoll.server\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('aiocoll.client', 'aiocoll.api', 'torch')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_importing_aiocoll_is_cheap() -> None:
    code = "import sys, aiocoll\nprint(','.join(sorted(m for m in ('torch', 'numpy') if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""


def test_only_the_cuda_device_module_calls_torch_cuda() -> None:
    # The GPU path's CUDA calls live in one thin module behind aiocoll.device._device's interface, so
    # that everything above it is tested against the thread-backed device without a GPU.
    callers = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "aiocoll" / "device" / "_cuda.py":
                continue
            for node in _nodes(path):
                if isinstance(node, ast.Attribute) and node.attr == "cuda":
                    callers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not callers, "torch.cuda used outside aiocoll/device/_cuda.py:\n" + "\n".join(callers)


def test_the_matcher_is_sans_io_and_link_kinds_sit_in_the_client_layer() -> None:
    """aiocoll/_matching.py and its records (aiocoll/_match_records.py) are foundations that touch
    no sockets and no event loop (every link kind feeds them); the link interface, the transport,
    its waits, its kinds and their factory live in client/data/transports."""
    for rel in ("aiocoll/_matching.py", "aiocoll/_match_records.py"):
        assert _layer(_module_name(ROOT / rel)[0]) == "foundation"
        imported = _top_level_imports(rel)
        assert not imported & {"asyncio", "socket", "selectors", "numpy", "uvloop"}, (rel, imported)
    for name in ("_link_interface", "_link", "_in_place", "_loop_polling", "_factory", "tcp", "memory"):
        module, _ = _module_name(ROOT / "client" / "data" / "transports" / f"{name}.py")
        assert _layer(module) == "client", module


def _top_level_imports(rel: str) -> set[str]:
    tree = ast.parse((ROOT / rel).read_text(), rel)
    names = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    names |= {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and not node.level
    }
    return names


def test_the_planner_and_step_driver_reach_memory_only_through_buffers() -> None:
    """aiocoll/_buffers.py is the one place the collectives touch memory (numpy today, device
    memory next); the planner, the driver and the schedules never import numpy, and neither the
    buffers nor the planner know the event loop."""
    for rel in (
        "aiocoll/algorithms/_plan.py",
        "aiocoll/algorithms/_driver.py",
        "aiocoll/algorithms/_schedule.py",
    ):
        assert "numpy" not in _top_level_imports(rel), rel
        assert _layer(_module_name(ROOT / rel)[0]) == "foundation"
    for rel in ("aiocoll/_buffers.py", "aiocoll/_reduce.py", "aiocoll/algorithms/_plan.py"):
        assert "asyncio" not in _top_level_imports(rel), rel
    assert _layer(_module_name(ROOT / "aiocoll/_buffers.py")[0]) == "foundation"
    for gone in ("aiocoll/algorithms/_eager.py", "aiocoll/algorithms/_executor.py"):
        assert not (ROOT / gone).exists(), f"{gone}: one step driver, not two"


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (at the top, inside a function, or under ``if
    TYPE_CHECKING``: a circle of types is a circle all the same), resolved; a module's imports of
    its own enclosing packages are left out (the package is already being loaded)."""
    graph: dict[str, set[str]] = {}
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            module, _ = _module_name(path)
            targets = {_resolve(name) for name in _imports(path)}
            graph[module] = {t for t in targets if t != module and not _within(module, t)}
    return graph


def test_no_two_modules_import_each_other_in_a_circle() -> None:
    """A circle, even closed by an import inside a function, at the bottom of a file or only for
    type checkers, means neither module can be read, loaded or replaced alone: hand the other
    side what it needs as a parameter (typed by a Protocol of what it uses), or move what both
    need into a module below them."""
    graph = _import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's strongly connected components, iteratively
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not circles, "modules importing each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_public_layer_names_no_provider() -> None:
    """aiocoll/api.py checks arguments and builds the operation; the group's providers
    (client/data/providers.py) decide how it runs, so the public layer never names shared memory."""
    text = (ROOT / "aiocoll" / "api.py").read_text()
    assert "shm" not in text.lower()
    for provider in ("_shm_coll", "routing", "_driver", "_ipc", "start_collective", "run_routed"):
        assert provider not in text, provider


def _reads_aiocoll_variable(node: ast.AST, constants: dict[str, str]) -> bool:
    """``os.environ.get(X)``, ``os.environ[X]`` (read), ``os.getenv(X)`` or ``X in os.environ``
    where X is an AIOCOLL_* name, written out or as a module constant."""

    def names_aiocoll(arg: ast.AST) -> bool:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.startswith("AIOCOLL_")
        if isinstance(arg, ast.Name):
            return constants.get(arg.id, "").startswith("AIOCOLL_")
        return False

    def is_environ(expr: ast.AST) -> bool:
        return isinstance(expr, ast.Attribute) and expr.attr == "environ"

    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and is_environ(func.value):
            return names_aiocoll(node.args[0])
        if isinstance(func, ast.Attribute) and func.attr == "getenv":
            return names_aiocoll(node.args[0])
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and is_environ(node.value):
        return names_aiocoll(node.slice)
    if isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
        return names_aiocoll(node.left)
    return False


def test_only_the_env_module_reads_aiocoll_variables() -> None:
    """One parser and one wording for every setting (aiocoll/_env.py); launchers may still set
    variables for their children."""
    readers = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel == Path("aiocoll/_env.py"):
                continue
            constants = {
                target.id: node.value.value
                for node in _tree(path).body
                if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
                for target in node.targets
                if isinstance(target, ast.Name)
            }
            readers += [
                f"{rel}:{node.lineno}" for node in _nodes(path) if _reads_aiocoll_variable(node, constants)
            ]
    assert not readers, "AIOCOLL_* read outside aiocoll/_env.py:\n" + "\n".join(readers)


def test_the_two_planes_meet_only_in_the_bootstrap() -> None:
    """client/data (engine, providers, arenas, links) runs operations and knows nothing of the
    coordinator; client/control (session, join, store clients, beats) knows nothing of how
    operations run; what both read (the shared modules at client/'s top: progress, recorder,
    timeline, stacks, clock) imports neither; only client/bootstrap.py wires them together."""
    planes = {"data": "aiocoll.client.data", "control": "aiocoll.client.control"}
    crossing = []
    for path in sorted((ROOT / "client").rglob("*.py")):
        module, _ = _module_name(path)
        if module == "aiocoll.client.bootstrap":
            continue
        mine = next((p for p, pkg in planes.items() if _within(module, pkg)), None)
        for imported in _imports(path):
            target = _resolve(imported)
            other = next((p for p, pkg in planes.items() if _within(target, pkg)), None)
            if _within(target, "aiocoll.client.bootstrap") or (other is not None and other != mine):
                crossing.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not crossing, "imports across the planes:\n" + "\n".join(crossing)


# The data plane's modules stay small enough to read in one sitting: about 600 lines, with some
# room for a docstring's growth.
_DATA_PLANE_LINES = 650


def test_the_data_plane_is_made_of_small_modules() -> None:
    """Every module of client/data (engine, providers, rows, arenas, links) is at most
    _DATA_PLANE_LINES lines: a module past it holds more than one concern."""
    long = [
        f"{path.relative_to(ROOT)}: {count} lines"
        for path in sorted((ROOT / "client" / "data").rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > _DATA_PLANE_LINES
    ]
    assert not long, f"data-plane modules over {_DATA_PLANE_LINES} lines:\n" + "\n".join(long)
