"""`aiocoll status --help` and `aiocoll run --help`, as the `aiocoll` dispatcher builds them: every
text whole (no description cut off mid-sentence, every option explained) and useful (examples,
exit status, where the token comes from)."""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aiocoll.cli.main import build_parser

pytestmark = pytest.mark.timeout(30)


def _sub_parser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise AssertionError("the dispatcher has no sub-commands")


def _sentences_are_whole(text: str) -> None:
    for paragraph in re.split(r"\n\s*\n", text.strip()):
        assert paragraph.rstrip().endswith((".", ")")), f"cut off mid-sentence: ...{paragraph[-80:]!r}"


@pytest.mark.parametrize("command", ["status", "run"])
def test_help_is_whole_with_examples_and_exit_status(command: str) -> None:
    parser = _sub_parser(command)
    assert parser.description and len(parser.description) > 200
    _sentences_are_whole(parser.description)
    assert parser.epilog and "examples:" in parser.epilog and "exit status:" in parser.epilog
    _sentences_are_whole(parser.epilog.split("exit status:")[1])
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings or action.dest
        assert action.help and len(action.help) >= 20, f"{name}: {action.help!r}"
    text = parser.format_help()
    assert f"usage: aiocoll {command}" in text


def test_status_help_says_what_it_shows_and_how_to_reach_a_launched_job() -> None:
    text = _sub_parser("status").format_help()
    for fragment in (
        "the rank(s) holding the job back",
        "creates nothing on the coordinator",
        "`aiocoll run` prints the command",
        "--token-file",
        "AIOCOLL_TOKEN",
        "AIOCOLL_COORDINATOR",
        "full identity",
        "exit 1 if the coordinator holds no such job",
    ):
        assert fragment in " ".join(text.split()), fragment


def test_run_help_names_the_connect_timeout_the_status_command_and_the_script_check() -> None:
    text = " ".join(_sub_parser("run").format_help().split())
    for fragment in (
        "--connect-timeout",
        "the launcher exits 2 and starts no worker",
        "prints the 'aiocoll status' command",
        "never on the command line",
        "checked to exist before any worker starts",
        "its last stderr line",
    ):
        assert fragment in text, fragment


@pytest.mark.timeout(60)
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """`aiocoll status --json | head`: the writer stops with SIGPIPE's status, no traceback."""
    script = tmp_path / "lots.py"
    script.write_text(
        "import sys\n"
        "from aiocoll.cli import status\n"
        "status.main = lambda args: [print('x' * 50) for _ in range(200_000)]\n"
        "from aiocoll.cli.main import main\n"
        "sys.exit(main(['status']))\n"
    )
    writer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout is not None and writer.stderr is not None
    assert writer.stdout.readline() == b"x" * 50 + b"\n"
    writer.stdout.close()  # as head does after its first line
    err = writer.stderr.read().decode()
    assert writer.wait(30) == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
