"""Shared pieces of `aiocoll bench`: size parsing, bandwidth definitions, statistics, tables.

Functions only (no processes, no numpy, no torch), so the CLI can import this module at parse
time and unit tests can check the arithmetic. May import only the standard library (uvloop loads
inside run_loop, when asked for). It exists so that the collective, store and rendezvous
benchmarks report numbers the same way: sizes in bytes, times in microseconds, bandwidths in GB/s
(10^9 bytes) as nccl-tests.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Coroutine, Iterable, Sequence
from typing import Any, TextIO, TypeVar

from .._net import free_port

__all__ = [
    "COLLECTIVE_OPS",
    "BUSBW_FACTORS",
    "DTYPE_SIZES",
    "SizedOp",
    "bench_meta",
    "bus_factor",
    "format_bytes",
    "free_port",
    "machine_description",
    "parse_int_list",
    "parse_size",
    "parse_sizes",
    "print_table",
    "Progress",
    "resolve_loop",
    "rounded_size",
    "run_loop",
    "summarize",
    "utc_now",
    "write_json",
]

# ops measured by the collective benchmark, in the order `--op all` runs them
COLLECTIVE_OPS = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "sendrecv",
    "barrier",
)

# nccl-tests' bus-bandwidth factors: busbw = algbw * factor(n) reflects the bytes each link carries
# under an optimal algorithm, so numbers are comparable across world sizes.
BUSBW_FACTORS: dict[str, str] = {
    "all_reduce": "2(n-1)/n",
    "all_gather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "all_to_all": "(n-1)/n",
    "broadcast": "1",
    "reduce": "1",
    "sendrecv": "1",
    "barrier": "-",
}

DTYPE_SIZES: dict[str, int] = {
    "int8": 1,
    "uint8": 1,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "float32": 4,
    "int64": 8,
    "float64": 8,
}

_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Parse one size: an integer number of bytes with an optional K, M or G (powers of 1024).

    Raises:
        ValueError: when the text is not such a size or is zero.
    """
    match = _SIZE_RE.match(text)
    if match is None:
        raise ValueError(f"bad size {text!r}: expected bytes like 4, 512K, 64M or 1G")
    value = int(match.group(1)) * _SUFFIXES[match.group(2).upper()]
    if value <= 0:
        raise ValueError(f"bad size {text!r}: sizes must be positive")
    return value


def parse_sizes(text: str) -> list[int]:
    """Parse ``--sizes``: ``MIN:MAX`` (doubling sweep), ``MIN:MAX:FACTOR``, or ``a,b,c``.

    Returns:
        The sizes in bytes, in the order given (sweeps ascend).

    Raises:
        ValueError: for malformed text, MIN > MAX, or a factor below 2.
    """
    text = text.strip()
    if ":" in text:
        parts = text.split(":")
        if len(parts) not in (2, 3):
            raise ValueError(f"bad size sweep {text!r}: expected MIN:MAX or MIN:MAX:FACTOR")
        low, high = parse_size(parts[0]), parse_size(parts[1])
        factor = int(parts[2]) if len(parts) == 3 else 2
        if low > high:
            raise ValueError(f"bad size sweep {text!r}: MIN {low} is above MAX {high}")
        if factor < 2:
            raise ValueError(f"bad size sweep {text!r}: the factor must be at least 2")
        sizes = []
        size = low
        while size <= high:
            sizes.append(size)
            size *= factor
        return sizes
    sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    if not sizes:
        raise ValueError("--sizes is empty")
    return sizes


def parse_int_list(text: str, *, name: str) -> list[int]:
    """Parse ``a,b,c`` positive integers (``--clients 1,8``).

    Raises:
        ValueError: naming the option when an entry is not a positive integer.
    """
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{name}: {part!r} is not a positive integer")
        values.append(int(part))
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def rounded_size(op: str, size: int, world_size: int, itemsize: int) -> int:
    """The buffer size actually measured for ``op``: whole elements, split evenly where needed.

    all_gather, reduce_scatter and all_to_all split the buffer into ``world_size`` equal parts,
    so the size is rounded down to a multiple of ``itemsize * world_size`` (at least one element
    per rank), as nccl-tests does.
    """
    unit = itemsize * world_size if op in ("all_gather", "reduce_scatter", "all_to_all") else itemsize
    return max(unit, size // unit * unit)


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' busbw/algbw factor for ``op`` with ``world_size`` ranks (NaN for barrier)."""
    n = world_size
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    return math.nan


def summarize(
    op: str, size: int, world_size: int, per_rank_times: Sequence[Sequence[float]]
) -> dict[str, Any]:
    """Turn per-rank, per-iteration times (seconds) into the reported row.

    Iteration ``i`` takes the slowest rank's time (an operation is done when every rank is done);
    the row reports the median and the minimum of those, the slowest rank's mean (``avg_us``,
    what nccl-tests prints, outliers included), and bandwidths from the median, in GB/s
    (10^9 bytes per second) as nccl-tests defines them: algbw = size / time,
    busbw = algbw * bus_factor(op, n).

    Raises:
        ValueError: when no rank reported a time.
    """
    ranks = [list(t) for t in per_rank_times if t]
    if not ranks:
        raise ValueError(f"no timings were reported for {op} at {size} bytes")
    iters = min(len(t) for t in ranks)
    per_iter = [max(t[i] for t in ranks) for i in range(iters)]
    median = statistics.median(per_iter)
    algbw = size / median / 1e9 if median > 0 and op != "barrier" else math.nan
    # nccl-tests' own time: a rank's iterations back to back, averaged; the slowest rank counts
    average = max(sum(t[:iters]) for t in ranks) / iters
    return {
        "time_us": median * 1e6,
        "avg_us": average * 1e6,
        "min_us": min(per_iter) * 1e6,
        "algbw": algbw,
        "busbw": algbw * bus_factor(op, world_size),
        "iters": iters,
    }


def contender_gap(contender: str, op: str, tensor: str) -> str | None:
    """Why ``contender`` cannot run ``op`` on ``tensor`` buffers (its columns then show "-"), or None."""
    if contender == "gloo" and tensor == "torch-cuda" and op == "sendrecv":
        return "gloo has no point-to-point on CUDA tensors (its send/recv take CPU tensors only)"
    return None


def unmeasured() -> dict[str, Any]:
    """The row entry of a contender that could not run an op: every figure NaN (printed "-")."""
    return {key: math.nan for key in ("time_us", "avg_us", "min_us", "algbw", "busbw")} | {"iters": 0}


def format_bytes(size: int) -> str:
    """Short human size: 4, 512K, 64M (exact powers of 1024 get a suffix)."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= unit and size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:.0f}"
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Iterable[Sequence[object]], out: TextIO = sys.stdout) -> None:
    """Print right-aligned columns under a header line (a leading '#' keeps it grep-friendly)."""
    text_rows = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))
    print("#" + line[1:] if line.startswith(" ") else "# " + line, file=out)
    for row in text_rows:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)), file=out)
    out.flush()


class Progress:
    """One-line progress on stderr for long runs; silent when stderr is not a terminal unless forced."""

    def __init__(self, total: int, label: str, *, enabled: bool | None = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._tty = sys.stderr.isatty()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        message = f"[{self.label}] {self.done}/{self.total} {what}"
        if self._tty:
            sys.stderr.write("\r\x1b[K" + message)
            if self.done >= self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(message + "\n")
        sys.stderr.flush()


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine_description() -> str:
    """CPU count, CPU model and Python/OS, for the record (no host names: no DNS lookups)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({model}), Python {platform.python_version()}, {platform.system()}"


def bench_meta(kind: str, started: float, **fields: Any) -> dict[str, Any]:
    """The ``meta`` record of a --json report: ``kind``, the run's ``fields``, then when, where and
    how long (``started`` is the run's ``time.monotonic()`` at its start)."""
    return {
        "kind": kind,
        **fields,
        "date": utc_now(),
        "machine": machine_description(),
        "seconds": round(time.monotonic() - started, 2),
    }


def resolve_loop(choice: str) -> str:
    """The event loop for ``--loop choice``: "auto" is uvloop when it is installed, else asyncio."""
    if choice == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return str(choice)


_T = TypeVar("_T")


def run_loop(main: Coroutine[Any, Any, _T], loop_kind: str) -> _T:
    """Run ``main`` on a fresh event loop of ``loop_kind`` ("uvloop" or "asyncio"); both load lazily."""
    if loop_kind == "uvloop":
        import uvloop

        return uvloop.run(main)
    import asyncio

    return asyncio.run(main)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON; NaN becomes null so strict parsers accept the file."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    with open(path, "w", encoding="utf-8") as handle:
        json.dump(clean(payload), handle, indent=2)
        handle.write("\n")


class SizedOp:
    """An op at one measured size: the element count of each buffer the op touches."""

    __slots__ = ("count", "in_count", "op", "out_count", "size")

    def __init__(self, op: str, size: int, world_size: int, itemsize: int) -> None:
        self.op = op
        self.size = rounded_size(op, size, world_size, itemsize) if op != "barrier" else 0
        self.count = self.size // itemsize
        # all_gather: each rank contributes count/n; reduce_scatter: each rank keeps count/n
        self.in_count = self.count // world_size if op == "all_gather" else self.count
        self.out_count = self.count // world_size if op == "reduce_scatter" else self.count
