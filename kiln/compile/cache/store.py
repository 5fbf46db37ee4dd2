"""The cache's file store: where the root is, atomic writes, checksums, and entry locks.

    $KILN_CACHE_ROOT                  default ~/.cache/kiln, mode 0700
      index/<prekey>.json             the source files the last capture traced (see key)
      <key>/                          one entry (see entry)

KILN_DISABLE_COMPILE_CACHE=1 turns the cache off.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from pathlib import Path

from kiln.compile.monitor import logger


def cache_root() -> Path:
    return Path(os.environ.get("KILN_CACHE_ROOT") or Path.home() / ".cache" / "kiln").expanduser()


def cache_disabled() -> bool:
    return os.environ.get("KILN_DISABLE_COMPILE_CACHE", "").strip().lower() not in ("", "0", "false", "no")


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write a temporary file beside `path`, then rename it over: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EntryLock:
    """An exclusive flock on <entry>/lock, re-entrant within a process (a second flock on
    a new descriptor of the same file would wait for the first forever)."""

    _locks: dict[Path, "EntryLock"] = {}
    _guard = threading.Lock()

    def __init__(self, path: Path):
        self.path, self.depth, self.fd = path, 0, None
        self.mutex = threading.RLock()

    @classmethod
    def of(cls, path: Path) -> "EntryLock":
        with cls._guard:
            return cls._locks.setdefault(path, cls(path))

    @contextlib.contextmanager
    def hold(self):
        with self.mutex:
            if self.depth == 0:
                self.fd = self._acquire()
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    os.close(self.fd)  # releases the flock
                    self.fd = None

    def _acquire(self) -> int:
        while True:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                logger.info("compile cache: waiting for another process to finish with %s", self.path.parent)
                fcntl.flock(fd, fcntl.LOCK_EX)
            # `kiln cache clear` may have removed the entry while this process waited.
            if self.path.exists() and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                return fd
            os.close(fd)


