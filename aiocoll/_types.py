"""Shared value types: ReduceOp and the dtype vocabulary; imports nothing from aiocoll.

Kept apart from the tensor helpers so the coordinator (which never touches tensors) can import
it without numpy-heavy code paths.
"""

from __future__ import annotations

import contextlib
import enum

__all__ = ["BITWISE_OPS", "ReduceOp"]


class ReduceOp(enum.Enum):
    """How values from every rank combine. AVG and the bitwise ops only where meaningful."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @classmethod
    def coerce(cls, op: object) -> ReduceOp:
        """Accept a ReduceOp, its name or value (any case), or a torch.distributed ReduceOp.

        Raises:
            ValueError: when ``op`` names no reduce operation.
        """
        if isinstance(op, ReduceOp):
            return op
        try:
            known = _COERCED.get((type(op), op))  # (by type too: torch's SUM equals 0)
        except TypeError:  # unhashable: parsed below each time
            known = None
        if known is not None:
            return known
        name = getattr(op, "name", None)  # torch's RedOpType members expose .name
        if name is None:  # torch's ReduceOp instances wrap a RedOpType in .op
            name = getattr(getattr(op, "op", None), "name", None)
        text = name if isinstance(name, str) else str(op)
        text = text.rsplit(".", 1)[-1].strip()
        for member in cls:
            if text.upper() == member.name or text.lower() == member.value:
                if len(_COERCED) < 64:
                    with contextlib.suppress(TypeError):
                        _COERCED[type(op), op] = member
                return member
        if text.upper() == "PREMUL_SUM":
            raise ValueError("ReduceOp.PREMUL_SUM is not supported by aiocoll; scale the tensor and use SUM")
        raise ValueError(f"unknown reduce op {op!r}; expected one of {[m.name for m in cls]}")

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


# What coerce found for the spellings met so far (torch's RedOpType members and ReduceOp
# instances, which hash and compare as their RedOpType, and names): a torch
# training loop passes the same one at every call, and parsing it costs a few microseconds.
_COERCED: dict[tuple[type, object], ReduceOp] = {}

BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
