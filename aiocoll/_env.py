"""Numbers from environment variables: one parser and one wording for every setting aiocoll
reads (AIOCOLL_*, and the launchers' RANK, WORLD_SIZE, SLURM_*, ...); and what to say when the
variables a launcher sets are missing.

Imports only the standard library; never anything of aiocoll's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = [
    "LAUNCH_VARIABLES",
    "env_float",
    "env_int",
    "env_seconds",
    "env_text",
    "launch_variables_missing",
]

# What env:// reads, in the order a launcher's documentation lists them.
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

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


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from ``name`` (``default`` when unset or blank):
    AIOCOLL_HEARTBEAT_TIMEOUT (the coordinator's liveness limit) and AIOCOLL_PROGRESS_AFTER (how
    long an operation waits before its rank reports it).

    Raises:
        ValueError: the variable is set to something that is not a positive number.
    """
    text = env_text(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not a number of seconds") from None
    if not 0 < value < 1e9:
        raise ValueError(f"environment variable {name}={text!r} must be a positive number of seconds")
    return value


def env_text(name: str, environ: Mapping[str, str] | None = None, *, strip: bool = True) -> str | None:
    """The text in ``name``, stripped (as set, with ``strip=False``: a secret is taken whole);
    None when it is unset or blank."""
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or raw.strip() == "":
        return None
    return raw.strip() if strip else raw


def launch_variables_missing(missing: Sequence[str]) -> ValueError:
    """The error for an env:// rendezvous whose launcher variables ``missing`` are not set: the
    script was most likely started with plain ``python``, not by a launcher."""
    if set(missing) >= set(LAUNCH_VARIABLES):
        unset = "none of them is set"
    else:
        names = missing[0] if len(missing) == 1 else f"{', '.join(missing[:-1])} and {missing[-1]}"
        unset = f"{names} {'is' if len(missing) == 1 else 'are'} not set"
    return ValueError(
        f"init_method='env://' (the default) reads {', '.join(LAUNCH_VARIABLES[:-1])} and "
        f"{LAUNCH_VARIABLES[-1]} from the environment, and {unset}. Launch the script with `aiocoll "
        f"run --nproc-per-node N script.py` (or torchrun), which sets them for every process, or set "
        f"them yourself (or pass init_method='tcp://HOST:PORT' with rank= and world_size=)"
    )
