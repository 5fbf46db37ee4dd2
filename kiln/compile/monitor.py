"""What the compile pipeline did and how long it took: counters, timings, the log lines.

Users grep for these lines, so their wording is fixed:
    Dynamo bytecode transform time: X s
    Compiling a graph for range [a, b] took X s     (or "for size n")
    torch.compile took X s in total
    Loaded the compiled forward from compile cache entry KEY in X s
    compile cache miss: range [a, b] of MODEL is not in cache entry KEY; ...   (a WARNING)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from kiln.compile import trace

logger = logging.getLogger("kiln.compile")


@dataclass
class CompileCounters:
    graphs_seen: int = 0  # graphs Dynamo handed to kiln (1 per capture; more is a recompile)
    pieces: int = 0  # compiled pieces in the split graph
    unique_pieces: int = 0  # distinct pieces by structural hash (each compiled once per shape)
    opaque_regions: int = 0  # runs of split ops, executed as captured
    # Inductor's partition functions between the split ops (splitting_mode "inductor_partition"),
    # summed over every artifact: per unique piece and token shape. GPU code only.
    partitions: int = 0
    inductor_compiles: int = 0  # piece compiler invocations, one per unique piece and range/size
    cache_hits: int = 0  # pieces loaded from kiln's compile cache, or served from Inductor's FX-graph cache
    cache_misses: int = 0  # piece compiles neither cache could serve: Inductor ran for real
    pieces_loaded: int = 0  # piece artifacts loaded from kiln's compile cache
    packages_loaded: int = 0  # of them, AOTInductor packages (kiln.compile.aot_piece)
    compiles_after_capture: int = 0  # lazy specialisations after the first call
    stamped_layers: int = 0  # repeated layer calls Dynamo did not trace (kiln.compile.layer_stamping)
    # graph pass name -> rewrites it made, summed over the graphs Inductor compiled
    pass_matches: dict[str, int] = field(default_factory=dict)


@dataclass
class CompileTimes:
    dynamo_s: float = 0.0  # bytecode analysis and graph capture
    backend_s: float = 0.0  # splitting, fake propagation and compiling inside the backend
    split_s: float = 0.0  # the backend's own part of that: all but the piece compiles
    compile_s: float = 0.0  # piece compiler time (Inductor), at capture and later
    load_s: float = 0.0  # reading the compile cache: the split graph and piece artifacts
    total_s: float = 0.0  # the first call (capture, or a warm start from the cache), end to end
    # Compile workers: from their start until the last one was warm, and until the jobs came.
    workers_ready_s: float = 0.0
    workers_jobs_s: float = 0.0


# The parts of a warm start, in order (see CompiledModel._warm_start); they sum to its total
# but for the lock and bookkeeping between them. "background.*" are kiln.compile.cache.preload's
# steps, which ran on its thread while the weights loaded: not part of the sum.
WARM_PHASES = ("preload_wait", "key", "open", "program", "split", "pieces", "ahead", "dispatch", "background")


@dataclass
class CompileMonitor:
    counters: CompileCounters = field(default_factory=CompileCounters)
    times: CompileTimes = field(default_factory=CompileTimes)
    # warm start part -> seconds (WARM_PHASES, then finer ones such as "pieces.verify")
    warm_phases: dict[str, float] = field(default_factory=dict)

    def stats(self) -> dict:
        return {**asdict(self.counters), **{k: round(v, 3) for k, v in asdict(self.times).items()},
                "warm_phases_s": {k: round(self.warm_phases[k], 4) for k in self._warm_order()}}

    def _warm_order(self) -> list[str]:
        """WARM_PHASES in order, each followed by its finer parts ("pieces.verify"), then the rest."""
        names = list(self.warm_phases)
        order = [n for top in WARM_PHASES for n in names if n == top or n.startswith(top + ".")]
        return order + [n for n in names if n not in order]

    @contextlib.contextmanager
    def warm_phase(self, name: str):
        """Time one part of a warm start (added up if it runs more than once)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.warm_phase_add(name, time.perf_counter() - start)

    def warm_phase_add(self, name: str, seconds: float) -> None:
        self.warm_phases[name] = self.warm_phases.get(name, 0.0) + seconds

    def capture_done(self, total_s: float) -> None:
        self.times.total_s = total_s
        self.times.dynamo_s = max(total_s - self.times.backend_s, 0.0)
        logger.info("Dynamo bytecode transform time: %.2f s", self.times.dynamo_s)
        logger.info("torch.compile took %.2f s in total", total_s)

    @contextlib.contextmanager
    def backend_call(self):
        self.counters.graphs_seen += 1
        start, compiled = time.perf_counter(), self.times.compile_s
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.times.backend_s += seconds
            self.times.split_s += seconds - (self.times.compile_s - compiled)

    @contextlib.contextmanager
    def piece_compile(self, piece: str, index: int, shape, after_capture: bool):
        hits = _inductor_counters()["fxgraph_cache_hit"]
        start = time.perf_counter()
        yield
        seconds = time.perf_counter() - start
        self.times.compile_s += seconds
        hit = min(_inductor_counters()["fxgraph_cache_hit"] - hits, 1)
        self.counters.inductor_compiles += 1
        self.counters.cache_hits += hit
        self.counters.cache_misses += 1 - hit
        self.counters.compiles_after_capture += after_capture
        logger.debug("compiled %s for %s in %.2f s", piece, shape, seconds)
        trace.piece_compiled(piece, index, shape, seconds, bool(hit), after_capture)

    def piece_compiled_elsewhere(self, piece: str, index: int, shape, seconds: float, fx_cache_hit: bool,
                                 after_capture: bool) -> None:
        """A compile worker's piece; its time is in the wall time of the whole batch, not here."""
        self.counters.inductor_compiles += 1
        self.counters.cache_hits += fx_cache_hit
        self.counters.cache_misses += not fx_cache_hit
        self.counters.compiles_after_capture += after_capture
        logger.debug("a worker compiled %s for %s in %.2f s", piece, shape, seconds)
        trace.piece_compiled(piece, index, shape, seconds, fx_cache_hit, after_capture)

    def pass_matched(self, name: str, matches: int, where: str) -> None:
        self.counters.pass_matches[name] = self.counters.pass_matches.get(name, 0) + matches
        logger.log(logging.INFO if matches else logging.DEBUG, "pass %s: %d matches in %s", name, matches, where)

    def pieces_loaded(self, count: int, seconds: float) -> None:
        self.counters.pieces_loaded += count
        self.counters.cache_hits += count
        if count:
            self.times.load_s += seconds

    def warm_start_done(self, key: str, seconds: float) -> None:
        self.times.total_s = seconds
        self.times.load_s = max(seconds - self.times.compile_s, 0.0)
        logger.info("Loaded the compiled forward from compile cache entry %s in %.2f s (%d artifacts; "
                    "no Dynamo, %d Inductor compiles)", key, seconds, self.counters.pieces_loaded,
                    self.counters.inductor_compiles)
        logger.info("warm start parts: %s", ", ".join(f"{k} {self.warm_phases[k]:.3f} s" for k in self._warm_order()))
        # The cold start's summary line too, so one grep finds what every start paid.
        logger.info("torch.compile took %.2f s in total (a warm start from the compile cache)", seconds)

    def compiled_in_workers(self, label: str, seconds: float, timing: tuple[float, float] | None) -> None:
        """The wall time of a batch of worker compiles (loading their artifacts included), and
        the workers' CompileWorkers.timing."""
        self.times.compile_s += seconds
        self.shape_compiled(label, seconds)
        if timing is not None:
            self.times.workers_ready_s, self.times.workers_jobs_s = timing
            logger.info("compile workers: warm %.2f s after their start, the jobs came at %.2f s", *timing)

    def shape_compiled(self, label: str, seconds: float) -> None:
        logger.info("Compiling a graph for %s took %.2f s", label, seconds)

    def progress(self, total: int, what: str) -> tqdm:
        # Only worth a bar when there is more than one thing to wait for.
        # On a terminal only: in a log file a bar's redraws would be one line glued to the next.
        return tqdm(total=total, desc=what, unit="piece", disable=total < 2 or not sys.stderr.isatty(), leave=False)


def _inductor_counters():
    # Imported on use: Dynamo's import is a second that an eager start does not pay.
    from torch._dynamo.utils import counters

    return counters["inductor"]
