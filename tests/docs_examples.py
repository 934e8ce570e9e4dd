"""The Python examples of the documentation (README.md and docs/**/*.md), found by their markers.

Every ```python block must be preceded (on the line before its fence) by a marker saying how it
runs, so that no example is silently left out:
- ``<!-- example: run N -->``: a whole script, run under ``aiocoll run --nproc-per-node N``;
- ``<!-- example: python -->``: a whole script, run with ``python``;
- ``<!-- example: not run (REASON) -->``: a fragment or a script that needs what a test machine
  lacks; REASON says which. Still compiled, so its syntax is checked.

Shared by tests/unit/test_docs_site.py (markers and syntax) and
tests/integration/test_docs_examples.py (running them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- example: (run (?P<n>\d+)|python|not run \((?P<why>.+)\)) -->")


@dataclass(frozen=True)
class Example:
    """One ```python block: where it is, how it runs, and its code."""

    page: str
    line: int
    mode: str  # "run", "python", "not run", or "unmarked"
    nproc: int
    reason: str
    code: str

    @property
    def label(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples() -> list[Example]:
    found = []
    for page in pages():
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                body = []
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                marker = MARKER.search(lines[start - 1]) if start else None
                if marker is None:
                    mode, nproc, reason = "unmarked", 0, ""
                elif marker.group("n"):
                    mode, nproc, reason = "run", int(marker.group("n")), ""
                elif marker.group("why"):
                    mode, nproc, reason = "not run", 0, marker.group("why")
                else:
                    mode, nproc, reason = "python", 1, ""
                indent = len(lines[start]) - len(lines[start].lstrip())
                code = "\n".join(line[indent:] for line in body) + "\n"
                found.append(Example(str(page.relative_to(ROOT)), start + 1, mode, nproc, reason, code))
            i += 1
    return found
