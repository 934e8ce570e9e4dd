"""PNG charts for `aiocoll bench --plot`: bus bandwidth (and time) against size, log-log.

matplotlib is imported here only, lazily, with the Agg backend (no display needed); this module
is imported only when --plot is given. Imports nothing of aiocoll but the bench helpers and the
palette (aiocoll/_palette.py), which the coordinator's web page shares.
"""

from __future__ import annotations

import math
from typing import Any

from .._palette import SERIES
from ._bench_common import format_bytes

__all__ = ["plot_collectives"]

_STYLE = {
    "aiocoll": {"color": SERIES["aiocoll"], "marker": "o"},
    "gloo": {"color": SERIES["gloo"], "marker": "s"},
    "mpi": {"color": SERIES["mpi"], "marker": "^"},
}
_LABELS = {"aiocoll": "aiocoll", "gloo": "torch gloo", "mpi": "MPI (mpi4py)"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'aiocoll[plot]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _finite(values: list[float]) -> bool:
    return any(v is not None and math.isfinite(v) and v > 0 for v in values)


def plot_collectives(path: str, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Draw busbw (left) and time (right) against size for every op with sizes, both implementations.

    Raises:
        RuntimeError: when matplotlib is missing or there is nothing to draw.
    """
    plt = _pyplot()
    ops = [op for op in meta["ops"] if op != "barrier" and any(r["op"] == op for r in rows)]
    if not ops:
        raise RuntimeError("--plot: no op with sizes was measured (barrier has no bandwidth to draw)")
    impls = ["aiocoll", *meta.get("vs", [])]
    fig, axes = plt.subplots(len(ops), 2, figsize=(11, 3.8 * len(ops) + 0.6), squeeze=False)
    for line, op in enumerate(ops):
        op_rows = sorted((r for r in rows if r["op"] == op), key=lambda r: r["size"])
        sizes = [r["size"] for r in op_rows]
        ax_bw, ax_t = axes[line]
        for impl in impls:
            label = _LABELS[impl]
            busbw = [r[impl]["busbw"] if impl in r else math.nan for r in op_rows]
            times = [r[impl]["time_us"] if impl in r else math.nan for r in op_rows]
            if _finite(busbw):
                ax_bw.plot(sizes, busbw, label=label, linewidth=1.8, markersize=4, **_STYLE[impl])
            if _finite(times):
                ax_t.plot(sizes, times, label=label, linewidth=1.8, markersize=4, **_STYLE[impl])
        for ax, ylabel in ((ax_bw, "bus bandwidth (GB/s)"), (ax_t, "time per op (µs, median)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("message size (bytes)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="major", alpha=0.4)
            ax.grid(True, which="minor", alpha=0.12)
            ticks = sizes[:: max(1, len(sizes) // 7)] if sizes else []
            ax.set_xticks(ticks)
            ax.set_xticklabels([format_bytes(s) for s in ticks])
            ax.legend(loc="best", frameon=False)
        ax_bw.set_title(f"{op}: bus bandwidth (higher is better)", fontsize=10)
        ax_t.set_title(f"{op}: time (lower is better)", fontsize=10)
    what = ", ".join(ops) if len(ops) <= 2 else f"{len(ops)} collectives"
    versus = " vs " + " and ".join(_LABELS[i] for i in impls[1:]) if len(impls) > 1 else ""
    fig.suptitle(
        f"aiocoll{versus}: {what} — world size {meta['world_size']}, {meta['dtype']}, "
        f"{meta.get('hog', 0)} CPU hog(s) — {meta['date']}",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
