"""The layout of a group's region in every member's arena, and the shape of what an operation
of the arena waits for.

Imports only client.data._shm (the arena's sizes) and aiocoll._signature; the waiting
(client.data._shm_sched) and the operations (client.data._shm_coll) read and write a region
through these names and nothing else.

A group's region in each member's arena (cache lines apart, so writers do not share them):

    0     sleeping   1 while the owner sleeps on its eventfd (publishers then wake it)
    64    inp        last step whose input (and signature) the owner has written
    128   red        last step whose share the owner has reduced (in place, in its slot)
    192   done       last step whose data the owner has finished reading (its slots are free)
    256   cpu        1 + the CPU the owner ran on when it last began to wait (0: unknown)
    768   group      which group owns the region now (a hash of its id): a region is reused by
                     later groups, and counters are trusted only next to the right owner
    832   lost       1 + the rank whose loss failed the owner's group
    896   base       where the region sits in the owner's address space (the direct-read probe)
    904   direct     1: the owner can read every member's memory directly, 2: it cannot
    960   buf        per slot: address and size of the owner's buffer, for direct reads
    1024  sig[2]     per slot: the operation's seq and signature (kind, root, dtype, count, op)
    4096  data       two slots of ``2 * chunk`` bytes (step t uses slot t % 2)

Every operation is a sequence of steps, numbered alike on every member (the group runs its
operations in call order). A step: wait until every member finished reading the slot two steps
back (``done``), write my part into my slot, publish ``inp``; wait for everyone's ``inp``; read
the others' slots directly; publish ``done``. An operation is a generator that yields a
``Wait`` (counter, step, members) each time it needs every listed member's counter to reach
the step.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import aiocoll._signature as _signature

from ._shm import REGION_CONTROL

__all__ = [
    "BASE",
    "BUF",
    "CPU",
    "DATA",
    "DIRECT",
    "DONE",
    "INP",
    "LOST",
    "OWNER",
    "RED",
    "SIG",
    "SIG_BYTES",
    "SLEEP",
    "SLOTS",
    "OnWait",
    "OpGen",
    "Wait",
]

# counters, as indexes into the region's int64 view
SLEEP, INP, RED, DONE, CPU = 0, 8, 16, 24, 32
SIG = 1024  # bytes (the counters above and below are int64 indexes)
OWNER = 96  # (byte 768)
LOST = 104  # (byte 832) 1 + the rank whose loss failed this member's group, 0 while none
BASE = 112  # (byte 896) where this region sits in the owner's address space (the probe reads it)
DIRECT = 113  # (byte 904) 1: the owner can read every member's memory directly, 2: it cannot
BUF = 120  # (byte 960) per slot: address and size of the owner's buffer, for direct reads
SIG_BYTES = _signature.PACKED_BYTES
DATA = REGION_CONTROL
SLOTS = 2  # steps in flight: the region's data holds this many slots (signatures: one each)

Wait = tuple[int, int, tuple[int, ...]]  # (counter, step, members): wait until all reach it
OpGen = Generator[Wait, None, Any]
OnWait = Callable[[list[int]], None]  # told whom an operation waits for when it goes to sleep
