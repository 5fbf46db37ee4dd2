"""From a model's forward to one FX graph with one dynamic token dim, captured once.

The model opts in with `@compile_dynamic(dynamic_arg_dims={...})`. On the first call the
marked dims become dynamic and Dynamo traces the whole forward (fullgraph: a graph break
is an error). Dynamo's guards are dropped: they would re-check, on every call, facts kiln
already promises (same module, same dtypes), and cost host time on every decode step.
So later calls run the bytecode Dynamo produced directly, without frame evaluation (the
piecewise mode goes further and calls the split graph itself: see dispatch).

The price of dropping guards is that Dynamo can no longer notice when a call breaks an
assumption it traced under. The one assumption that varies in serving is the token
count, so every shape guard is checked here, at capture, against the whole range of
token counts: a forward that branches on the token count fails loudly, naming the line.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import re
import time
import types
from collections.abc import Callable

import sympy
import torch
import torch._dynamo
from torch._dynamo.convert_frame import register_bytecode_hook
from torch.utils._sympy.symbol import SymT, symbol_is_type
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

from kiln.compile.layer_stamping import StampError, inline_stamped, stamping
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.opt_in import is_repeated_layer


class CaptureError(RuntimeError):
    """The forward cannot be captured as one graph valid for every token count."""


def mark_token_dims(arguments: dict, dims: dict[str, int], how: str, max_tokens: int) -> int:
    """Mark the token dim of each listed tensor argument dynamic; return the token count."""
    from torch._dynamo.decorators import mark_unbacked

    count = None
    for name, dim in dims.items():
        value = arguments.get(name)
        if not isinstance(value, torch.Tensor):
            continue
        count = value.shape[dim]
        if how == "unbacked":
            # shape_id gives every marked dim one unbacked symbol, as backed dims get by
            # Dynamo proving them equal.
            accepts = inspect.signature(mark_unbacked).parameters
            if "shape_id" not in accepts:
                raise CaptureError("dynamic_shapes_mark='unbacked' needs a torch whose mark_unbacked "
                                   "takes shape_id; use 'backed'")
            bounds = {"min": 1, "max": max_tokens} if "max" in accepts else {}  # torch >= 2.12
            mark_unbacked(value, dim, shape_id="num_tokens", **bounds)
        elif max_tokens > 1:
            # At least 3: with max 2 a backed size (never 0 or 1) has the one value 2, and Dynamo
            # then left input_ids and positions two separate symbols.
            torch._dynamo.mark_dynamic(value, dim, min=1, max=max(max_tokens, 3))
    if count is None:
        raise CaptureError(f"none of the dynamic arguments {', '.join(dims)} was a tensor in this call")
    return count


def token_symbols(fake_inputs: list, shape_env) -> frozenset[sympy.Symbol]:
    """The symbols of the token dim in the graph inputs (aliases of one symbol)."""
    found: set[sympy.Symbol] = set()
    for x in fake_inputs:
        sizes = [x] if isinstance(x, torch.SymInt) else list(x.shape) if isinstance(x, torch.Tensor) else []
        for size in sizes:
            if isinstance(size, torch.SymInt):
                found |= size.node.expr.free_symbols
    canonical = {shape_env.replace(s) for s in found} if shape_env is not None else found
    if len(canonical) > 1:
        raise CaptureError(f"the dynamic dims got {len(canonical)} independent symbols ({canonical}); "
                           f"kiln compiles every marked dim as one token dim, so the forward must "
                           f"combine them (e.g. positions with input_ids)")
    return frozenset(found | canonical)


def check_token_guards(shape_env, lo: int, hi: int, owner: str) -> None:
    """Fail if any shape guard does not hold for every token count in [lo, hi]."""
    tokens = sympy.Symbol("num_tokens", integer=True, positive=True)
    for guard in shape_env.guards:
        # Only the marked dims are dynamic (automatic dynamic is off), so every backed size
        # symbol is the token count; it may go by several names until proven equal.
        sizes = {s for s in guard.expr.free_symbols if symbol_is_type(s, SymT.SIZE)}
        if not sizes or sizes != guard.expr.free_symbols:
            continue
        expr = guard.expr.xreplace(dict.fromkeys(sizes, tokens))
        counterexample = _counterexample(expr, tokens, lo, hi)
        if counterexample is not None:
            raise CaptureError(
                f"{owner} depends on the number of tokens: at {_user_line(guard.sloc)}\n"
                f"the trace assumes `{guard.expr}`, "
                f"which is false for {counterexample} tokens. kiln compiles one graph for every token "
                f"count in [{lo}, {hi}] and drops Dynamo's guards, so this would silently reuse a graph "
                f"traced for another length. Make that line shape-independent: no Python branch on a "
                f"size, no size baked into view/reshape (use -1), no per-length constants.")


def _user_line(sloc) -> str:
    """'file:line in fn: `code`' from a shape guard's source location."""
    text = sloc.maybe_user_loc or str(sloc)
    code, sep, where = text.rpartition("  # ")
    return f"{where}: `{code.strip()}`" if sep else text


def _counterexample(expr, tokens: sympy.Symbol, lo: int, hi: int) -> int | None:
    if expr == sympy.true:
        return None
    bound = bound_sympy(expr, {tokens: ValueRanges(lo, hi)})
    if bound.is_singleton() and bound.lower == sympy.true:
        return None
    for n in sorted({lo, lo + 1, (lo + hi) // 2, hi - 1, hi}):
        if lo <= n <= hi and not bool(expr.xreplace({tokens: n})):
            return n
    logger.warning("could not prove the shape guard %s for all token counts in [%d, %d]", expr, lo, hi)
    return None


def checked_backend(backend: Callable, monitor: CompileMonitor, max_tokens: int, owner: str,
                    model: torch.nn.Module | None = None) -> Callable:
    """Wrap a Dynamo backend: count the graph, check the token guards, inline the stamped
    layers of `model` (kiln.compile.layer_stamping), then compile."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list):
        with monitor.backend_call():
            shape_env = torch._guards.TracingContext.get().fake_mode.shape_env
            if shape_env is not None and max_tokens > 1:
                # Backed sizes 0 and 1 are specialised by Dynamo; the range starts at 2.
                check_token_guards(shape_env, 2, max_tokens, owner)
            if model is not None:
                try:
                    stamped = inline_stamped(gm, example_inputs, model)
                except StampError as e:
                    raise CaptureError(f"{owner}: {e}") from None
                if stamped:
                    monitor.counters.stamped_layers = stamped
                    layers = sum(map(is_repeated_layer, model.modules()))
                    logger.info("Dynamo traced %d of %d repeated layers and stamped the other %d",
                                layers - stamped, layers, stamped)
            return backend(gm, example_inputs)

    compile_graph.__name__ = getattr(backend, "__name__", "kiln_backend")
    return compile_graph


def keep_shape_guards(entries) -> list[bool]:
    return [entry.guard_type == "SHAPE_ENV" for entry in entries]


class Capture:
    """Dynamo runs once, on the first call; later calls run the code it produced directly.

    guards: "none" (serving), "shape" (debug: shape-env guards checked on every call, a
    recompile is an error) or "all" (stock torch.compile).
    """

    def __init__(self, model: torch.nn.Module, dims: dict[str, int], backend, *, guards: str,
                 mark: str, max_tokens: int, monitor: CompileMonitor, stamp: str | None = None):
        self.model, self.dims, self.guards, self.stamp = model, dims, guards, stamp
        self.mark, self.max_tokens, self.monitor = mark, max_tokens, monitor
        self.owner = f"{type(model).__name__}.forward"
        forward = type(model).forward
        # A private copy of the code object: Dynamo caches compiled code per code object,
        # and with guards dropped another model of the same class would reuse this graph.
        self.code = forward.__code__.replace()
        self.forward = types.FunctionType(self.code, forward.__globals__, forward.__name__,
                                          forward.__defaults__, forward.__closure__)
        self.forward.__kwdefaults__ = forward.__kwdefaults__
        self.signature = inspect.signature(forward)
        options = {}
        if guards != "all":
            options["guard_filter_fn"] = keep_shape_guards if guards == "shape" else \
                torch.compiler.skip_all_guards_unsafe
        backends = getattr(torch._dynamo.eval_frame, "cached_backends", {})
        registered = set(backends)
        self.compiled = torch.compile(types.MethodType(self.forward, model), fullgraph=True,
                                      backend=backend, options=options or None)
        # Dynamo keeps every backend in a process-wide table, only so that torch._dynamo.reset() can
        # reset it; ours holds the model, so an engine shut down kept its weights (after five -O2
        # engines in one process, a sixth ran out of the H200's memory). Ours has nothing to reset.
        for backend_id in set(backends) - registered:
            backends.pop(backend_id, None)
        self.transformed: types.CodeType | None = None
        self.code_ready: float | None = None
        self.direct: Callable | None = None
        self.captured = False

    def __call__(self, *args, **kwargs):
        if self.direct is not None:
            return self.direct(self.model, *args, **kwargs)
        if not self.captured:
            return self.capture(*args, **kwargs)
        if self.guards == "shape":
            try:
                with torch._dynamo.config.patch(error_on_recompile=True):
                    return self.compiled(*args, **kwargs)
            except torch._dynamo.exc.RecompileError as e:
                raise CaptureError(f"{self.owner} would recompile (debug_guards): a shape guard "
                                   f"failed for this call.\n{e}") from None
        return self.compiled(*args, **kwargs)

    def capture(self, *args, **kwargs):
        arguments = self.signature.bind(self.model, *args, **kwargs).arguments
        count = mark_token_dims(arguments, self.dims, self.mark, self.max_tokens)
        if count < 2 and self.mark == "backed" and self.max_tokens > 1:
            # Dynamo specialises a backed size of 1; capture waits for a longer call.
            logger.info("%s: a %d-token call runs eagerly; capture waits for >= 2 tokens", self.owner, count)
            return self.model.forward(*args, **kwargs)
        hook = register_bytecode_hook(self._grab_code)
        self.code_ready = None
        start = time.perf_counter()
        # A trace makes many short-lived objects; each full collection would also walk the
        # whole heap the process had before (torch, the model): set that aside meanwhile. Where
        # it is frozen already (a built engine's, gc_pause.freeze_heap) it stays so after.
        set_aside = gc.get_freeze_count() == 0
        if set_aside:
            gc.freeze()
        try:
            # Only the marked dims may be dynamic: Dynamo's automatic dynamic would otherwise
            # turn values that differed in earlier compiles of the same code (another model's
            # attention scale) into symbols.
            with torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
                    stamping(self.model, self.stamp) if self.stamp else contextlib.nullcontext():
                out = self.compiled(*args, **kwargs)
        except Exception as e:
            explained = explain(e, self.owner)
            if explained is e:
                raise
            raise explained from e
        finally:
            if set_aside:
                gc.unfreeze()
            hook.remove()
        self.captured = True
        # Until Dynamo handed over the new bytecode: the first run of the graph is not compiling.
        self.monitor.capture_done((self.code_ready or time.perf_counter()) - start)
        if self.guards == "none":
            if self.transformed is None:
                raise CaptureError(f"Dynamo produced no code for {self.owner}; is it already compiled elsewhere?")
            # Own copy of the globals: the code calls Dynamo's compiled function by a global name.
            globals_ = dict(self.forward.__globals__)
            self.direct = types.FunctionType(self.transformed, globals_, self.forward.__name__,
                                             self.forward.__defaults__, self.forward.__closure__)
            self.direct.__kwdefaults__ = self.forward.__kwdefaults__
            # Calls go straight to the captured code from here on. Dynamo's cache entry on our code
            # copy lives where the garbage collector cannot see it and leads back to the model: drop it.
            reset_code = getattr(torch._C._dynamo.eval_frame, "reset_code", None)
            if reset_code is not None:
                reset_code(self.code)
        return out

    def _grab_code(self, old: types.CodeType, new: types.CodeType):
        if old is self.code:
            self.transformed, self.code_ready = new, time.perf_counter()


def explain(e: Exception, owner: str) -> Exception:
    """Turn Dynamo's error into one that says where and what to do; others pass through."""
    if isinstance(e, torch._dynamo.exc.BackendCompilerFailed) and isinstance(e.inner_exception, CaptureError):
        return e.inner_exception
    if isinstance(e, CaptureError):
        return e
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # An unbacked token count reaches a Python branch as a guard on a data-dependent value;
    # depending on the torch version Dynamo reports it as a user error or as a graph break.
    shape_dependent = re.search(r"data-dependent expression .*\bu\d+", str(e)) is not None
    if isinstance(e, torch._dynamo.exc.Unsupported) and not shape_dependent:
        return CaptureError(
            f"graph break in {owner} at {_location(e)}: {first}\nkiln captures the forward as one "
            f"graph (fullgraph=True). Make that line traceable (no data-dependent Python branch, "
            f"no .item()/.tolist(), no print or untraceable call), or move it into a custom op "
            f"declared a split point with @split_op.\nDynamo said:\n{e}")
    if shape_dependent or isinstance(e, (torch._dynamo.exc.UserError,
                                         torch.fx.experimental.symbolic_shapes.ConstraintViolationError)):
        return CaptureError(
            f"{owner} depends on the number of tokens at {_location(e)}: {first}\nkiln compiles one "
            f"graph for every token count; make that line shape-independent (no Python branch on "
            f"a size, no size baked into view/reshape).\nDynamo said:\n{e}")
    return e


def _location(e: Exception) -> str:
    stack = getattr(e, "real_stack", None)
    if stack:
        return f"{stack[-1].filename}:{stack[-1].lineno}"
    match = re.search(r'File "([^"]+)", line (\d+)', str(e)) or re.search(r"#\s*(\S+?):(\d+) in", str(e))
    return f"{match.group(1)}:{match.group(2)}" if match else "an unknown line (see Dynamo's message)"
