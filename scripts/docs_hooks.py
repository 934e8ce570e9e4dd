"""mkdocs hooks for the documentation site (mkdocs.yml names this file): pages that are generated
from the code at build time, so that they cannot drift from it.

A page asks for generated text with a marker line:
- ``<!-- generated: cli-help -->``: every ``aiocoll`` command's ``--help``, from the parsers the
  command itself builds (aiocoll.cli.main.build_parser);
- ``<!-- generated: changelog -->``: CHANGELOG.md from the repository root.

Headings get GitHub's anchors (``## Elastic jobs: `--nnodes MIN:MAX` `` is
``#elastic-jobs---nnodes-minmax``), so that a link into a page works alike on a forge and on the
site.

Pages may also link to files of the repository outside docs/ (``[the example](../examples/x.py)``),
which a forge shows; the site holds no copy of them, so such a link becomes the file's path as
code (``the example (`examples/x.py`)``) instead of a broken link. A link to a path that exists
nowhere stays, and the strict build reports it.

Imports aiocoll's CLI parser only; runs nothing else of aiocoll's.
"""

from __future__ import annotations

import argparse
import os
import re
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


LINK = re.compile(r"\[([^\]]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")


def repository_links_as_paths(markdown: str, page_path: str, docs_dir: Path) -> str:
    """Links from the page at ``page_path`` (relative to docs) to files outside docs, as paths."""
    page_dir = (docs_dir / page_path).parent

    def replace(match: re.Match[str]) -> str:
        text, target = match.group(1), match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        resolved = (page_dir / target).resolve()
        if resolved.is_relative_to(docs_dir.resolve()) or not resolved.exists():
            return match.group(0)
        path = resolved.relative_to(ROOT).as_posix()
        return f"`{path}`" if text.strip("`") == path else f"{text} (`{path}`)"

    return LINK.sub(replace, markdown)


def github_slug(value: str, separator: str = "-") -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", value.strip().lower()).replace(" ", separator)


def on_config(config: Any, **_: Any) -> Any:
    """mkdocs hook: headings' anchors are GitHub's (see the module's docstring)."""
    config["mdx_configs"].setdefault("toc", {})["slugify"] = github_slug
    return config


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, **_: Any) -> str:
    """mkdocs hook: fill the generated sections and turn links to repository files into paths."""
    if page is not None and config is not None:
        markdown = repository_links_as_paths(markdown, page.file.src_uri, Path(config["docs_dir"]))
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
