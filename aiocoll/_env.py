"""Numbers from environment variables: one parser and one wording for every setting aiocoll
reads (AIOCOLL_*, and the launchers' RANK, WORLD_SIZE, SLURM_*, ...).

Imports only the standard library; never anything of aiocoll's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TypeVar

__all__ = ["env_float", "env_int", "env_text"]

_N = TypeVar("_N", int, float)


def _number(name: str, kind: Callable[[str], _N], what: str, environ: Mapping[str, str] | None) -> _N | None:
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return None  # unset, or set to nothing (a blank line in an env file): the default applies
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(
            f"environment variable {name}={raw!r} is not {what}; set a number or unset it"
        ) from None


def env_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """The integer in ``name``; None when it is unset or blank.

    Raises:
        ValueError: naming the variable and its value when it is not an integer.
    """
    return _number(name, int, "an integer", environ)


def env_float(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    """The number in ``name``; None when it is unset or blank.

    Raises:
        ValueError: naming the variable and its value when it is not a number.
    """
    return _number(name, float, "a number", environ)


def env_text(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text in ``name``, stripped; None when it is unset or blank."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip()
