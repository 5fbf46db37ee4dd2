"""Compiles Triton kernels into Triton's cache dir, for kiln.compile.triton_precompile.

Run as a script (`python <this file>`), never as `-m kiln...`: importing the kiln package
imports torch (~1.5 s), and this process needs Triton and the kernels' own modules only
(kiln's kernel modules, kiln.ops.triton.kernels.*, import nothing else). It reads one JSON
kernel per stdin line, compiles it for the target named on its first line (with the parent's
Triton key), and answers one JSON line per kernel. The parent's own launch then finds the
kernel (and its C launcher) in the cache dir, because both sides build the same Triton source
and options from the same specialization data.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import traceback


def load_function(module: str, file: str, name: str):
    """The @triton.jit function `name` of `module`, loaded from `file` under the module's own
    name without importing its parent packages (Triton's cache key hashes the full name, the
    source and its first line number, all the same as in the parent)."""
    loaded = sys.modules.get(module)
    if loaded is None:
        spec = importlib.util.spec_from_file_location(module, file)
        loaded = importlib.util.module_from_spec(spec)
        sys.modules[module] = loaded
        spec.loader.exec_module(loaded)
    return getattr(loaded, name)


def source_and_options(fn, specialization: str):
    """(ASTSource, options dict) from the JSON Triton serializes for a launch's specialization
    (the same decoding as JITFunction.preload, without asking a GPU for the device)."""
    import triton.language as tl
    from triton.compiler import ASTSource

    data = json.loads(specialization)
    constexprs = {
        tuple(key): tl.dtype(value) if tl.dtype.is_dtype(value) else
        tl.constexpr(value["constexpr"]) if isinstance(value, dict) and "constexpr" in value else value
        for key, value in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = {tuple(key): value for key, value in zip(data["attrs_keys"], data["attrs_vals"])}
    # JSON turned tuples into lists; a signature or an option never holds a list.
    signature = {k: tuple(v) if isinstance(v, list) else v for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    return ASTSource(fn, signature, constexprs, attrs), options


def build_launcher(kernel, target) -> bool:
    """Build the kernel's C launcher (Triton compiles one per signature with the host C
    compiler, into the same cache dir, on a kernel's first launch); False where it cannot be
    built here (no CUDA driver library: a machine without a GPU)."""
    if target.backend != "cuda":
        return False
    try:
        # The launcher class itself, not triton.runtime.driver.active: choosing the active
        # driver imports torch and initialises CUDA, seconds per worker.
        from triton.backends.nvidia.driver import CudaLauncher

        CudaLauncher(kernel.src, kernel.metadata)
    except Exception:  # then the parent builds it at the first launch, as Triton always does
        return False
    return True


def use_triton_key(key: str) -> None:
    """Take the parent's Triton key (the same install: this process runs the parent's Python)
    instead of computing it at the first compile: a hash of Triton's sources and its ~400 MB
    library, ~0.3 s of every worker's first kernel on the dev CPU."""
    from triton.runtime import autotuner, cache

    def parents_triton_key() -> str:
        return key

    cache.triton_key = autotuner.triton_key = parents_triton_key


def main() -> None:
    import triton
    from triton.backends.compiler import GPUTarget

    header = json.loads(sys.stdin.readline())
    target = GPUTarget(*header["target"])
    use_triton_key(header["triton_key"])
    for line in sys.stdin:
        job = json.loads(line)
        start = time.perf_counter()
        try:
            fn = load_function(job["module"], job["file"], job["name"])
            src, options = source_and_options(fn, job["specialization"])
            kernel = triton.compile(src, target=target, options=options)
            compiled = time.perf_counter()
            answer = {"ok": True, "launcher": build_launcher(kernel, target),
                      "launcher_seconds": time.perf_counter() - compiled}
        except Exception:  # the parent logs it; its own launch then compiles (and raises) in-process
            answer = {"ok": False, "error": traceback.format_exc(limit=3)}
        print(json.dumps({**answer, "seconds": time.perf_counter() - start}), flush=True)


if __name__ == "__main__":
    main()
