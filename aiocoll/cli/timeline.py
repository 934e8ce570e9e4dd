"""`aiocoll timeline DIR -o FILE`: merge the operation records that `AIOCOLL_TIMELINE=DIR` made
every rank write (or the flight-recorder dumps that `AIOCOLL_DUMP_DIR=DIR` collected) into one
Chrome trace, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One track per rank (a trace "process" named "rank R (host)"), one event per operation named
after its kind (``all_reduce``), lasting from the call to its completion on that rank, with the
group, sequence number, bytes, algorithm and outcome as its arguments. For each collective it
also shows arrival: when each rank entered it after the first, and how long it waited for the
last one (a slice "waiting for rank R" on the rank's second track). Times are on the
coordinator's clock, so that ranks on different hosts compare: each rank's files say its
clock's offset to the coordinator's, as its heartbeats measured it (client/_clock.py); without
a coordinator, each host's own clock. Imports only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "longest_wait", "main", "merge"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        metavar="DIR",
        help="the directory AIOCOLL_TIMELINE named while the job ran, or one of flight-recorder dumps "
        "(AIOCOLL_DUMP_DIR)",
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
    """A rank's timeline file: its header (with ``clock``: the last clock line, or None) and its
    operations, their times on the coordinator's clock where the file says how (its clock lines;
    operations before the first take the first)."""
    lines = path.read_text().splitlines()
    if not lines:
        raise TimelineError(f"{path} is empty: not a timeline file (is the job still starting?)")
    try:
        header = json.loads(lines[0])
        records = [json.loads(line) for line in lines[1:] if line.strip()]
    except json.JSONDecodeError as exc:
        raise TimelineError(f"{path}: not a timeline file ({exc})") from None
    if not isinstance(header, dict) or "rank" not in header:
        raise TimelineError(f"{path}: its first line does not describe a rank")
    events: list[dict[str, Any]] = []
    unaligned: list[dict[str, Any]] = []  # before the first clock line
    header["clock"] = None
    for record in records:
        clock = _clock(record)
        if clock is not None:
            header["clock"] = clock
            _shift(unaligned, clock["offset"])
            unaligned = []
        elif header["clock"] is None:
            unaligned.append(record)
            events.append(record)
        else:
            _shift([record], header["clock"]["offset"])
            events.append(record)
    return header, events


def _clock(record: Any) -> dict[str, float] | None:
    """``{"offset", "error"}`` (seconds) of a clock line (``{"clock", "error"}``) or a dump's
    ``clock``; None for anything else."""
    if not isinstance(record, dict):
        return None
    offset = record.get("clock", record.get("offset"))
    if not isinstance(offset, (int, float)) or isinstance(offset, bool) or "kind" in record:
        return None
    error = record.get("error")
    return {"offset": float(offset), "error": float(error) if isinstance(error, (int, float)) else 0.0}


def _shift(events: list[dict[str, Any]], offset: float) -> None:
    """Move the events' times (microseconds) by ``offset`` seconds."""
    for event in events:
        for key in ("start", "end"):
            if type(event.get(key)) in (int, float):
                event[key] += offset * 1e6


def _read_dump(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """A flight-recorder dump (client/_recorder.py) as a timeline's header and events; None when
    the file is not one."""
    try:
        dump = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TimelineError(f"{path}: not a flight-recorder dump ({exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("ops"), list) or "rank" not in dump:
        return None
    clock = _clock(dump.get("clock"))
    header = {
        "rank": dump["rank"],
        "host": dump.get("host"),
        "pid": dump.get("pid"),
        "job": dump.get("job"),
        "clock": clock,
    }
    events: list[dict[str, Any]] = []
    for op in dump["ops"]:
        enter = op.get("enter")
        if not isinstance(enter, (int, float)):
            continue
        end = op.get("end") if isinstance(op.get("end"), (int, float)) else dump.get("time", enter)
        sig = op.get("sig") or {}
        events.append(
            {
                "kind": sig.get("kind") or str(op.get("op", "operation")).partition("(")[0],
                "group": op.get("group"),
                "label": op.get("label"),
                "seq": op.get("seq"),
                "start": enter * 1e6,
                "end": end * 1e6,
                "outcome": op.get("outcome") or op.get("state"),
                "op": op.get("op"),
                "site": "{file}:{line}".format(**op["site"]) if isinstance(op.get("site"), dict) else None,
            }
        )
    if clock is not None:
        _shift(events, clock["offset"])
    return header, events


def _sources(directory: Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    files = sorted(directory.glob("rank*.jsonl"))
    if files:
        return [_read(path) for path in files]
    dumps = [d for d in (_read_dump(path) for path in sorted(directory.glob("*.json"))) if d is not None]
    if not dumps:
        raise TimelineError(
            f"no timeline files (rank*.jsonl) and no flight-recorder dumps (<job>-rank<R>.json) in "
            f"{directory}: run the job with AIOCOLL_TIMELINE={directory} (or AIOCOLL_DUMP_DIR={directory})"
        )
    return dumps


def _arrivals(
    sources: list[tuple[dict[str, Any], list[dict[str, Any]]]],
) -> dict[tuple[Any, Any], dict[str, Any]]:
    """Per collective (group, seq): when its first and last rank entered it, and which was last."""
    entered: dict[tuple[Any, Any], list[tuple[float, int]]] = {}
    for header, events in sources:
        for event in events:
            if isinstance(event.get("seq"), int) and event["seq"] >= 0:
                entered.setdefault((event.get("group"), event["seq"]), []).append(
                    (event["start"], int(header["rank"]))
                )
    out = {}
    for key, times in entered.items():
        if len(times) > 1:
            first, last = min(times), max(times)
            out[key] = {"first": first[0], "last": last[0], "last_rank": last[1], "ranks": len(times)}
    return out


def merge(directory: Path) -> dict[str, Any]:
    """The Chrome trace (``{"traceEvents": [...]}``) of every ``rank*.jsonl`` in ``directory``, or
    else of every flight-recorder dump there.

    Each operation is an event on its rank's track with, for a collective, when the rank entered
    it after the first one did (``entered_after_first_us``) and how long it waited for the last
    one to enter (``waited_for_last_us``, ``last_rank``); a wait is also a slice of its own on the
    rank's "arrival" track, named after the rank it waited for (Horovod's negotiation view).

    Raises:
        TimelineError: no timeline files or dumps there, or one that cannot be read.
    """
    sources = _sources(directory)
    arrivals = _arrivals(sources)
    trace: list[dict[str, Any]] = []
    for header, events in sources:
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
        trace.append(
            {"name": "process_labels", "ph": "M", "pid": pid, "args": {"labels": _clock_label(header)}}
        )
        trace.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "operations"}})
        trace.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": pid,
                "tid": 1,
                "args": {"name": "waiting for the last rank"},
            }
        )
        for event in events:
            args = {
                key: event.get(key)
                for key in ("label", "group", "seq", "bytes", "algo", "outcome", "group_rank", "op", "site")
                if event.get(key) is not None
            }
            arrival = arrivals.get((event.get("group"), event.get("seq")))
            if arrival is not None:
                waited = max(0.0, min(arrival["last"], event["end"]) - event["start"])
                args["entered_after_first_us"] = round(event["start"] - arrival["first"], 1)
                args["waited_for_last_us"] = round(waited, 1)
                args["last_rank"] = arrival["last_rank"]
                if waited > 0 and arrival["last_rank"] != rank:
                    name = f"waiting for rank {arrival['last_rank']}"
                    wait = {"name": name, "cat": "aiocoll.arrival", "pid": pid, "tid": 1}
                    trace.append({**wait, "ph": "B", "ts": event["start"], "args": {"seq": event.get("seq")}})
                    trace.append({**wait, "ph": "E", "ts": event["start"] + waited})
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


def _clock_label(header: dict[str, Any]) -> str:
    clock = header.get("clock")
    if clock is None:
        return "times on this host's clock (no coordinator's clock to align them to)"
    return (
        f"times on the coordinator's clock: this host's {clock['offset'] * 1e3:+.3f} ms "
        f"(to within {clock['error'] * 1e3:.3f} ms)"
    )


def longest_wait(trace: dict[str, Any]) -> str | None:
    """A sentence on the operation whose last rank came latest after the first, if any waited."""
    best: dict[str, Any] | None = None
    for event in trace["traceEvents"]:
        args = event.get("args") or {}
        if event.get("ph") == "X" and args.get("waited_for_last_us", 0) > 0:
            if best is None or args["waited_for_last_us"] > best["args"]["waited_for_last_us"]:
                best = event
    if best is None:
        return None
    args = best["args"]
    where = f"group {args.get('label') or args.get('group')!r}, seq {args.get('seq')}"
    waited = args["waited_for_last_us"] / 1e3
    return (
        f"the longest wait: rank {best['pid']} waited {waited:.1f} ms in {best['name']} ({where}) "
        f"for rank {args['last_rank']} to enter it"
    )


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
    said = longest_wait(trace)
    if said:
        print(said)
    return 0
