"""The coordinator's web page: its files (server/page/: index.html, page.css, page.js, hmac.js,
served at /, /page.css, /page.js and /hmac.js), read from the package once, the palette's colours
(aiocoll/_palette.py) put before the style sheet, and the headers they are served with.

The page needs nothing from outside the coordinator (no CDN, no build step): a cluster without
internet serves it as it is. Its content security policy lets it load only its own files and
talk only to its own origin, so even a job or host name crafted as markup could not run a script
(the page also sets every such name as text). The data comes from /jobs; who may see it is
_page_access's business. Imports aiocoll._palette and the standard library only.
"""

from __future__ import annotations

import functools
from importlib import resources

from aiocoll._palette import css_variables

__all__ = ["PAGE_HEADERS", "PAGE_PATHS", "asset"]

# path -> (file in server/page/, content type)
_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/hmac.js": ("hmac.js", "text/javascript; charset=utf-8"),
}
PAGE_PATHS = tuple(_FILES)

PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


@functools.cache
def asset(path: str) -> tuple[str, bytes]:
    """The content type and bytes served at ``path`` (one of PAGE_PATHS).

    Raises:
        KeyError: for any other path.
    """
    name, content_type = _FILES[path]
    body = resources.files("aiocoll.server").joinpath("page", name).read_bytes()
    if name == "page.css":
        body = css_variables().encode() + b"\n" + body
    return content_type, body
