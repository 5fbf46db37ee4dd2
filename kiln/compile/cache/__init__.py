"""The compile cache on disk: entries keyed by the cache key, written atomically under a
lock, checked against their manifest before anything in them is loaded.

    store        where the root is, atomic writes, checksums, entry locks
    root         the cache root: entries, look-up by key prefix, the traced-sources index
    key          the key's four factors (env, config, code, compiler)
    entry        one entry: manifest, verify, repair, the program and piece artifacts
    graph_pickle the program's fx graphs pickled as their nodes (no re-trace at load)
    model_cache  which entry a model uses: CompileCache (the caller's view), ModelCache
    preload      once-per-process work a warm start (or a cold CPU capture's ISA probes) waits on,
                 started early on a thread
"""

from kiln.compile.cache.entry import CacheEntry
from kiln.compile.cache.model_cache import CompileCache, ModelCache
from kiln.compile.cache.root import CacheRoot
from kiln.compile.cache.store import cache_disabled, cache_root

__all__ = ["CacheEntry", "CacheRoot", "CompileCache", "ModelCache", "cache_disabled", "cache_root"]
