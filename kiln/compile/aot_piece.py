"""One piece compiled ahead of time by AOTInductor into a package (a shared library holding the
piece's kernels and the code that launches them), and run back through torch's C++ loader.

Loading an Inductor artifact imports Dynamo and most of Inductor first (~2 s of the GIL in an
-O2 start on an H200 host, benchmarks/results/fresh_start_gil_h200/; an imported SmolLM2 -O2
start on the dev VM was ready in 2.32 s with them, 0.73 s from packages, fresh_start_cpu.json);
a package loads in milliseconds with neither. `kiln prewarm --aot` packages every piece and shape
of an entry beside its Inductor artifacts; a warm start uses the packages where it finds them.

A package is built from the piece's graph as Dynamo traced it, re-traced by torch.export with
the token count as its one dynamic dim, under the same Inductor settings and graph passes as
the piece's Inductor compile. Its inputs are the piece's tensors only: the token count is read
off them, and constants are baked in. What a package cannot express is refused at build time
(the piece keeps its Inductor artifact): a non-tensor output, a mutated input, a size that is
not the token count or a constant.
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import fx

from kiln.compile.piece_input import TOKENS, PieceInput, evaluate
from kiln.compile.shapes import TokenShape, size_hint


def refused_on(device_type: str) -> str | None:
    """Why packages are not made for pieces on `device_type`, None where they are."""
    if device_type == "cuda":
        # torch 2.11.0+cu130 (the GPU image; H100 and H200, 2026-12-07): constructing a loader for any
        # CUDA package crashes the process (SIGSEGV), torch's own aoti_load_package of a package
        # without custom ops included (benchmarks/results/aot_cuda_probe_h200/), and so does the runner
        # beneath it given the model's .so (benchmarks/results/aoti_runner_probe_h100/). No newer torch has
        # run kiln on a GPU, so CUDA is refused on every version until one loads a package there.
        return ("AOT packages are not made for CUDA: torch 2.11's package loader crashes the process "
                "(segmentation fault) loading any CUDA package, and no newer torch has been tried on a GPU; "
                "prewarm without --aot")
    return None


class NotPackable(Exception):
    """A piece AOTInductor cannot take as it is (the piece keeps its Inductor artifact)."""


class PackageMismatch(Exception):
    """A package whose outputs differ from its piece's Inductor artifact (it is not kept)."""


class PackagedPiece:
    """Runs one piece's package: called with the piece's arguments, it passes the tensors on."""

    def __init__(self, path: Path, inputs: list[PieceInput], single_output: bool):
        self.tensors = [i for i, x in enumerate(inputs) if x.kind == "tensor"]
        self.single_output = single_output
        device = next((x.device for x in inputs if x.kind == "tensor" and x.device.type != "cpu"), None)
        index = -1 if device is None else device.index if device.index is not None else torch.cuda.current_device()
        # Single-threaded: the default runner records a CUDA event after each run and queries it
        # before the next, which a CUDA-graph capture forbids (the engine calls pieces from one thread).
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, index)
        _loaded.add(self)

    def __call__(self, *args):
        out = self.loader.run([args[i] for i in self.tensors])
        return out[0] if self.single_output else out


# The loader unpacks its package into a temporary folder that only its destructor removes; a
# loader still held at exit (an engine never shut down) would leave one behind on every start.
_loaded: weakref.WeakSet[PackagedPiece] = weakref.WeakSet()


@atexit.register
def _release_loaders() -> None:
    for piece in list(_loaded):
        piece.loader = None


def single_output(gm: fx.GraphModule) -> bool:
    """Whether the piece returns one value rather than a tuple of them."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return not isinstance(output.args[0], (tuple, list))


def build_package(gm: fx.GraphModule, inputs: list[PieceInput], shape: TokenShape, settings: dict,
                  path: Path) -> None:
    """Package `gm` for the token counts of `shape` at `path`, under Inductor `settings` (the
    caller enters its graph-pass context around it). Raises NotPackable for what a package
    cannot express."""
    import torch._inductor

    example, dynamic = _example_inputs(inputs, shape)
    module = _TensorsOnly(gm, inputs)
    try:
        with torch.inference_mode(False), torch.no_grad():  # export refuses inference tensors
            program = torch.export.export(module, tuple(example), dynamic_shapes=(tuple(dynamic),), strict=False)
    except NotPackable:
        raise
    except Exception as e:
        raise NotPackable(f"torch.export could not trace it ({type(e).__name__}: {str(e).splitlines()[0]})") from e
    signature = program.graph_signature
    if signature.user_inputs_to_mutate:
        raise NotPackable(f"it writes into its inputs {sorted(signature.user_inputs_to_mutate.values())}")
    outputs = [n for n in program.graph.output_node().args[0]]
    if any(not isinstance(o, fx.Node) or not isinstance(o.meta.get("val"), torch.Tensor) for o in outputs):
        raise NotPackable("it returns a value that is not a tensor")
    with torch.inference_mode(False), torch.no_grad():
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(settings))


class _TensorsOnly(torch.nn.Module):
    """The piece called with its tensors alone: its token-count argument is read off a tensor's
    token dim, and its constant arguments are bound."""

    def __init__(self, gm: fx.GraphModule, inputs: list[PieceInput]):
        super().__init__()
        self.gm, self.inputs = gm, inputs
        self.tensors = [i for i, x in enumerate(inputs) if x.kind == "tensor"]
        self.token_at = next(((k, d) for k, i in enumerate(self.tensors)
                              for d, size in enumerate(inputs[i].sizes) if size == TOKENS), None)
        for x in inputs:
            if x.kind == "symint" and (x.sizes[0] != TOKENS or self.token_at is None):
                raise NotPackable(f"its integer input {x.sizes[0]} is not the token count of a tensor input")

    def forward(self, *tensors):
        args = [x.value if x.kind == "value" else None for x in self.inputs]
        for i, t in zip(self.tensors, tensors):
            args[i] = t
        for i, x in enumerate(self.inputs):
            if x.kind == "symint":
                k, d = self.token_at
                args[i] = tensors[k].shape[d]
        return self.gm(*args)


def _example_inputs(inputs: list[PieceInput], shape: TokenShape) -> tuple[list, list]:
    """Tensors of the traced sizes and strides at the shape's size hint (zeros: valid indices),
    and export's dynamic-shape spec: the token dims, bounded to the shape's range."""
    hint = size_hint(shape)
    tokens = None if shape.is_size else torch.export.Dim("tokens", min=shape.lo, max=shape.hi)
    example, dynamic = [], []
    for x in inputs:
        if x.kind != "tensor":
            continue
        sizes, dims = [], {}
        for d, size in enumerate(x.sizes):
            if size == TOKENS:
                sizes.append(hint)
                if tokens is not None:
                    dims[d] = tokens
            elif isinstance(size, int):
                sizes.append(size)
            else:
                raise NotPackable(f"an input's size {size} is neither the token count nor a constant")
        strides = [evaluate(s, hint) for s in x.strides]
        example.append(torch.empty_strided(sizes, strides, dtype=x.dtype, device=x.device).zero_())
        dynamic.append(dims or None)
    return example, dynamic


def load_package(path: Path, inputs: list[PieceInput], gm: fx.GraphModule) -> Callable:
    return PackagedPiece(path, inputs, single_output(gm))


def check_package(packaged: Callable, artifact: Callable, gm: fx.GraphModule, inputs: list[PieceInput],
                  shape: TokenShape) -> None:
    """Run the package and the Inductor artifact on the same random inputs, at the shape's
    smallest and largest token counts: every output must be bitwise equal (both run Inductor's
    code for the same graph; a package that rounds differently would make a warm start's tokens
    differ from a cold one's). Outputs the piece leaves uninitialised (torch.empty_like: a buffer
    an opaque op fills later) are not compared. Raises PackageMismatch."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else [output.args[0]]
    blank = [isinstance(v, fx.Node) and v.op == "call_function" and
             getattr(v.target, "__name__", "") in ("empty_like", "empty", "new_empty", "empty_strided")
             for v in values]
    generator = torch.Generator().manual_seed(0)
    for count in dict.fromkeys([shape.lo, shape.hi]):
        args = [_random(x, count, generator) for x in inputs]
        want, got = artifact(*args), packaged(*args)
        want = want if isinstance(want, (tuple, list)) else [want]
        got = got if isinstance(got, (tuple, list)) else [got]
        if len(want) != len(got):
            raise PackageMismatch(f"{len(got)} outputs where the Inductor artifact gives {len(want)}")
        for k, (w, g) in enumerate(zip(want, got)):
            if k < len(blank) and blank[k]:
                continue
            if w.shape != g.shape or w.dtype != g.dtype or not torch.equal(w, g):
                diff = (w.float() - g.float()).abs().max().item() if w.shape == g.shape else "shape"
                raise PackageMismatch(f"output {k} at {count} tokens differs from the Inductor artifact's "
                                      f"(max abs diff {diff})")


def _random(x: PieceInput, count: int, generator: torch.Generator):
    if x.kind == "symint":
        return evaluate(x.sizes[0], count)
    if x.kind == "value":
        return x.value
    sizes = [evaluate(d, count) for d in x.sizes]
    strides = [evaluate(d, count) for d in x.strides]
    span = 1 + sum((n - 1) * st for n, st in zip(sizes, strides)) if all(sizes) else 0
    if x.dtype.is_floating_point:
        flat = (torch.randn(span, generator=generator) * 0.5).to(x.dtype)
    else:  # indices (token ids, positions, slots): zero is valid everywhere
        flat = torch.zeros(span, dtype=x.dtype)
    return flat.to(x.device).as_strided(sizes, strides)
