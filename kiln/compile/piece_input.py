"""What a piece is compiled for: each input's kind, dtype, device, and sizes and strides in terms
of the token count T. Pickled with the split program, so a warm start reads it back without
importing Dynamo (this module imports only torch and sympy)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

TOKENS = sympy.Symbol("T", integer=True, positive=True)  # the token count in a PieceInput


@dataclass(frozen=True)
class PieceInput:
    """One input of a piece, with sizes in terms of the token count T: what the piece is
    compiled for. It pickles, so a cache entry can compile a piece again without Dynamo."""

    kind: str  # "tensor", "symint" (the token count itself, or an expression of it) or "value"
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    sizes: tuple[sympy.Expr, ...] = ()  # for "symint": one expression
    strides: tuple[sympy.Expr, ...] = ()
    value: object = None  # for "value": a constant the graph passes along

    @classmethod
    def of(cls, x, tokens: frozenset[sympy.Symbol]) -> "PieceInput":
        def exprs(seq):
            return tuple(_expr(d).xreplace(dict.fromkeys(tokens, TOKENS)) for d in seq)

        if isinstance(x, torch.Tensor):
            return cls("tensor", x.dtype, x.device, exprs(x.shape), exprs(x.stride()))
        if isinstance(x, torch.SymInt):
            return cls("symint", sizes=exprs([x]))
        return cls("value", value=x)

    def __str__(self) -> str:
        if self.kind == "tensor":
            return f"tensor {self.dtype} {self.device} {list(self.sizes)} {list(self.strides)}"
        if self.kind == "symint":
            return f"symint {list(self.sizes)}"
        return f"{type(self.value).__name__} {self.value!r}"


def _expr(value) -> sympy.Expr:
    return value.node.expr if isinstance(value, torch.SymInt) else sympy.Integer(value)
