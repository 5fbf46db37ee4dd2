"""Inductor settings kiln changes for the length of a compile or a load, and their values outside.

Before torch 2.13 `torch._inductor.config.patch` changes the setting for every thread, not only
the one inside it. The compile-cache key reads the settings this process changed (key.py), and on
torch 2.11 it read `cpp.vec_isa_ok` as changed whenever the ISA-probe thread (entry.py) held its
patch while the main thread made the key: a prewarm's entry then had a key its starts never made.
So kiln's own patches go through `patched`, and the key reads a setting under one at the value it
has outside.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_outside: dict[str, list] = {}  # setting -> [its value outside kiln's patches, patches holding it]


@contextlib.contextmanager
def patched(settings: dict) -> Iterator[None]:
    """`torch._inductor.config.patch(settings)`, which the compile-cache key does not see."""
    import torch._inductor.config as config

    with _lock:
        for name in settings:
            held = _outside.setdefault(name, [_value(config, name), 0])
            held[1] += 1
    try:
        with config.patch(settings):
            yield
    finally:
        with _lock:
            for name in settings:
                held = _outside[name]
                held[1] -= 1
                if held[1] == 0:
                    del _outside[name]


def value_outside(name: str, value):
    """The value of setting `name` outside kiln's patches; `value` (as read) where none holds it."""
    with _lock:
        held = _outside.get(name)
    return value if held is None else held[0]


def _value(config, name: str):
    return functools.reduce(getattr, name.split("."), config)
