"""Spawned helper processes (compile workers, tensor-parallel ranks) that do not run the
parent's main script.

A spawned child first re-runs its parent's `__main__` (by path or module name), as
multiprocessing does to find functions defined there. kiln's children run kiln functions
only, and a user's script without an `if __name__ == "__main__"` guard would build an
engine in every one of them (with compile workers: each waited on the parent's cache lock).
Here because the compile package imports nothing else of kiln's; kiln.distributed uses it too.
"""

from __future__ import annotations

import multiprocessing.context
import sys
import types


class _Process(multiprocessing.context.SpawnProcess):
    @staticmethod
    def _Popen(process_obj):
        # What the child runs first is read from sys.modules["__main__"] while it is launched;
        # a module with neither a file nor a spec tells it to skip that step.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            return multiprocessing.context.SpawnProcess._Popen(process_obj)
        finally:
            sys.modules["__main__"] = main


class SpawnContext(multiprocessing.context.SpawnContext):
    """multiprocessing's spawn context, without the re-run of the parent's main script."""

    Process = _Process
