"""A model's forward behind the configured compile mode: eager, stock, once, or piecewise.

In piecewise mode (3) the first call either starts warm from the compile cache (the split
graph and every piece artifact loaded from disk: no Dynamo, no Inductor) or captures with
Dynamo and compiles, filling the cache. Either way later calls go straight to the split
graph through a DirectCall (see direct_call), not through Dynamo's bytecode.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.compile import layer_stamping, trace
from kiln.compile.cache import CompileCache, ModelCache
from kiln.compile.cache.key import compiler_factor, digest, env_factor, source_name
from kiln.compile.cache.store import no_room, warn_no_room
from kiln.compile.compile_workers import CompileWorkers, compiles_in_workers, worker_count
from kiln.compile.config import CompilationConfig
from kiln.compile.direct_call import DirectCall, call_spec
from kiln.compile.monitor import CompileMonitor, logger
from kiln.compile.opt_in import dynamic_arg_dims
from kiln.compile.split import SplitOp, check_split_ops, effective_split_ops

if TYPE_CHECKING:  # imported where used: an eager forward (mode 0) imports neither
    from kiln.compile.backend import PiecewiseBackend
    from kiln.compile.capture import Capture

_MODE_NAMES = {0: "eager", 1: "stock torch.compile", 2: "Dynamo once + backend", 3: "kiln piecewise"}


CAPTURE_TOKENS = 16  # the mode-3 warm-up's capture call (Dynamo specialises a count of 1)


class CompiledModel:
    """A model's forward behind the configured compile mode."""

    def __init__(self, model: nn.Module, config: CompilationConfig, max_num_batched_tokens: int,
                 cache: CompileCache | None = None):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.model, self.config, self.max_num_batched_tokens = model, config, max_num_batched_tokens
        self.monitor = CompileMonitor()
        self.preload_wait_s = self._join_preload(cache)
        self.started_warm = False  # the first call loaded the forward from the compile cache
        self.split_ops: list[SplitOp] = effective_split_ops(config.splitting_ops)
        check_split_ops(self.split_ops)
        self.dims = dynamic_arg_dims(model)
        self.mode = config.mode if self.dims is not None else 0
        if self.mode == 3 and max_num_batched_tokens < 2:
            raise ValueError("piecewise compilation (mode 3: -O1..-O3) needs max_num_batched_tokens >= 2: a graph "
                             "traced for 1 token has no token dim to compile ranges over; raise it, or use "
                             "-cc.mode=2 or -O0")
        if self.dims is None and config.mode != 0:
            logger.warning("%s is not decorated with @compile_dynamic: it runs eagerly", type(model).__name__)
        # debug_guards runs every call through Dynamo on purpose: nothing to start warm.
        self.cache = cache if self.mode == 3 and not config.debug_guards else None
        self.model_cache: ModelCache | None = None
        self.backend: PiecewiseBackend | None = None
        self.dispatch: DirectCall | None = None  # mode 3, once captured or loaded
        self.piece_wrapper: Callable[[Callable], Callable] | None = None  # see wrap_pieces
        self.signature = inspect.signature(type(model).forward)
        # Stamping is kiln's: stock torch.compile (mode 1) traces every layer.
        self.stamp = layer_stamping.resolve(config.stamp_mechanism) \
            if self.mode in (2, 3) and config.stamp_repeated_layers else None
        self._capture: Capture | None = None
        if self.mode == 3:
            from kiln.compile import backend

            self.backend = backend.PiecewiseBackend(config, {op.name for op in self.split_ops},
                                                    max_num_batched_tokens, self.monitor)
        if self.mode in (1, 2) or (self.mode == 3 and self.cache is None):
            self._capture = self._make_capture()  # no warm start to spare it: Dynamo now
        logger.info("model forward: %s", self.describe())

    def _join_preload(self, cache: CompileCache | None) -> float:
        """Wait for the engine's preload thread (kiln.compile.cache.preload), if it started one: here,
        before this constructor imports Dynamo and Inductor, as two threads importing the same
        circular modules can deadlock. The seconds waited join the warm start's time."""
        preload = cache.preload if cache is not None else None
        if preload is None:
            return 0.0
        waited = preload.wait()
        self.monitor.warm_phase_add("preload_wait", waited)
        for name, seconds in preload.parts.items():  # ran on the thread, off the critical path
            self.monitor.warm_phase_add(f"background.{name}", seconds)
        return waited

    @property
    def capture(self) -> Capture | None:
        """Dynamo's capture of the forward (None in mode 0). In mode 3 with the compile cache it is
        made on first use: a warm start that loads only AOT packages never imports Dynamo."""
        if self._capture is None and self.mode != 0:
            self._capture = self._make_capture()
        return self._capture

    def _make_capture(self) -> Capture:
        from kiln.compile.capture import Capture, checked_backend

        config, max_tokens = self.config, self.max_num_batched_tokens
        owner = f"{type(self.model).__name__}.forward"
        if self.mode == 3:
            compiler = self.backend
        else:
            compiler = torch._dynamo.lookup_backend("inductor" if self.mode == 1 else config.backend)
        # Mode 1 is the stock baseline: Dynamo checks all its guards on every call.
        guards = "all" if self.mode == 1 else "shape" if config.debug_guards else "none"
        compiler = trace.announcing(compiler, self._trace_config)
        return Capture(self.model, self.dims, checked_backend(compiler, self.monitor, max_tokens, owner,
                                                              self.model if self.stamp is not None else None),
                       guards=guards, mark=config.dynamic_shapes_mark, max_tokens=max_tokens,
                       monitor=self.monitor, stamp=self.stamp)

    def __call__(self, *args, **kwargs):
        if self.dispatch is not None:
            return self.dispatch(*args, **kwargs)
        if self.mode == 0:
            return self.model(*args, **kwargs)
        if self.backend is None or self.config.debug_guards or (self._capture is not None and self._capture.captured):
            return self.capture(*args, **kwargs)
        if self._warm_start():
            return self.dispatch(*args, **kwargs)
        with self._compile_workers():
            out = self.capture(*args, **kwargs)
        if self.capture.captured:
            self._captured(args, kwargs, out)
        return out

    def _warm_start(self) -> bool:
        """Load the split graph and its pieces from the compile cache, if an entry has them.
        Runs once; False sends the first call through Dynamo (which still loads pieces)."""
        if self.cache is None or self.model_cache is not None:
            return self.dispatch is not None
        from kiln.compile.backend import compile_ahead

        # The preload's wait (in __init__) counts as part of the warm start.
        start = time.perf_counter() - self.preload_wait_s
        phase = self.monitor.warm_phase
        with phase("key"):
            self.model_cache = self._model_cache()
        self.backend.cache = self.model_cache
        with phase("open"):
            entry = self.model_cache.warm_entry()
        if entry is None:
            logger.info("compile cache: no entry for %s yet under %s; capturing and compiling",
                        type(self.model).__name__, self.cache.root.path)
            return False
        with entry.lock():
            with phase("program"):
                program = entry.load_program()
            if program is None or program.call is None:
                logger.info("compile cache: entry %s has no replayable graph; capturing with Dynamo", entry.key)
                return False
            entry.warm = True
            with phase("split"):
                self._trace_config()
                trace.split_graph(program)
                self.backend.start(program, entry)
            pieces, plan = self.backend.pieces, self.backend.plan
            with phase("pieces"):
                for shape in plan.all_shapes():
                    if entry.has_shape(shape):
                        pieces.compile(shape)  # loads it
            with phase("ahead"):
                compile_ahead(pieces, plan, self.config.strategy, first=None)
        with phase("dispatch"):
            self._direct_call()
        for name, seconds in entry.timings.items():  # the finer parts the entry measured
            self.monitor.warm_phase_add(name, seconds)
        self.monitor.warm_start_done(entry.key, time.perf_counter() - start)
        self.started_warm = True
        if self.cache.workers is not None:  # started for a cold start that another process made warm
            self.cache.workers.close()
            self.cache.workers = None
        return True

    @contextlib.contextmanager
    def _compile_workers(self):
        """Worker processes that compile the pieces of a cold capture side by side: the ones the
        engine started before the weights loaded, else started here, before Dynamo traces, so
        that their start-up overlaps the trace. None on small machines, without the compile
        cache (they hand artifacts over through it) or with graph passes."""
        backend = self.backend
        early = None
        if self.cache is not None:
            early, self.cache.workers = self.cache.workers, None
        if self.cache is None or not compiles_in_workers(self.config):
            if early is not None:
                early.close()
            yield
            return
        try:
            backend.workers = early or CompileWorkers(worker_count(self.config))
        except Exception as e:  # e.g. inside a daemonic process, which may not have children
            logger.warning("compile workers did not start (%s: %s); compiling in-process", type(e).__name__, e)
            yield
            return
        try:
            yield
        finally:
            backend.workers.close()
            backend.workers = None
            if backend.pieces is not None:
                backend.pieces.workers = None

    def _captured(self, args: tuple, kwargs: dict, out) -> None:
        """After Dynamo's capture: make the direct call, and keep the program in the cache."""
        backend, signature = self.backend, self.signature
        gm, example_inputs = backend.capture_inputs
        arguments = signature.bind(self.model, *args, **kwargs).arguments
        spec = call_spec(gm, example_inputs, self.model, signature, arguments, out, backend.recorder.outputs)
        backend.capture_inputs, backend.recorder.outputs = None, ()  # hold no tensors of the first call
        backend.program.call = spec
        if spec is not None:
            self._direct_call()
        entry = self.model_cache.entry if self.model_cache is not None else None
        if entry is not None:
            try:
                entry.save_program(backend.program, backend.program.readable())
            except OSError as e:
                if no_room(e) is None:
                    raise
                warn_no_room(e, entry.path / "graph.pkl")

    def _direct_call(self) -> None:
        """Later calls go straight to the split graph, each piece through the wrapper if one is set."""
        from kiln.compile.backend import runnable

        program = self.backend.program
        module = runnable(program, self.backend.pieces, self.piece_wrapper)
        self.dispatch = DirectCall(module, program.call, self.model, self.signature)

    def wrap_pieces(self, wrapper: Callable[[Callable], Callable] | None) -> None:
        """Route every call of a compiled region between the split ops through `wrapper(fn)` (a
        CUDA graph per bucket, say): the hook for what runs around them, which this package knows
        nothing about. The regions are the pieces of the FX split, or with splitting_mode
        "inductor_partition" Inductor's partitions (its one piece holds the split ops, which must
        stay outside the wrapper). Takes effect now if the forward is ready, else once it is."""
        partitions = self.backend.partitions if self.backend is not None else None
        if partitions is not None:
            partitions.wrap(wrapper)
            return
        self.piece_wrapper = wrapper
        if self.dispatch is not None:
            self._direct_call()

    def _model_cache(self) -> ModelCache:
        first = next(iter(self.model.parameters()), None)
        device = first.device if first is not None else torch.device("cpu")
        with self.monitor.warm_phase("key.config_factor"):
            config = self._config_factor(device)
        with self.monitor.warm_phase("key.compiler_factor"):
            compiler = compiler_factor(device)
        factors = {"env": env_factor(), "config": config, "compiler": compiler}
        plan = self.backend.plan
        info = {"model": self.cache.name or type(self.model).__name__, "device": str(device),
                "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
                "torch": torch.__version__, "triton": factors["compiler"]["triton"],
                "piece_compiler": self.config.piece_compiler, "capture_sizes": [],
                "plan": {"ranges": [[s.lo, s.hi] for s in plan.ranges], "sizes": sorted(plan.sizes)}}
        forward_file = source_name(inspect.getsourcefile(type(self.model).forward))
        return ModelCache(self.cache, factors, info, forward_file)

    def _config_factor(self, device: torch.device) -> dict:
        """Everything that changes the compiled code, as far as kiln.compile can see it, plus
        what the caller said (architecture, dtype, custom ops). The compile ranges and sizes
        are not in it: an entry keeps an artifact per shape, and any plan takes what it needs."""
        c, model = self.config, self.model
        tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        return {"mode": c.mode, "piece_compiler": c.piece_compiler, "dynamic_shapes_mark": c.dynamic_shapes_mark,
                "stamping": layer_stamping.resolve(c.stamp_mechanism) if c.stamp_repeated_layers else None,
                "split_ops": sorted(op.name for op in self.split_ops), "splitting_mode": c.splitting_mode,
                # Partition functions exist only where kiln's hook was set at code generation
                # (kiln.compile.partitions); entries of this mode made before it have none.
                "partition_functions": c.splitting_mode == "inductor_partition",
                "merge_consecutive_split_ops": c.merge_consecutive_split_ops,
                "passes": self.backend.passes.uuid() if self.backend.passes else None,
                "inductor_settings": c.inductor_settings(),
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
                # The index too: generated code pins its device, so tensor-parallel ranks
                # (cuda:0, cuda:1) must not share artifacts.
                "dynamic_arg_dims": self.dims, "device_type": device.type, "device": str(device),
                "grad_enabled": torch.is_grad_enabled(),  # an inference artifact differs from a training one
                "tensors": {"count": len(tensors), "digest": digest(
                    [(n, list(t.shape), str(t.dtype), t.device.type) for n, t in tensors])},
                "model": self.cache.model}

    def _trace_config(self) -> None:
        trace.compilation_config(self.config, self.split_ops, self.backend.plan if self.backend else None,
                                 mode=self.mode, model_class=type(self.model).__name__,
                                 max_num_batched_tokens=self.max_num_batched_tokens,
                                 engine=self.cache.model if self.cache is not None else None)

    def warm_up(self, make_inputs: Callable[[int], tuple],
                context: Callable[[int], contextlib.AbstractContextManager] | None = None,
                counts: list[int] | None = None) -> None:
        """Make the forward ready for every compile range and size, so nothing compiles while
        serving: start warm from the cache if it can, then run what is still missing.

        The first call is the capture. In mode 3 it hands the backend every range and size to
        compile, and has few tokens: the graph it traces serves every count, each range is
        tuned for its largest count anyway (pieces.size_hint), and a 2048-token forward cost
        4.5 s of a 1-thread CPU start. In mode 2 the backend tunes for the capture call's
        count, so that call has the most tokens. `context(n)`, if given, is entered around the
        call with n tokens (the caller's per-call state, e.g. what opaque ops read). `counts`
        (mode 3): make only these token counts ready instead of every range and size; the
        capture call then takes one of them (the largest up to CAPTURE_TOKENS, and >= 2: Dynamo
        specialises a count of 1).
        """
        if self.mode == 0:
            return
        if self.backend is None:
            calls = [self.max_num_batched_tokens]
        else:
            plan = self.backend.plan
            if counts is None:
                calls = [min(self.max_num_batched_tokens, CAPTURE_TOKENS)]
                calls += [shape.hi for shape in plan.ranges] + sorted(plan.sizes)
                ahead = plan.all_shapes()
            else:
                small = [n for n in counts if 2 <= n <= CAPTURE_TOKENS]
                calls = [max(small) if small else min(self.max_num_batched_tokens, CAPTURE_TOKENS), *counts]
                ahead = list(dict.fromkeys(plan.shape_for(n) for n in calls))
            self._warm_start()
            # The calls below need these shapes: a capture compiles them all at once.
            self.backend.ahead = ahead
        for n in dict.fromkeys(calls):
            if not self._ready_for(n):
                with context(n) if context is not None else contextlib.nullcontext():
                    self(*make_inputs(n))

    def package_pieces(self) -> dict:
        """AOTInductor packages of every piece for every shape the entry holds (kiln prewarm --aot),
        each checked against its Inductor artifact: starts that load them import neither Dynamo
        nor Inductor. What was built and what was refused, and why."""
        if self.mode != 3 or self.entry is None or self.backend.pieces is None:
            raise ValueError("AOT packages are made of the pieces of a piecewise compile (mode 3, -O1..-O3) with the "
                             f"compile cache on; this forward is {self.describe()}")
        if self.config.piece_compiler != "inductor" or self.config.splitting_mode != "fx":
            raise ValueError(f"AOT packages are made of Inductor pieces of an FX split; this forward has "
                             f"{self.config.piece_compiler} pieces, splitting_mode {self.config.splitting_mode!r}")
        from kiln.compile.aot_piece import refused_on

        device = next(iter(self.model.parameters()), torch.zeros(0)).device
        if why := refused_on(device.type):
            raise ValueError(why)
        return self.backend.pieces.package(self.backend.plan.all_shapes())

    def start_from_cache(self) -> bool:
        """Load the forward from the compile cache, without Dynamo, if an entry has it: True
        then. With a lazy strategy nothing compiles (the eager one compiles what the entry lacks)."""
        return self.backend is not None and self._warm_start()

    def _ready_for(self, num_tokens: int) -> bool:
        if self.dispatch is None:
            return False
        pieces = self.backend.pieces
        return pieces.compiler == "eager" or self.backend.plan.shape_for(num_tokens) in pieces.by_shape

    def code_for(self, num_tokens: int):
        """What runs a call of num_tokens tokens once the forward is ready, as a key: calls
        with equal keys run the same code, so the first of them does the once-per-code work
        (Inductor's autotuning, a kernel's first load) for all. None where that is not known:
        modes 1 and 2 and checked guards may compile again for another count."""
        if self.mode == 0:
            return "eager"
        if self.mode != 3 or self.config.debug_guards or self.backend is None:
            return None
        return self.backend.plan.shape_for(num_tokens)

    @property
    def entry(self):
        """The compile-cache entry this model uses, once its first call chose one."""
        return self.model_cache.entry if self.model_cache is not None else None

    @property
    def stats(self) -> dict:
        return self.monitor.stats()

    def describe(self) -> str:
        """One line for logs and `kiln generate`: what runs the forward."""
        if self.mode == 0:
            why = "mode 0" if self.config.mode == 0 else "model not decorated with @compile_dynamic"
            return f"eager ({why})"
        text = f"compiled: mode {self.mode} ({_MODE_NAMES[self.mode]})"
        if self.mode == 2:
            text += f", backend {self.config.backend}"
        if self.mode == 3:
            c = self.config
            plan = self.backend.plan
            text += (f", {c.piece_compiler} pieces, {c.strategy} strategy, ranges "
                     f"{', '.join(f'[{r.lo}, {r.hi}]' for r in plan.ranges)}"
                     + (f", sizes {sorted(plan.sizes)}" if plan.sizes else "")
                     + (f", splitting {c.splitting_mode}" if c.splitting_mode != "fx" else "")
                     + (f", passes {', '.join(self.backend.passes.names())}" if self.backend.passes else ""))
        if self.config.debug_guards and self.mode in (2, 3):
            text += ", debug guards"
        return text


def compile_model(model: nn.Module, config: CompilationConfig, max_num_batched_tokens: int,
                  cache: CompileCache | None = None) -> CompiledModel:
    """`cache`: keep and reuse compiled artifacts there (CompileCache.from_env); None: compile
    in memory only."""
    return CompiledModel(model, config, max_num_batched_tokens, cache)
