"""Split points: ops the FX graph is cut at, so they run eagerly between compiled pieces.

An op becomes a split point in one of two ways, merged into one effective list:
- at its definition, with `@split_op(reason=...)` on the `torch.library` op, so the list
  can be audited next to the code that needs it;
- by name in the compilation config's `splitting_ops`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

_DECLARED: dict[str, str] = {}  # "ns::op" -> "file:line (reason)"


@dataclass(frozen=True)
class SplitOp:
    name: str  # "ns::op"
    source: str  # "decorator at file:line: reason" or "config"


def op_name(op) -> str:
    """'ns::op' for a torch.library custom op, an OpOverloadPacket, an OpOverload or a string."""
    if isinstance(op, str):
        return op.replace(".", "::", 1) if "::" not in op else op
    name = getattr(op, "_qualname", None) or getattr(op, "_qualified_op_name", None)
    if name is None:
        schema = getattr(op, "_schema", None)
        name = schema.name if schema is not None else str(op)
    return name


def split_op(*, reason: str):
    """Declare the decorated `torch.library` op a split point, with the reason why."""

    def register(op):
        frame = inspect.stack()[1]
        _DECLARED[op_name(op)] = f"decorator at {frame.filename}:{frame.lineno}: {reason}"
        return op

    return register


def effective_split_ops(configured: list[str] | tuple[str, ...] = ()) -> list[SplitOp]:
    ops = [SplitOp(name, where) for name, where in _DECLARED.items()]
    seen = {op.name for op in ops}
    ops += [SplitOp(op_name(n), "config") for n in configured if op_name(n) not in seen]
    return ops
