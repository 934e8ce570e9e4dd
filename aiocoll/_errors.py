"""The error hierarchy every layer raises; it imports nothing from aiocoll but aiocoll._env.

All errors derive from DistError (torch.distributed's name for its base error). Where a builtin
describes the failure too, we inherit it as well, so ``except TimeoutError`` keeps working.
Messages always name what went wrong: rank, operation, group, sequence number, key; and say each
cause once: an error that wraps another whose words it already holds does not chain it (``chain``).

The classes the top-level package exports say so in ``__module__``: tracebacks, ``repr`` and
pickles name ``aiocoll.CollectiveTimeout``, not this private module. Every error pickles with its
message and attributes (``DistError.__reduce__``), so one can cross a process boundary.

Warnings go through ``warn``, which points them at the user's line: the first frame outside
aiocoll, or, on the blocking facade's loop thread (where no user frame is), the line that called
the facade (``CALLER_SITE``, set by aiocoll/_sync_loop.py).

Tracebacks end at the public call: ``trim`` drops aiocoll's internal frames from an error's
traceback and from those of its causes (the user's frames stay, and the first aiocoll frame the
user called when it is a public function), and a ``sys.excepthook`` installed at import, when the
program has none of its own, trims what an uncaught aiocoll error prints (other exceptions, which
may be bugs of aiocoll's, keep every frame). ``AIOCOLL_DEBUG=1`` keeps
every frame.
"""

from __future__ import annotations

import itertools
import os
import sys
import sysconfig
import traceback
import warnings
from collections.abc import Iterable, Sequence
from contextvars import ContextVar
from types import CodeType, FrameType, TracebackType
from typing import Any, TypeVar

from ._env import env_text

__all__ = [
    "AuthenticationError",
    "CollectiveTimeout",
    "DistError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "RendezvousError",
    "StoreError",
    "StoreTimeout",
    "CALLER_SITE",
    "chain",
    "group_name",
    "internal_dirs",
    "peer_gone",
    "trim",
    "user_site",
    "warn",
]

_E = TypeVar("_E", bound=BaseException)

# The world group's id (aiocoll.client.bootstrap.WORLD_GID): short on the wire, "world" in messages.
_WORLD_GID = "w"


def group_name(gid: str) -> str:
    """A group's name in messages.

    The world group (id "w") is "world", and a sub-group made from it ("w.5") is "world.5";
    other ids read as they are.
    """
    if gid == _WORLD_GID:
        return "world"
    if gid.startswith(_WORLD_GID + "."):
        return "world" + gid[len(_WORLD_GID) :]
    return gid


# (filename, line, module globals, function) of the user's call that a coroutine on the loop
# thread serves.
Site = tuple[str, int, dict[str, Any], str]
CALLER_SITE: ContextVar[Site | None] = ContextVar("aiocoll_caller_site", default=None)


# Packages whose frames lie between the user's line and aiocoll's: torch calls the "aiocoll"
# backend from its own init_process_group.
_NOT_THE_USER = ("aiocoll", "torch")


# The codes of the frames user_site passed over, and of the user's frames it stopped at, by id (a
# code's hash is slow): every blocking call walks the same few frames of aiocoll and torch, from
# the same few lines of the user's. The codes are kept, so no id is reused.
_passed_codes: dict[int, CodeType] = {}
_user_codes: dict[int, CodeType] = {}


def user_site(frame: FrameType | None) -> Site | None:
    """The user's frame: the first from ``frame`` outwards outside aiocoll and torch, as a Site.

    torch's frames are passed over too: its init_process_group calls aiocoll's backend.
    """
    passed = _passed_codes
    f: Any = frame  # (None past the outermost frame, whose f_code raises AttributeError)
    try:
        while True:
            while id(f.f_code) in passed:  # (the walk of every call: kept short)
                f = f.f_back
            code = f.f_code
            if id(code) not in _user_codes:
                name = f.f_globals.get("__name__", "")
                if name.partition(".")[0] in _NOT_THE_USER:
                    passed[id(code)] = code
                    f = f.f_back
                    continue
                if len(_user_codes) < 4096:  # (code made at run time, over and over: not kept)
                    _user_codes[id(code)] = code
            return code.co_filename, f.f_lineno, f.f_globals, code.co_name
    except AttributeError:  # no frame of the user's on this stack
        return None


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` at the user's line (see the module's docstring), not at aiocoll's."""
    site = CALLER_SITE.get() or user_site(sys._getframe(1))
    if site is None:
        warnings.warn(message, category, stacklevel=2)
        return
    filename, line, module_globals, _ = site
    warnings.warn_explicit(
        message,
        category,
        filename,
        line,
        module=module_globals.get("__name__"),
        registry=module_globals.setdefault("__warningregistry__", {}),
    )


def internal_dirs() -> tuple[str, ...]:
    """The folders of aiocoll's own code (the package, its client and its server)."""
    here = os.path.dirname(os.path.abspath(__file__))  # aiocoll/
    dirs = {here + os.sep}
    for name in ("aiocoll.client", "aiocoll.server"):  # installed from folders of their own
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            dirs.add(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


_STDLIB = tuple(
    os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")} if p
)


def _trim_tb(tb: TracebackType | None, internal: tuple[str, ...]) -> TracebackType | None:
    """``tb`` without aiocoll's frames but the public function the user called.

    Also without the standard library's frames that aiocoll called (a concurrent future's
    ``result``); the user's frames below aiocoll's (a callback it ran) stay.
    """
    kept: list[TracebackType] = []
    inside = False  # below a frame of aiocoll's: the library's own frames are aiocoll's business
    while tb is not None:
        code = tb.tb_frame.f_code
        filename = os.path.abspath(code.co_filename)
        ours = filename.startswith(internal)
        if ours:
            if not inside and not code.co_name.startswith("_"):
                kept.append(tb)  # the public call the user made
            inside = True
        elif not (inside and (filename.startswith(_STDLIB) or code.co_filename.startswith("<"))):
            kept.append(tb)  # the user's frame (above aiocoll, or a callback it ran)
            inside = False
        tb = tb.tb_next
    for upper, lower in itertools.pairwise(kept):
        upper.tb_next = lower
    if kept:
        kept[-1].tb_next = None
    return kept[0] if kept else None


def trim(exc: _E) -> _E:
    """``exc``, its traceback and its causes' trimmed to the user's frames.

    See the module's docstring; unchanged with ``AIOCOLL_DEBUG=1``.
    """
    if env_text("AIOCOLL_DEBUG") not in (None, "0"):
        return exc
    internal = internal_dirs()
    seen: set[int] = set()
    err: BaseException | None = exc
    while err is not None and id(err) not in seen and len(seen) < 32:
        seen.add(id(err))
        err.__traceback__ = _trim_tb(err.__traceback__, internal)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    return exc


def _excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    if isinstance(value, PeerLostError) and _under_a_launcher() and env_text("AIOCOLL_DEBUG") in (None, "0"):
        # An expected failure: a peer lost or gone in a job whose launcher (aiocoll run, torchrun)
        # now restarts it, starts its next generation or ends it, and says which. The rank has
        # said what it lost and where its record is; the error's line is enough here.
        line = "".join(traceback.format_exception_only(kind, value)).rstrip()
        print(
            f"{line} (the launcher says what comes next; AIOCOLL_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return
    if isinstance(value, DistError):  # aiocoll's own errors: anything else may be a bug to see
        value.__traceback__ = tb
        tb = trim(value).__traceback__
    sys.__excepthook__(kind, value, tb)


def _under_a_launcher() -> bool:
    # Both launchers tell their workers how many restarts the job may use.
    return env_text("AIOCOLL_MAX_RESTARTS") is not None or env_text("TORCHELASTIC_MAX_RESTARTS") is not None


def _install_excepthook() -> None:
    if sys.excepthook is sys.__excepthook__:  # the program's own hook (IPython's, say) stays
        sys.excepthook = _excepthook


def chain(err: _E, cause: BaseException) -> _E:
    """``err`` with ``cause`` as its ``__cause__``, unless ``err``'s message already says it.

    When ``err``'s message already says what ``cause`` says, the traceback would print the same
    words twice, so nothing is chained (and the implicit context is hidden). Use it as
    ``raise chain(Outer(...), exc)``.
    """
    if _repeats(str(err), cause):
        err.__cause__ = None
        err.__suppress_context__ = True
    else:
        err.__cause__ = cause
    return err


def _repeats(message: str, cause: BaseException) -> bool:
    said = str(cause)
    if not said or said in message:
        return True
    if isinstance(cause, PeerLostError):
        return f"rank {cause.rank}" in message and (not cause.reason or cause.reason in message)
    return False


def _rebuild(cls: type[DistError], message: str, state: dict[str, Any]) -> DistError:
    # The allocator of the class's layout: OSError's for the timeouts (TimeoutError is one).
    base: Any = OSError if issubclass(cls, OSError) else BaseException
    err = base.__new__(cls, message)
    err.args = (message,)
    err.__dict__.update(state)
    return err


class DistError(RuntimeError):
    """Base of every aiocoll error."""

    __module__ = "aiocoll"

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the message and the attributes, without calling __init__: the subclasses'
        # constructors take fields, not the finished message.
        message = str(self.args[0]) if self.args else ""
        return (_rebuild, (type(self), message, dict(self.__dict__)))


class AuthenticationError(DistError):
    """The peer or coordinator did not prove it holds the shared token (or we did not)."""

    __module__ = "aiocoll"


class ProtocolError(DistError):
    """Bytes that break the wire grammar: bad magic, oversized header, undecodable frame.

    Attributes:
        remote: True when the other side broke the grammar, False when we were asked to send
            something the protocol cannot carry.
    """

    __module__ = "aiocoll"

    def __init__(self, message: str, *, remote: bool = True) -> None:
        super().__init__(message)
        self.remote = remote


class RendezvousError(DistError):
    """Rendezvous was refused or could not complete (duplicate rank, world-size disagreement)."""

    __module__ = "aiocoll"


class StoreError(DistError):
    """A store operation was refused (wrong-typed key or value, value too large, ...)."""

    __module__ = "aiocoll"


class StoreTimeout(StoreError, TimeoutError):
    """A store wait ran out before the keys existed.

    Attributes:
        keys: the keys that were still missing.
    """

    __module__ = "aiocoll"

    def __init__(self, keys: Iterable[str], timeout: float | None, message: str | None = None) -> None:
        self.keys = list(keys)
        self.timeout = timeout
        if message is None:
            message = (
                f"timed out after {timeout:.3g}s waiting for store key(s) {self.keys!r}"
                if timeout is not None
                else f"timed out waiting for store key(s) {self.keys!r}"
            )
        super().__init__(message)


class CollectiveTimeout(DistError, TimeoutError):
    """An operation's deadline passed.

    Attributes:
        op: operation name, group: group name, seq: the group's sequence number of the call,
        missing_ranks: the (global) ranks that did not answer in time.
    """

    __module__ = "aiocoll"

    def __init__(
        self,
        op: str,
        group: str,
        seq: int,
        missing_ranks: Sequence[int],
        timeout: float | None,
        message: str | None = None,
    ) -> None:
        self.op = op
        self.group = group
        self.seq = seq
        self.missing_ranks = sorted(set(missing_ranks))
        self.timeout = timeout
        if message is None:
            # "Timed out" as torch's backends word it: torch's tests and users' retry code match it.
            waited = f" after {timeout:.3g}s" if timeout is not None else ""
            message = (
                f"{op} (group {group!r}, seq {seq}): Timed out{waited} waiting for rank(s) "
                f"{self.missing_ranks}. Check that every rank calls the same operations in the "
                f"same order, or raise the timeout."
            )
        super().__init__(message)


class PeerLostError(DistError):
    """A peer's process or link is gone.

    Attributes:
        rank: the (global) rank that was lost; reason: what we observed.
        left: True when the peer went in order (it destroyed the group or its process group),
            False when it was lost (killed, crashed, silent past the heartbeat timeout, a link
            broken).
    """

    __module__ = "aiocoll"

    def __init__(
        self, rank: int, reason: str = "", message: str | None = None, *, left: bool = False
    ) -> None:
        self.rank = rank
        self.left = left
        # A reason that is itself a PeerLostError's message ("lost rank 1: closed the connection")
        # loses its repeated prefix: the message says "lost rank 1" once.
        self.reason = reason = str(reason).removeprefix(f"lost rank {rank}: ")
        if message is None:
            message = peer_gone(rank, reason, left)
        super().__init__(message)


def peer_gone(rank: int, reason: str, left: bool) -> str:
    """How a message says that ``rank`` is gone.

    "rank 1 left (...)" for a peer that went in order, "lost rank 1: ..." for one that was lost.
    """
    if left:
        return (
            reason
            if reason.startswith(f"rank {rank} left")
            else f"rank {rank} left" + (f" ({reason})" if reason else "")
        )
    return f"lost rank {rank}" + (f": {reason}" if reason else "")


class MismatchError(DistError):
    """Ranks called different operations, roots, dtypes or sizes at the same sequence number.

    Attributes:
        group, seq: where; ranks: the ranks whose calls disagreed; details: both signatures.
    """

    __module__ = "aiocoll"

    def __init__(self, message: str, *, group: str = "", seq: int = -1, ranks: Sequence[int] = ()) -> None:
        self.group = group
        self.seq = seq
        self.ranks = list(ranks)
        super().__init__(message)


_install_excepthook()
