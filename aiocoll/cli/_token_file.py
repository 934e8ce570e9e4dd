"""Reading the shared token from a file, the same way for every sub-command.

Surface layer (CLI helpers); imports only the standard library. One reader so that
`aiocoll coordinator`, `aiocoll run` and `aiocoll status` agree on what a token file may hold,
and one writer: `aiocoll run` keeps a token it did not get from a file (AIOCOLL_TOKEN, or the
random one of an embedded coordinator) in a private file, so the `aiocoll status` command it
prints names a file, never the secret itself.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

__all__ = ["read_token_file", "write_private_token_file"]


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


def write_private_token_file(token: str) -> tuple[str, Callable[[], None]]:
    """Write ``token`` to a new file only this user can read: ``token`` (mode 0600) in a fresh
    directory (mode 0700) under the temporary directory.

    Returns:
        (path, remove): the file's path, and a function that deletes the file and its directory
        (safe to call twice).

    Raises:
        OSError: the file could not be written (nothing is left behind).
    """
    folder = tempfile.mkdtemp(prefix="aiocoll-run-")  # 0700, a name no one else can take first
    path = os.path.join(folder, "token")

    def remove() -> None:
        shutil.rmtree(folder, ignore_errors=True)

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(token + "\n")
    except BaseException:
        remove()
        raise
    return path, remove
