"""kiln.compile.gc_pause: the collector off while a start-up imports and loads, on every
thread's span, and what those spans allocated handed to the oldest generation unwalked; a serving
process's heap frozen once it is ready."""

import gc
import subprocess
import sys
import threading

import pytest

from kiln.compile.gc_pause import collector_paused


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
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
    """A serving process's start-up heap, frozen: the next full collection walks none of it."""
    code = ("import gc; from kiln.compile.gc_pause import freeze_heap; before = gc.get_freeze_count(); "
            "freeze_heap(); print(gc.isenabled(), gc.get_freeze_count() > before + 1000, gc.collect() == 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]
