"""A short GIL switch interval while a GPU engine's start runs threads side by side.

Every torch call from Python leaves the GIL for the op and takes it back after; so does a file
read. Taking it back waits until the thread holding it reaches the switch interval (5 ms by
default) when that thread is busy in Python. A GPU engine's start runs such threads beside each
other: the compile preload imports Inductor (a second of pure Python) while the main thread
builds the weights (an allocation and a fill per tensor) and Triton's driver start hashes its
400 MB library in 1 MB reads. Each of those calls can then wait up to 5 ms for the GIL. A short
interval bounds the wait: an -O2 warm start on an H100 went 3.49 -> 3.18 s. On the 2-core CPU,
SmolLM2 -O2 warm and imported starts were level within 0.1 s either way over two A/Bs, so it is
for CUDA only. It is put back once the last runner being built is.
"""

from __future__ import annotations

import contextlib
import sys
import threading

START_UP_SWITCH_INTERVAL = 2e-4  # seconds; never longer than the interpreter's own

_lock = threading.Lock()
_starts = 0  # GPU starts under way now, over all threads: the last to end puts the interval back
_saved = 0.0


@contextlib.contextmanager
def quick_gil_handoff(device_type: str):
    global _starts, _saved
    if device_type != "cuda":
        yield
        return
    with _lock:
        if _starts == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, START_UP_SWITCH_INTERVAL))
        _starts += 1
    try:
        yield
    finally:
        with _lock:
            _starts -= 1
            if _starts == 0:
                sys.setswitchinterval(_saved)
