"""Which entry a model compiles into: the key factors known before capture, the traced
code once Dynamo has run, and the warm look-up that needs no Dynamo."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.compile.cache.entry import CacheEntry
from kiln.compile.cache.key import code_factor, key_of, prekey_of
from kiln.compile.cache.root import CacheRoot
from kiln.compile.cache.store import cache_disabled, check_root
from kiln.compile.monitor import logger


@dataclass
class CompileCache:
    """The cache a model compiles into, and what its caller knows that changes the compiled
    code (architecture, dtype, custom ops: part of the config factor). `name` is only shown."""

    root: CacheRoot
    model: dict
    name: str = ""
    # kiln.compile.cache.preload's thread, started by the engine when a warm start is likely;
    # the warm start joins it
    preload: object | None = field(default=None, repr=False, compare=False)
    # kiln.compile.compile_workers.CompileWorkers, started by the engine before the weights load
    # when the start is surely cold; the first cold capture takes them
    workers: object | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_env(cls, model: dict, name: str = "") -> "CompileCache | None":
        """The cache at KILN_CACHE_ROOT, or None when KILN_DISABLE_COMPILE_CACHE is set."""
        if cache_disabled():
            logger.info("compile cache: off (KILN_DISABLE_COMPILE_CACHE)")
            return None
        root = CacheRoot()
        check_root(root.path)  # at start-up: an unsafe root is refused before anything is read
        return cls(root, model, name)


class ModelCache:
    """One model's way into the cache: the factors known before capture, and its entry."""

    def __init__(self, cache: CompileCache, factors: dict, info: dict, root_source: str):
        self.root, self.factors, self.info = cache.root, factors, info  # factors: all but code
        self.root_source = root_source  # the forward's own file: traced whether Dynamo lists it or not
        self.prekey = prekey_of(factors)
        self.entry: CacheEntry | None = None

    def warm_entry(self) -> CacheEntry | None:
        """The entry for the code as it is now, opened (checked, repaired), if one was filled before."""
        start = time.perf_counter()
        sources = self.root.read_index(self.prekey)
        code = code_factor(sources) if sources else None
        if code is None:
            return None
        factors = {**self.factors, "code": code}
        entry = self.root.entry(key_of(factors))
        if not entry.exists():
            return None
        entry.timings["open.code_factor"] = time.perf_counter() - start
        entry.open(factors, self.info)
        self.entry = entry
        return entry

    def entry_for(self, traced: list[str]) -> CacheEntry:
        """The entry for the files this capture traced (created if new)."""
        sources = sorted(set(traced) | {self.root_source})
        code = code_factor(sources) or {}
        factors = {**self.factors, "code": code}
        self.root.write_index(self.prekey, sources)
        self.entry = self.root.entry(key_of(factors))
        self.entry.open(factors, self.info)
        return self.entry


