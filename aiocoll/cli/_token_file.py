"""Reading the shared token from a file, the same way for every sub-command.

Surface layer (CLI helpers); imports only the standard library. One reader so that
`aiocoll coordinator`, `aiocoll run` and `aiocoll status` agree on what a token file may hold.
"""

from __future__ import annotations

__all__ = ["read_token_file"]


def read_token_file(path: str) -> str:
    """The shared secret in ``path``, surrounding whitespace removed.

    A trailing newline from ``echo secret > file`` is not part of the token.

    Raises:
        ValueError: the file cannot be read, or holds only whitespace (an empty secret would
            silently turn authentication into a formality).
    """
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read --token-file {path!r}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"--token-file {path!r} is empty; put the shared secret in it")
    return token
