"""The page's own SHA-256 and HMAC-SHA256 (server/page/hmac.js) give what Python's hashlib and
hmac give, run in a real headless Chromium (the page's browser), and under node when this machine
has it. The vectors cross every padding boundary of a 64-byte block, keys longer than a block,
and tokens that are not ASCII (the page encodes the token as UTF-8, as the coordinator does)."""

from __future__ import annotations

import hashlib
import hmac
import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from aiocoll.server._page_access import PROOF_LABEL, page_proof

pytestmark = pytest.mark.timeout(60)

HMAC_JS = Path(__file__).resolve().parents[2] / "server" / "page" / "hmac.js"

# (key, message): texts, encoded as UTF-8 on both sides.
VECTORS = [
    ("", ""),
    ("key", "The quick brown fox jumps over the lazy dog"),
    ("k", "a" * 55),  # the length fits in the first block
    ("k", "a" * 56),  # the length needs a second block
    ("k", "a" * 63),
    ("k", "a" * 64),
    ("k", "a" * 65),
    ("b" * 64, "one block of key"),
    ("c" * 65, "a key longer than a block is hashed first"),
    ("c" * 200, "x" * 1000),
    ("jeton-\u00e9t\u00e9-\u2603-\U0001f512", "aiocoll page|0123456789abcdef0123456789abcdef"),
]


def _expected() -> list[dict[str, str]]:
    return [
        {
            "sha256": hashlib.sha256(message.encode()).hexdigest(),
            "hmac": hmac.new(key.encode(), message.encode(), hashlib.sha256).hexdigest(),
        }
        for key, message in VECTORS
    ]


CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium; .ci/run installs it)"
)


_RUN = """
const results = VECTORS.map(([key, message]) => ({
  sha256: aiocollHmac.hex(aiocollHmac.sha256(aiocollHmac.utf8(message))),
  hmac: aiocollHmac.hex(aiocollHmac.hmacSha256(aiocollHmac.utf8(key), aiocollHmac.utf8(message))),
}));
"""


@needs_chromium
def test_the_page_hmac_matches_python_in_headless_chromium(tmp_path: Path) -> None:
    assert CHROMIUM is not None
    page = tmp_path / "vectors.html"
    page.write_text(
        "<!doctype html><html><body><pre id='out'>not run</pre>"
        f"<script src='{HMAC_JS.as_uri()}'></script>"
        f"<script>const VECTORS = {json.dumps(VECTORS)};{_RUN}"
        "document.getElementById('out').textContent = JSON.stringify(results);</script>"
        "</body></html>",
        encoding="utf-8",
    )
    profile = f"--user-data-dir={tmp_path / 'profile'}"
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", profile, "--dump-dom", page.as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=50)
    match = re.search(r"<pre id=\"out\">(.*?)</pre>", done.stdout, re.S)
    assert match, f"no output from chromium (exit {done.returncode}): {done.stderr[-2000:]}"
    assert json.loads(html.unescape(match.group(1))) == _expected()


def test_the_page_hmac_matches_python_under_node_when_there_is_one() -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (not a dependency: the headless Chromium test covers the browser)")
    script = f"const aiocollHmac = require({json.dumps(str(HMAC_JS))});\n"
    script += f"const VECTORS = {json.dumps(VECTORS)};{_RUN}console.log(JSON.stringify(results));"
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == _expected()


def test_the_proof_the_page_computes_is_the_one_the_coordinator_expects() -> None:
    # The page answers HMAC(token, label + nonce): the last vector is such an answer.
    key, message = VECTORS[-1]
    nonce = message.removeprefix(PROOF_LABEL.decode())
    assert message.startswith(PROOF_LABEL.decode())
    assert _expected()[-1]["hmac"] == page_proof(key, nonce)
