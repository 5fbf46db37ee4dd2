"""kiln.compile.gc_pause: the collector off while a start-up imports and loads, on every
thread's span, and what those spans allocated handed to the oldest generation unwalked; an
engine's start-up heap frozen once it is ready, until it is shut down."""

import gc
import subprocess
import sys
import threading
import weakref

import pytest

from kiln.compile.gc_pause import collector_paused, thaw_heap
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    thaw_heap()  # an engine built earlier in this process (a session fixture's) froze the heap
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_stays_off_until_the_last_span_ends_on_any_thread(collector_on):
    inside, release = threading.Event(), threading.Event()

    def other_span():
        with collector_paused():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other_span)
    with collector_paused():
        assert not gc.isenabled()
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's span is still open
    release.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_collector_the_caller_had_turned_off_stays_off(collector_on):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_what_a_span_allocated_goes_to_the_oldest_generation_unwalked(collector_on):
    with collector_paused():
        made = [[] for _ in range(5000)]  # 5000 containers: several young collections' worth
        assert gc.get_count()[0] >= 5000  # counted, never collected, while paused
    assert gc.get_count()[0] < 100  # the next young collection is far off, not due at once
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(made) in oldest and all(id(x) in oldest for x in made[:10])
    del made


def test_objects_someone_else_froze_stay_frozen(collector_on):
    gc.freeze()  # as a trace does around its loads (kiln.compile.capture), or an app before forking
    try:
        frozen = gc.get_freeze_count()
        with collector_paused():
            [[] for _ in range(1000)]
        assert gc.get_freeze_count() == frozen and gc.isenabled()
    finally:
        gc.unfreeze()


def test_an_error_inside_a_span_still_ends_it(collector_on):
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("a failed import")
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_importing_kiln_leaves_the_collector_as_it_found_it():
    code = "import gc, kiln; print(gc.isenabled(), gc.get_freeze_count())"
    for prefix, want in (("", "True 0"), ("import gc; gc.disable(); ", "False 0")):
        out = subprocess.run([sys.executable, "-c", prefix + code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == want.split()


def test_freeze_heap_exempts_what_is_alive_and_leaves_the_collector_on():
    """A built engine's start-up heap, frozen: the next full collection walks none of it."""
    code = ("import gc; from kiln.compile.gc_pause import freeze_heap; before = gc.get_freeze_count(); "
            "freeze_heap(); print(gc.isenabled(), gc.get_freeze_count() > before + 1000, gc.collect() == 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-llama", device="cpu", dtype="float32"))


def test_an_engine_freezes_its_start_up_heap_once_ready_and_thaws_it_at_shutdown(collector_on):
    engine = _engine()
    assert gc.get_freeze_count() > 1000
    assert not any(o is engine for o in gc.get_objects())  # no collection walks it while it serves
    engine.shutdown()
    assert gc.get_freeze_count() == 0


def test_an_engine_dropped_without_shutdown_is_freed_before_the_next_loads(collector_on, monkeypatch):
    """Its heap was frozen with it inside: the next build thaws it and collects before it loads its
    own weights, rather than freezing the dropped engine in again for as long as the new one lives."""
    from kiln.engine import llm_engine

    dropped = _engine()
    dropped.loop = dropped  # garbage only a collection can free, as a compiled engine is
    gone = weakref.ref(dropped)
    del dropped
    assert gone() is not None  # frozen: not even a full collection frees it
    gc.collect()
    assert gone() is not None
    freed_before_loading = []
    real_load = llm_engine.load_source
    monkeypatch.setattr(llm_engine, "load_source", lambda name: freed_before_loading.append(gone() is None)
                        or real_load(name))
    with collector_paused():  # as a start's loads are: only the build's own collection can free it
        engine = _engine()
    assert freed_before_loading == [True]
    engine.shutdown()

