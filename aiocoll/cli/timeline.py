"""`aiocoll timeline DIR -o FILE`: merge the operation records that `AIOCOLL_TIMELINE=DIR` made
every rank write into one Chrome trace, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One track per rank (a trace "process" named "rank R (host)"), one event per operation named
after its kind (``all_reduce``), lasting from the call to its completion on that rank, with the
group, sequence number, bytes, algorithm and outcome as its arguments. A rank that waited for a
late peer shows it as a longer event. Imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "merge"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", metavar="DIR", help="the directory AIOCOLL_TIMELINE named while the job ran"
    )
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="FILE",
        help="the Chrome trace to write (JSON; open it in ui.perfetto.dev or chrome://tracing)",
    )


class TimelineError(ValueError):
    """A timeline directory that cannot be merged; the message says why."""


def _read(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    lines = path.read_text().splitlines()
    if not lines:
        raise TimelineError(f"{path} is empty: not a timeline file (is the job still starting?)")
    try:
        header = json.loads(lines[0])
        events = [json.loads(line) for line in lines[1:] if line.strip()]
    except json.JSONDecodeError as exc:
        raise TimelineError(f"{path}: not a timeline file ({exc})") from None
    if not isinstance(header, dict) or "rank" not in header:
        raise TimelineError(f"{path}: its first line does not describe a rank")
    return header, events


def merge(directory: Path) -> dict[str, Any]:
    """The Chrome trace (``{"traceEvents": [...]}``) of every ``rank*.jsonl`` in ``directory``.

    Raises:
        TimelineError: no timeline files there, or one that cannot be read.
    """
    files = sorted(directory.glob("rank*.jsonl"))
    if not files:
        raise TimelineError(
            f"no timeline files (rank*.jsonl) in {directory}: run the job with AIOCOLL_TIMELINE={directory}"
        )
    trace: list[dict[str, Any]] = []
    for path in files:
        header, events = _read(path)
        rank = int(header["rank"])
        pid = rank
        trace.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": pid,
                "args": {"name": f"rank {rank} ({header.get('host')})"},
            }
        )
        trace.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": rank}})
        for event in events:
            args = {
                key: event.get(key)
                for key in ("label", "group", "seq", "bytes", "algo", "outcome", "group_rank")
                if event.get(key) is not None
            }
            trace.append(
                {
                    "name": event["kind"],
                    "cat": "aiocoll",
                    "ph": "X",
                    "pid": pid,
                    "tid": 0,
                    "ts": event["start"],
                    "dur": max(0.0, event["end"] - event["start"]),
                    "args": args,
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def main(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    if not directory.is_dir():
        print(f"aiocoll timeline: {directory} is not a directory", file=sys.stderr)
        return 2
    try:
        trace = merge(directory)
    except TimelineError as exc:
        print(f"aiocoll timeline: {exc}", file=sys.stderr)
        return 1
    Path(args.output).write_text(json.dumps(trace))
    operations = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    ranks = sum(1 for e in trace["traceEvents"] if e["name"] == "process_name")
    print(
        f"{args.output}: {operations} operations of {ranks} rank(s); open it in ui.perfetto.dev or chrome://tracing"
    )
    return 0
