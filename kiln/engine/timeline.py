"""Start-up phases and their durations, readable while start-up is still running."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kiln")


class StartupTimeline:
    """Phases in order (weights, dynamo, inductor or cache load, graph capture, ...), then ready."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.started = clock()
        self.phases: dict[str, float] = {}  # finished phase -> seconds
        self.current: str | None = "starting"
        self.ready = False
        self.ready_seconds: float | None = None  # from construction to ready
        # The unnamed set-up before each phase (and before ready), by what came next: where
        # "other" went. It can exceed "other", which leaves out phases recorded apart (`add`).
        self.gaps: dict[str, float] = {}
        self._last_end = self.started
        self._depth = 0  # phases open now: a gap counts only between outermost ones
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def phase(self, name: str, record: bool = True):
        """Mark `name` as the current phase; record its seconds unless its parts are added apart."""
        start = self._clock()
        with self._lock:
            self.current = name
            if self._depth == 0:
                self._gap_until(start, f"before {name}")
            self._depth += 1
        try:
            yield
        finally:
            end = self._clock()
            seconds = end - start
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._last_end = end
            if record:
                self.add(name, seconds)
            logger.info("start-up phase %s took %.2f s", name, seconds)

    def _gap_until(self, now: float, label: str) -> None:
        gap = now - self._last_end
        if gap > 0:
            self.gaps[label] = self.gaps.get(label, 0.0) + gap

    def add(self, name: str, seconds: float) -> None:
        """Record a phase measured elsewhere (e.g. compile time split out of a first call)."""
        with self._lock:
            self.phases[name] = self.phases.get(name, 0.0) + seconds

    def mark_ready(self) -> None:
        with self._lock:
            self.current, self.ready = "ready", True
            self.ready_seconds = self.total_seconds
            self._gap_until(self.started + self.ready_seconds, "before ready")
            # The set-up between the named phases, so that the phases add up to the start.
            rest = self.ready_seconds - sum(self.phases.values())
            if rest > 0:
                self.phases["other"] = rest
        logger.info("ready after %.2f s: %s", self.ready_seconds,
                    ", ".join(f"{k} {v:.2f} s" for k, v in self.phases.items()))

    @property
    def total_seconds(self) -> float:
        return self._clock() - self.started

    def as_dict(self) -> dict:
        with self._lock:
            return {"phase": self.current, "ready": self.ready, "phases_s": dict(self.phases),
                    "elapsed_s": round(self.total_seconds, 3)}
