"""Triton's and Inductor's source keys, kept in the cache root against the files they hash.

Every Triton kernel's cache key begins with Triton's triton_key(): a hash of its compiler's
sources and of its 416 MB libtriton.so. Every Inductor artifact's begins with torch_key(): a
hash of torch's Python sources. Each process computes both once. In an imported -O2 start on an
H100 host that was 0.7 s of the Triton driver thread's time (under py-spy), which the main thread
waited 0.38 s for, and 0.14-0.17 s of the compile preload's.

Their inputs change only when a package is reinstalled or edited, and either changes the files'
sizes or modification times: the test Python makes before it trusts a .pyc. So a key is
recorded under a fingerprint of those stats (one walk of the package: about 1 ms for Triton,
30-70 ms for torch), and a start whose fingerprint matches takes the recorded key. torch gets it
through torch_key.set, the call torch's own compile workers use. Triton has no such call: the
module attributes that hold its cached triton_key are pointed at the recorded value. A missing
or different record only means the key is computed as before, then recorded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from kiln.compile.cache.store import write_atomic

KEYS_DIR = "source_keys"
# Where Triton's triton_key is bound by name (imported with `from ... import triton_key`).
TRITON_KEY_HOLDERS = ("triton.runtime.cache", "triton.runtime.autotuner", "torch._inductor.runtime.triton_compat")

logger = logging.getLogger("kiln")


def fingerprint(package: Path, version: str, suffixes: tuple[str, ...]) -> str:
    """A hash of `version` and of the relative path, size and modification time of every file
    under `package` whose name ends with one of `suffixes`: a superset of what the key reads."""
    digest = hashlib.sha256(f"{package}\0{version}\n".encode())
    for folder, dirs, files in os.walk(package):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(suffixes):
                path = os.path.join(folder, name)
                st = os.stat(path)
                digest.update(f"{os.path.relpath(path, package)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def torch_key(root: Path | None) -> None:
    """Make Inductor's torch_key() this process's: the recorded one where torch's files match
    their record in `root`, else computed (and recorded)."""
    import torch
    from torch._inductor import codecache

    if root is None:
        codecache.torch_key()
        return
    # Its modules (.py, and extension .so), plus two files of Inductor's it hashes too.
    mark = fingerprint(Path(torch.__file__).parent, torch.__version__, (".py", ".so", ".cpp", ".ld"))
    recorded = _read(root, "torch", mark)
    try:
        key = bytes.fromhex(recorded) if recorded is not None else None
    except ValueError:  # a damaged record: computed and written again
        key = None
    if key is None:
        _write(root, "torch", mark, codecache.torch_key().hex())
        return
    try:
        codecache.torch_key.set(key)
    except (AssertionError, RuntimeError):  # already computed in this process (2.11 asserts, 2.13 raises)
        pass


def triton_key(root: Path | None) -> str:
    """Triton's triton_key() for this process (see torch_key); the key."""
    import triton
    from triton.runtime import cache

    computed = cache.triton_key
    if root is None:
        return computed()
    mark = fingerprint(Path(triton.__file__).parent, triton.__version__, (".py", ".so"))
    recorded = _read(root, "triton", mark)
    if recorded is None:
        key = computed()
        _write(root, "triton", mark, key)
        return key
    # Not computed in this process yet (an earlier engine of this process may have pointed it
    # at a record already: a plain function then, without lru_cache's cache_info).
    if hasattr(computed, "cache_info") and computed.cache_info().currsize == 0:
        _point_at(recorded, computed)
    return recorded


def _point_at(key: str, computed: Callable[[], str]) -> None:
    def recorded_triton_key() -> str:
        return key

    for name in TRITON_KEY_HOLDERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "triton_key", None) is computed:
            module.triton_key = recorded_triton_key


def record(root: Path) -> None:
    """Record both keys in `root` (kiln cache import: a start on this machine then computes
    neither). Triton's only where it is installed."""
    torch_key(root)
    if importlib.util.find_spec("triton") is not None:
        triton_key(root)


def _read(root: Path, name: str, mark: str) -> str | None:
    try:
        return (root / KEYS_DIR / f"{name}-{mark}").read_text().strip() or None
    except OSError:
        return None


def _write(root: Path, name: str, mark: str, key: str) -> None:
    try:
        write_atomic(root / KEYS_DIR / f"{name}-{mark}", key.encode())
    except OSError as e:  # a root it cannot write in: the next start computes the key again
        logger.debug("source key %s not recorded in %s: %s", name, root / KEYS_DIR, e)
