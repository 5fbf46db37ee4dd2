"""A short GIL switch interval while a start-up's threads run side by side.

Every torch call from Python leaves the GIL for the op and takes it back after; so does a file
read. Taking it back waits until the thread holding it reaches the switch interval (5 ms by
default) when that thread is busy in Python. An engine's start runs such threads beside each
other: the compile preload imports Inductor (a second of pure Python) while the main thread
builds the weights (an allocation and a fill per tensor) and Triton's driver start hashes its
400 MB library in 1 MB reads. Each of those calls can then wait up to 5 ms for the GIL. A short
interval bounds that wait; it is put back once the engine is ready.
"""

from __future__ import annotations

import contextlib
import sys

# Seconds; None leaves the interpreter's own.
START_UP_SWITCH_INTERVAL: float | None = 2e-4


@contextlib.contextmanager
def quick_gil_handoff():
    before = sys.getswitchinterval()
    if START_UP_SWITCH_INTERVAL is not None:
        sys.setswitchinterval(min(before, START_UP_SWITCH_INTERVAL))
    try:
        yield
    finally:
        sys.setswitchinterval(before)
