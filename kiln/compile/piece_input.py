"""What a piece is compiled for: each input's kind, dtype, device, and sizes and strides as ints
or as expressions of the token count T. Pickled with the split program; its sizes are plain
text, so a warm start reads them back without importing sympy (~0.25 s) or Dynamo, and only a
compile parses them (token_expr)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

TOKENS = "T"  # the token count, as a size names it


@dataclass(frozen=True)
class PieceInput:
    """One input of a piece, with sizes in terms of the token count T: what the piece is
    compiled for. It pickles, so a cache entry can compile a piece again without Dynamo."""

    kind: str  # "tensor", "symint" (the token count itself, or an expression of it) or "value"
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    # Each an int, or an expression of T as sympy prints it ("T", "2*T"); a "symint" has one size.
    sizes: tuple[int | str, ...] = ()
    strides: tuple[int | str, ...] = ()
    value: object = None  # for "value": a constant the graph passes along

    @classmethod
    def of(cls, x, tokens: frozenset) -> "PieceInput":
        """From a traced input (a fake tensor, a SymInt, a constant); `tokens`: the trace's symbols for T."""
        def texts(seq):
            return tuple(_text(d, tokens) for d in seq)

        if isinstance(x, torch.Tensor):
            return cls("tensor", x.dtype, x.device, texts(x.shape), texts(x.stride()))
        if isinstance(x, torch.SymInt):
            return cls("symint", sizes=texts([x]))
        return cls("value", value=x)

    def __str__(self) -> str:
        if self.kind == "tensor":
            return f"tensor {self.dtype} {self.device} {list(self.sizes)} {list(self.strides)}"
        if self.kind == "symint":
            return f"symint {list(self.sizes)}"
        return f"{type(self.value).__name__} {self.value!r}"


def evaluate(size: int | str, count: int) -> int:
    """A size at `count` tokens."""
    if isinstance(size, int):
        return size
    if size == TOKENS:
        return count
    return int(token_expr(size).subs(token_symbol(), count))


def token_expr(size: int | str):
    """A size as a sympy expression of token_symbol()."""
    import sympy

    return sympy.Integer(size) if isinstance(size, int) else sympy.sympify(size, locals={TOKENS: token_symbol()})


@cache
def token_symbol():
    import sympy

    return sympy.Symbol(TOKENS, integer=True, positive=True)


def _text(value, tokens: frozenset) -> int | str:
    if not isinstance(value, torch.SymInt):
        return int(value)
    expr = value.node.expr.xreplace(dict.fromkeys(tokens, token_symbol()))
    return int(expr) if expr.is_number else str(expr)
