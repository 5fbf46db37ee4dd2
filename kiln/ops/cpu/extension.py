"""kiln's CPU kernels (paged attention, RMSNorm, the KV-cache write: the .cpp files here): built once, loaded by every start.

Building takes a compiler and tens of seconds, so a serving start never builds: `kiln prewarm
--device cpu` (or build()) compiles it into the cache root, keyed by the source, torch and this
CPU's instruction sets (it is built for the machine's own, -march=native), and later starts load
that build. A start that finds none runs the Python reference and says so once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger("kiln")

SOURCES = [Path(__file__).with_name(name) for name in ("bindings.cpp", "paged_attention.cpp", "rms_norm.cpp",
                                                        "kv_cache_write.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("float_bits.h", "vector_exp.h")]
NAME = "kiln_cpu_kernels"
# The machine's own vector units; math calls without errno, so that sqrt is one instruction (the
# softmax's exp is vector_exp.h's: glibc's vector expf needs -ffast-math). OpenMP because
# at::parallel_for is a header whose `omp parallel` is compiled here: without it the kernel ran on
# one thread whatever torch's count (16 decodes at 100 tokens, 2 threads: 273 -> 136 us). The
# library then needs libgomp.so.1, the one torch has loaded.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]
LDFLAGS = ["-fopenmp"]
_loaded: ModuleType | None = None
_absent: set[Path] = set()  # build dirs looked in and found empty
_said = False


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def _build_key() -> str:
    parts = [*(source.read_bytes() for source in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS).encode(),
             torch.__version__.encode(), _cpu_flags().encode(), sys.version.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build_dir() -> Path:
    """Where this source's build for this torch and CPU lives."""
    return _build_dir_under(os.environ.get("KILN_CACHE_ROOT"), os.environ.get("HOME"))


# Per cache root (the environment names it): every norm and attention call of an engine whose
# kernels were never built asks, and composing the path took ~13 us a call.
@functools.cache
def _build_dir_under(cache_root_env: str | None, home: str | None) -> Path:
    from kiln.compile.cache import cache_root
    from kiln.compile.cache.root import CPU_KERNELS

    return cache_root() / CPU_KERNELS / f"{NAME}-{_build_key()}"


def _built_module(directory: Path) -> Path | None:
    if (directory / "lock").exists():  # torch's build lock: a prewarm is linking it right now
        return None
    found = sorted(directory.glob(f"{NAME}*.so"))
    return found[0] if found else None


def build() -> Path:
    """Compile the kernel into build_dir() (a no-op when it is there); returns the library."""
    global _loaded
    from torch.utils.cpp_extension import load

    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    _absent.discard(directory)
    _loaded = load(NAME, [str(source) for source in SOURCES], build_directory=str(directory), extra_cflags=CFLAGS,
                   extra_ldflags=LDFLAGS, verbose=False)
    return _built_module(directory)


def kernel() -> ModuleType | None:
    """The built kernel, loaded; None (with one log line) when it was never built here. Called by
    every attention op: a cache root found without a build is not looked in again."""
    global _loaded, _said
    if _loaded is not None:
        return _loaded
    directory = build_dir()
    if directory in _absent:
        return None
    library = _built_module(directory)
    if library is None:
        _absent.add(directory)
        if not _said:
            _said = True
            logger.info("CPU attention: the Python reference (per sequence), and native norms; `kiln prewarm "
                        "--device cpu` builds the batched C++ kernels into %s", build_dir().parent)
        return None
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded = module
    return module
