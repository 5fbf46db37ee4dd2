"""kiln.engine.timeline: phases add up to ready, and the set-up between them is placed by the phase
that followed it (gaps)."""

import pytest

from kiln.engine.timeline import StartupTimeline


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_set_up_between_phases_is_placed_by_the_phase_after_it():
    clock = Clock()
    t = StartupTimeline(clock)
    clock.now += 1.0  # set-up before weights
    with t.phase("weights"):
        clock.now += 2.0
    clock.now += 0.5  # set-up before the compile
    with t.phase("compile", record=False):
        clock.now += 0.25
        with t.phase("inner"):  # a phase inside another leaves no gap of its own
            clock.now += 0.25
        clock.now += 1.0
    t.add("cache_load", 1.0)  # part of the compile, measured apart
    clock.now += 0.125  # set-up before ready
    t.mark_ready()
    assert t.gaps == {"before weights": 1.0, "before compile": 0.5, "before ready": 0.125}
    assert t.ready_seconds == pytest.approx(5.125)
    assert sum(t.phases.values()) == pytest.approx(t.ready_seconds)
    # "other" is the gaps and the compile's own unnamed 0.25 s (its parts were recorded apart).
    assert t.phases["other"] == pytest.approx(sum(t.gaps.values()) + 0.25)
