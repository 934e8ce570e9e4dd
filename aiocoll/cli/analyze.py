"""`aiocoll analyze DIR`: read the flight recorder's dumps of a job's ranks; name the rank holding it back.

Each rank writes ``DIR/<job>-rank<R>.json`` when one of its operations fails, and on SIGUSR1,
when ``AIOCOLL_DUMP_DIR=DIR`` is set (`aiocoll run` sets it for its workers and prints where).
For every group it prints the last sequence number each rank entered and completed, names the
ranks that did not reach the operation the others wait in (with where they last called), and
names mismatches: ranks whose records show different operations at one sequence number, with
their call sites.

Exit status: 0 when the dumps agree (nobody behind, no mismatch), 1 when a rank was behind or
the calls mismatched, 2 when the dumps could not be read. Imports only the standard library and
aiocoll._errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiocoll._errors import group_name

__all__ = ["AnalyzeError", "Finding", "add_arguments", "analyze", "load", "main"]

EXIT_AGREE = 0
EXIT_FOUND = 1
EXIT_UNREADABLE = 2
_WAITING = ("started", "queued")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory",
        metavar="DIR",
        help="the directory AIOCOLL_DUMP_DIR named (aiocoll run prints it when a job fails)",
    )
    parser.add_argument("--job", metavar="ID", help="only the dumps of this job (default: every job in DIR)")


class AnalyzeError(ValueError):
    """Dumps that cannot be read; the message says which and why."""


@dataclass
class Finding:
    """What ``analyze`` found: the report's lines, and whether a rank was behind or calls differed."""

    lines: list[str] = field(default_factory=list)
    behind: list[tuple[str, int, list[int]]] = field(default_factory=list)  # (group, seq, ranks)
    mismatches: list[tuple[str, int, dict[str, list[int]]]] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return bool(self.behind or self.mismatches)


def load(directory: Path, job: str | None = None) -> dict[str, dict[int, dict[str, Any]]]:
    """The dumps in ``directory``, by job and rank.

    Raises:
        AnalyzeError: not a directory, no dump in it, or a file that is not a dump.
    """
    if not directory.is_dir():
        raise AnalyzeError(f"{directory} is not a directory")
    files = sorted(directory.glob("*.json"))
    if not files:
        raise AnalyzeError(
            f"no flight-recorder dump in {directory} (a rank writes <job>-rank<R>.json there when an "
            "operation fails or on SIGUSR1, when AIOCOLL_DUMP_DIR names the directory)"
        )
    jobs: dict[str, dict[int, dict[str, Any]]] = {}
    for path in files:
        try:
            dump = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise AnalyzeError(f"{path}: not a flight-recorder dump ({exc})") from None
        if not isinstance(dump, dict) or not {"rank", "ops", "groups"} <= set(dump):
            raise AnalyzeError(f"{path}: not a flight-recorder dump (no rank, ops and groups)")
        if not isinstance(dump["ops"], list) or not isinstance(dump["groups"], list):
            raise AnalyzeError(f"{path}: not a flight-recorder dump (ops and groups must be lists)")
        name = str(dump.get("job", "default"))
        if job is not None and name != job:
            continue
        jobs.setdefault(name, {})[int(dump["rank"])] = dump
    if not jobs:
        raise AnalyzeError(f"no dump of job {job!r} in {directory}")
    return jobs


def _site(op: dict[str, Any] | None) -> str:
    site = (op or {}).get("site")
    if not isinstance(site, dict):
        return ""
    return f" at {site.get('file')}:{site.get('line')} ({site.get('function')})"


def _when(stamp: Any, dump: dict[str, Any]) -> str:
    """A time of ``dump``'s host, on the coordinator's clock when the dump says how (its
    ``clock``), so that the times of ranks on different hosts compare."""
    if not isinstance(stamp, (int, float)):
        return "?"
    clock = dump.get("clock")
    offset = clock.get("offset") if isinstance(clock, dict) else None
    if isinstance(offset, (int, float)):
        stamp += offset
    return time.strftime("%H:%M:%S", time.localtime(stamp)) + f".{int(stamp * 1000) % 1000:03d}"


def analyze(dumps: dict[int, dict[str, Any]]) -> Finding:
    """What one job's dumps (by rank) say, group by group."""
    out = Finding()
    say = out.lines.append
    for rank, dump in sorted(dumps.items()):
        when = _when(dump.get("time"), dump)
        say(f"rank {rank} (pid {dump.get('pid')}, {dump.get('host')}) dumped at {when}: {dump.get('reason')}")
    groups: dict[str, dict[str, Any]] = {}
    for dump in dumps.values():
        for g in dump["groups"]:
            groups.setdefault(str(g["group"]), g)
    for gid, info in groups.items():
        _group(out, gid, info, dumps)
    if not out.found:
        say("the dumps agree: no rank is behind another and no two ranks called different operations")
    return out


def _group(out: Finding, gid: str, info: dict[str, Any], dumps: dict[int, dict[str, Any]]) -> None:
    say = out.lines.append
    label = str(info.get("label") or group_name(gid))
    members = [int(r) for r in info.get("ranks", [])] or sorted(dumps)
    say("")
    say(f"group {label!r} (ranks {', '.join(map(str, members))}):")
    entered: dict[int, int] = {}
    stuck: dict[int, dict[str, Any]] = {}  # rank -> the first operation it waits in or failed
    by_seq: dict[int, dict[int, dict[str, Any]]] = {}  # seq -> rank -> its record
    last_call: dict[int, dict[str, Any]] = {}
    for rank in members:
        dump = dumps.get(rank)
        if dump is None:
            continue
        mine = [op for op in dump["ops"] if op.get("group") == gid and isinstance(op.get("seq"), int)]
        seqs = [op for op in mine if op["seq"] >= 0]
        completed = max((op["seq"] for op in seqs if op.get("state") == "completed"), default=-1)
        row = next((g for g in dump["groups"] if g.get("group") == gid), None)
        last = int(row["next_seq"]) - 1 if row is not None and "next_seq" in row else -1
        last = max([last, *(op["seq"] for op in seqs)])
        entered[rank] = last
        if mine:
            last_call[rank] = max(mine, key=lambda op: op.get("enter") or 0.0)
        for op in seqs:
            by_seq.setdefault(op["seq"], {})[rank] = op
        waits = [op for op in seqs if op.get("state") in _WAITING or op.get("state") == "failed"]
        if waits:
            stuck[rank] = min(waits, key=lambda op: op["seq"])
        where = f"entered seq {last}" if last >= 0 else "entered no operation"
        line = f"  rank {rank}: {where}, completed " + (f"seq {completed}" if completed >= 0 else "none")
        if rank in stuck:
            op = stuck[rank]
            state = "waits in" if op.get("state") in _WAITING else f"failed ({op.get('outcome')}) in"
            line += (
                f"; {state} seq {op['seq']} {op.get('op')} since {_when(op.get('enter'), dump)}{_site(op)}"
            )
        elif rank in last_call:
            line += f"; its last call{_site(last_call[rank])}"
        say(line)
    missing = [r for r in members if r not in dumps]
    for rank in missing:
        say(f"  rank {rank}: no dump (the process was gone before it could write one: killed, exited, or "
            "without AIOCOLL_DUMP_DIR)")  # fmt: skip
    # Mismatches: the same seq, different operations.
    for seq in sorted(by_seq):
        calls: dict[str, list[int]] = {}
        for rank, op in sorted(by_seq[seq].items()):
            calls.setdefault(str(op.get("op")), []).append(rank)
        if len(calls) > 1:
            out.mismatches.append((gid, seq, calls))
            say(f"  MISMATCH at seq {seq}: the ranks called different operations:")
            for call, ranks in calls.items():
                for rank in ranks:
                    say(f"    rank {rank} called {call}{_site(by_seq[seq][rank])}")
    # Behind: the ranks that never entered the operation the others wait in.
    if stuck:
        seq = min(op["seq"] for op in stuck.values())
        waiting = sorted(r for r, op in stuck.items() if op["seq"] == seq)
        behind = [r for r in members if r in entered and entered[r] < seq] + missing
        if behind:
            out.behind.append((gid, seq, sorted(behind)))
            what = stuck[waiting[0]].get("op")
            late = sorted(behind)
            say(f"  => rank(s) {late} did not reach seq {seq} ({what}), which rank(s) {waiting} wait in")
            for rank in sorted(behind):
                if rank in missing:
                    continue
                at = f"seq {entered[rank]}" if entered[rank] >= 0 else "no operation"
                say(f"     rank {rank} last entered {at}{_site(last_call.get(rank))}")


def main(args: argparse.Namespace) -> int:
    try:
        jobs = load(Path(args.directory), args.job)
    except AnalyzeError as exc:
        print(f"aiocoll analyze: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    found = False
    for name, dumps in sorted(jobs.items()):
        if len(jobs) > 1:
            print(f"job {name!r}:")
        finding = analyze(dumps)
        print("\n".join(finding.lines))
        found = found or finding.found
    return EXIT_FOUND if found else EXIT_AGREE
