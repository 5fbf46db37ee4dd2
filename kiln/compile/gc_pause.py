"""The cyclic garbage collector paused while a start-up imports and loads.

Importing torch, Dynamo and Inductor, reading a tokenizer and building a model create ~1M
long-lived objects and almost no garbage, yet each of them is counted towards a collection:
with the collector on, a quarter of Dynamo's import time (0.9 -> 0.7 s on a 2-core CPU) and
six full collections of a growing heap (0.47 s in an -O2 SmolLM2 start) go to walking a heap
that only grows. So those spans (kiln's import, the checkpoint, the weights, the compile
imports and the warm start's loads) run with the collector off. At the end of the last one,
what they allocated goes straight to the oldest generation (freeze, then unfreeze) instead of
being walked by the next young collection; its garbage (~9 MB after an -O2 start) is found by
the next full collection, which walks the whole heap once (~0.3 s there) whenever the process
next needs one. Where something else has frozen objects (kiln.compile.capture loads pieces
inside its own freeze during a trace; an application may freeze its heap before forking) that
step is skipped, since unfreezing would hand those back to the collector. Never around a trace
or a compile: those make garbage. Once an engine is built, `freeze_heap` exempts the heap its
start left from collection until the engine is shut down (`thaw_heap`).
"""

from __future__ import annotations

import contextlib
import gc
import threading

_lock = threading.Lock()
_depth = 0  # spans open now, over all threads: the collector stays off until the last ends
_was_enabled = False


@contextlib.contextmanager
def collector_paused():
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                if gc.get_freeze_count() == 0:
                    gc.freeze()
                    gc.unfreeze()
                if _was_enabled:
                    gc.enable()


_frozen_by_engine = False  # whether freeze_heap froze what is frozen now (an application may freeze its own)
_freeze_lock = threading.Lock()  # an engine may be built on one thread while another is shut down


def freeze_heap() -> None:
    """Exempt every object alive now from the cyclic collector, once an engine is built (every kiln
    engine, offline or serving, and each tensor-parallel worker). Its start-up left a heap that lives
    as long as the engine (the compilers, the model, their caches), and each full collection while
    it ran walked all of it with every stream stalled: 0.21-0.30 s after an -O2 start, 0.06-0.09 s
    after an eager one (SmolLM2 on the 2-core CPU, benchmarks/gc_pause_serving.py; 0.2 ms after the
    freeze); 79 ms inside a 30-step decode timing at batch 256 on the H200. The young generations
    are collected first (nothing to walk there); the start-up's own cyclic garbage in the old one
    (~31k objects, ~9 MiB after -O2) is kept until `thaw_heap`, where a full collection would have
    delayed ready by 0.3 s."""
    global _frozen_by_engine
    with _freeze_lock:
        gc.collect(1)
        gc.freeze()
        _frozen_by_engine = True


def thaw_heap() -> bool:
    """Hand what `freeze_heap` froze back to the collector (an engine shut down or done serving,
    or another being built: an engine dropped without shutdown is garbage that only a collection
    can free); whether there was any. `gc.unfreeze` is all or nothing: objects an
    application froze itself before the engine's freeze are handed back too."""
    global _frozen_by_engine
    with _freeze_lock:
        if not _frozen_by_engine:
            return False
        gc.unfreeze()
        _frozen_by_engine = False
        return True
