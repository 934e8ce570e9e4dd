"""mkdocs hooks for the documentation site (mkdocs.yml names this file): pages that are generated
from the code at build time, so that they cannot drift from it.

A page asks for generated text with a marker line:
- ``<!-- generated: cli-help -->``: every ``aiocoll`` command's ``--help``, from the parsers the
  command itself builds (aiocoll.cli.main.build_parser);
- ``<!-- generated: changelog -->``: CHANGELOG.md from the repository root.

Imports aiocoll's CLI parser only; runs nothing else of aiocoll's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS: fixed, so the page is the same on every machine


def cli_help_markdown() -> str:
    """The ``--help`` text of ``aiocoll`` and of each sub-command, one section per command."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_WIDTH
    try:
        from aiocoll.cli.main import build_parser

        parser = build_parser()
        sections = ["## `aiocoll`\n", "```text\n" + parser.format_help().rstrip() + "\n```\n"]
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for name, sub in subparsers.choices.items():
            sections.append(f"## `aiocoll {name}`\n")
            sections.append("```text\n" + sub.format_help().rstrip() + "\n```\n")
        return "\n".join(sections)
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def changelog_markdown() -> str:
    """CHANGELOG.md without its own title (the page has one)."""
    lines = (ROOT / "CHANGELOG.md").read_text().splitlines()
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
    return "\n".join(lines) + "\n"


GENERATORS = {"cli-help": cli_help_markdown, "changelog": changelog_markdown}


def on_page_markdown(markdown: str, **_: Any) -> str:
    """mkdocs hook: replace each ``<!-- generated: NAME -->`` line with NAME's text."""
    out = []
    for line in markdown.splitlines():
        marker = line.strip()
        if marker.startswith("<!-- generated:") and marker.endswith("-->"):
            name = marker[len("<!-- generated:") : -len("-->")].strip()
            if name not in GENERATORS:
                raise ValueError(f"unknown generated section {name!r} (known: {sorted(GENERATORS)})")
            out.append(GENERATORS[name]())
        else:
            out.append(line)
    return "\n".join(out) + "\n"
