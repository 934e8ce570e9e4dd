"""The documentation site builds with warnings as errors.

`mkdocs build --strict` renders docs/ (mkdocs.yml) with the API reference from the docstrings
(mkdocstrings) and the CLI reference from each command's --help (scripts/docs_hooks.py); a broken
link or anchor, a docstring griffe cannot parse, or a page left out of the navigation fails it.
"""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mkdocs() -> str:
    found = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if not found:
        pytest.fail("mkdocs is not installed: pip install -r requirements-test.txt")
    return found


@pytest.mark.timeout(180)
def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    out = subprocess.run(
        [_mkdocs(), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    for command in ("coordinator", "run", "bench", "status", "timeline"):
        assert f"usage: aiocoll {command}" in cli, f"the CLI page lacks `aiocoll {command} --help`"
    api = (tmp_path / "site" / "reference" / "aiocoll" / "index.html").read_text()
    assert "all_reduce" in api and "init_process_group" in api

    # The reference presents public names and the public surface only: no anchor, heading or
    # text names a private module or member, a constructor users never call, or a dunder.
    for page in sorted((tmp_path / "site" / "reference").glob("*/index.html")):
        source = page.read_text()
        anchors = re.findall(r'id="(aiocoll[^"]*)"', source)
        private = [a for a in anchors if re.search(r"\._", a)]
        assert not private, f"{page.parent.name}: private names in the reference: {private[:10]}"
        shown = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<script.*?</script>", "", source, flags=re.S)))
        for leak in ("aiocoll._", "ASYNC_COUNTERPART", "FACADE_ONLY", "_Runtime", "GroupState"):
            assert leak not in shown, f"{page.parent.name}: the reference shows {leak!r}"
        sentinel = re.search(r"=\s*(_DEFAULT\w*)", shown)  # a private default (scripts/griffe_public.py)
        assert sentinel is None, f"{page.parent.name}: a parameter defaults to {sentinel.group(1)!r}"
        # Groups and Works are made by aiocoll, not by users: no constructor signature.
        made = re.search(r"(ProcessGroup|Work)\s*\(\s*(runtime|core|outcome|future|store)\b", shown)
        assert made is None, f"{page.parent.name}: the reference shows a constructor: {made.group(0)!r}"
    api = (tmp_path / "site" / "reference" / "aiocoll" / "index.html").read_text()
    assert 'id="aiocoll.Work"' in api and 'id="aiocoll.ProcessGroup.all_reduce"' in api
