"""The cache root: its entries, finding one by key prefix, and the index of traced sources."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kiln.compile.cache.entry import MANIFEST, CacheEntry
from kiln.compile.cache.source_keys import KEYS_DIR
from kiln.compile.cache.store import cache_root, check_root, private_dir, write_atomic
from kiln.compile.monitor import logger

# The root's folders that are not entries: the traced-sources index, Triton's kernel cache
# (kiln.compile.cache.triton_kernels), kiln prewarm's tuning (kiln.ops.triton.gemv_configs),
# its builds of kiln's C++ CPU kernels (kiln.ops.cpu.extension) and torch's and Triton's source
# keys (kiln.compile.cache.source_keys).
CPU_KERNELS = "cpu_kernels"
NOT_ENTRIES = ("index", "triton", "tuning", CPU_KERNELS, KEYS_DIR)


@dataclass
class CacheRoot:
    path: Path = field(default_factory=cache_root)

    def ensure(self) -> None:
        """The root exists, made 0700 if new; one someone else could write is refused."""
        check_root(self.path)
        private_dir(self.path)

    def entry(self, key: str) -> CacheEntry:
        return CacheEntry(self.path / key, key)

    def entries(self) -> list[CacheEntry]:
        if not self.path.is_dir():
            return []
        return [self.entry(p.name) for p in sorted(self.path.iterdir())
                if p.is_dir() and p.name not in NOT_ENTRIES and not p.name.startswith(".")]

    def find(self, prefix: str) -> CacheEntry:
        """The entry whose key starts with `prefix` (as git takes a short hash)."""
        found = [e for e in self.entries() if e.key.startswith(prefix)]
        if len(found) != 1:
            raise ValueError(f"{'no' if not found else len(found)} cache entries match {prefix!r} in {self.path}")
        return found[0]

    def has_entry_for(self, model: str, device_type: str) -> bool:
        """Whether an entry of `model` (its manifest's name) on `device_type` is here: a cheap
        guess that a start will be warm, made before the key can be computed."""
        return bool(self.entries_for(model, device_type))

    def entries_for(self, model: str, device_type: str) -> list[Path]:
        """The folders of `model`'s entries on `device_type`, the last written (a warm start
        rewrites its manifest) first."""
        found = []
        for manifest in self.path.glob("*/" + MANIFEST) if self.path.is_dir() else ():
            try:
                info = json.loads(manifest.read_text())
                written = manifest.stat().st_mtime
            except (OSError, ValueError):
                continue
            if isinstance(info, dict) and info.get("model") == model and info.get("graph") and \
                    str(info.get("device", "")).split(":")[0] == device_type:
                found.append((written, manifest.parent))
        return [folder for _, folder in sorted(found, reverse=True)]

    def read_index(self, prekey: str) -> list[str] | None:
        """The sources the last capture under `prekey` traced; None if it has not run (or
        its index file is damaged: logged and removed, so the next capture writes it again)."""
        path = self.path / "index" / f"{prekey}.json"
        try:
            sources = json.loads(path.read_text())["sources"]
            if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
                raise ValueError("sources is not a list of names")
            return sources
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("compile cache: index %s is damaged (%s: %s); removing it, the next capture "
                           "writes it again", path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            return None

    def write_index(self, prekey: str, sources: list[str]) -> None:
        self.ensure()
        write_atomic(self.path / "index" / f"{prekey}.json", json.dumps({"sources": sources}, indent=1).encode())


