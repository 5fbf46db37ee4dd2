"""One piece compiled by Inductor for one token shape: its inputs described in terms of the
token count, made fake for the shape, and handed to standalone_compile (whose artifact the
compile cache can save and load). Runs in the engine's process or in a compile worker."""

from __future__ import annotations

from collections.abc import Callable
import sympy
import torch
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from kiln.compile.piece_input import PieceInput, token_expr, token_symbol
from kiln.compile.shapes import TokenShape, size_hint


def specialise(inputs: list[PieceInput], shape: TokenShape) -> tuple[FakeTensorMode, list]:
    """Fake inputs for compiling a piece for `shape`: T becomes the size, or a fresh symbol
    bounded to the range, in a shape env of the piece's own."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    hint = size_hint(shape)
    if shape.is_size:
        new = sympy.Integer(shape.lo)
    else:
        new = env.create_symbol(hint, ConstantSource("num_tokens"), dynamic_dim=DimDynamic.DYNAMIC)
        env.constrain_symbol_range(new, shape.lo, shape.hi)

    def value(size):
        expr = token_expr(size).xreplace({token_symbol(): new})
        if expr.is_number:
            return int(expr)
        return env.create_symintnode(expr, hint=int(expr.xreplace({new: hint})))

    fakes = []
    with mode:
        for x in inputs:
            if x.kind == "tensor":
                fakes.append(torch.empty_strided([value(d) for d in x.sizes], [value(d) for d in x.strides],
                                                 dtype=x.dtype, device=x.device))
            elif x.kind == "symint":
                fakes.append(value(x.sizes[0]))
            else:
                fakes.append(x.value)
    return mode, fakes


def compile_piece(gm: fx.GraphModule, mode: FakeTensorMode, inputs: list) -> Callable:
    # standalone_compile: its artifact can be saved to the compile cache and loaded back.
    restore_example_values(gm, mode, inputs)
    with torch._guards.tracing(torch._guards.TracingContext(mode)):
        return torch._inductor.standalone_compile(gm, inputs, dynamic_shapes="from_tracing_context")


def restore_example_values(gm: fx.GraphModule, mode: FakeTensorMode, inputs: list) -> None:
    """AOTAutograd saves an artifact only for graphs whose nodes carry Dynamo's example
    values; a piece read back from the compile cache lost them in pickling. Fake propagation
    puts them back (without them the rebuilt artifact could not be saved)."""
    if all("example_value" in n.meta for n in gm.graph.nodes if n.op != "output"):
        return

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            node.meta["example_value"] = value
            return value

    with mode:
        Recorder(gm).run(*inputs)
