"""Launching kiln's Triton kernels with less host time than `kernel[grid](...)`.

A forward launches a few hundred short kernels, and an eager step or a CUDA-graph capture pays
each launch's host time. Triton's `JITFunction.run` spends much of its share before the C launch:
it reads its debug setting from the environment, turns the options into a string for its cache
key, checks the kernel's globals, and builds launch metadata for hooks that are usually empty
(Triton 3.6 always calls them). `launch` binds and specialises the arguments with the kernel's
own binder (the specialisation Triton's cache key holds: dtypes, 16-byte alignment, integers
equal to 1 or divisible by 16, constexpr values), looks up the variant that Triton compiled and
loaded for that specialisation and those options, and calls its C launcher. The first launch of
each variant, and every launch while a launch hook is set (a profiler), goes through Triton as
before, as does everything under Triton's CPU interpreter.

On an H100 (llama-3-8b, `benchmarks/results/triton_launch_ab_h100.json`) an eager engine step
went 21.1 / 17.1 -> 18.7 / 16.5 ms at batch 1 and 16.8 / 16.6 -> 16.1 / 15.6 ms at 64, and -O2's
407 captures 0.68 / 0.61 -> 0.61 / 0.57 s: the rest of a launch's host time is kiln's and torch's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton

# (kernel, device) -> the kernel's binder: args, kwargs -> (params, specialization, options)
_binders: dict[tuple[Any, int], Callable] = {}
# (kernel, device, specialization, options) -> a compiled, loaded variant
_variants: dict[tuple, Any] = {}
_driver: list = []  # [get_current_device, get_current_stream] once a GPU launch has happened


def launch(kernel, grid, *args, **kwargs) -> None:
    """kernel[grid](*args, **kwargs), straight to a variant's launcher once it is known."""
    binder = None
    if _driver:
        device = _driver[0]()
        binder = _binders.get((kernel, device))
    if binder is None or _hooks_set():
        _launch_through_triton(kernel, grid, args, kwargs)
        return
    params, specialization, options = binder(*args, **kwargs)
    variant = _variants.get((kernel, device, tuple(specialization), tuple(options.items())))
    if variant is None:
        _launch_through_triton(kernel, grid, args, kwargs)
        return
    if callable(grid):
        grid = grid(params)
    variant.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                _driver[1](device), variant.function, variant.packed_metadata, None, None, None,
                *params.values())


def _launch_through_triton(kernel, grid, args: tuple, kwargs: dict) -> None:
    variant = kernel[grid](*args, **kwargs)
    # Only a jitted kernel on a GPU (not the interpreter's), with no pre-run hooks, whose
    # launch returned the loaded variant (not a future of an asynchronous compile).
    caches = getattr(kernel, "device_caches", None)
    if (caches is None or getattr(kernel, "pre_run_hooks", None) or getattr(variant, "function", None) is None
            or not hasattr(variant, "packed_metadata")):
        return
    if not _driver:
        from triton.runtime import driver

        _driver[:] = [driver.active.get_current_device, driver.active.get_current_stream]
    device = _driver[0]()
    entry = caches.get(device)
    binder = entry[-1] if isinstance(entry, tuple) and entry and callable(entry[-1]) else None
    if binder is None:  # another Triton's layout: stay on its path
        return
    _binders[(kernel, device)] = binder
    _, specialization, options = binder(*args, **kwargs)
    _variants[(kernel, device, tuple(specialization), tuple(options.items()))] = variant


def _hooks_set() -> bool:
    runtime = triton.knobs.runtime
    return bool(_hook_calls(runtime.launch_enter_hook) or _hook_calls(runtime.launch_exit_hook))


def _hook_calls(hook) -> Any:
    # Triton 3.6 keeps a chain of hooks (empty when none is set); earlier ones a function or None.
    return getattr(hook, "calls", hook)
