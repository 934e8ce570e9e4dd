"""Shared value types: ReduceOp and the dtype vocabulary; imports nothing from aiocoll.

Kept apart from the tensor helpers so the coordinator (which never touches tensors) can import
it without numpy-heavy code paths.
"""

from __future__ import annotations

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
        name = getattr(op, "name", None)  # torch's ReduceOp / RedOpType expose .name
        text = name if isinstance(name, str) else str(op)
        text = text.rsplit(".", 1)[-1].strip()
        for member in cls:
            if text.upper() == member.name or text.lower() == member.value:
                return member
        if text.upper() == "PREMUL_SUM":
            raise ValueError("ReduceOp.PREMUL_SUM is not supported by aiocoll; scale the tensor and use SUM")
        raise ValueError(f"unknown reduce op {op!r}; expected one of {[m.name for m in cls]}")

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"


BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
