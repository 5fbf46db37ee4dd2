"""The cache's file store: where the root is, atomic writes, checksums, and entry locks.

    $KILN_CACHE_ROOT                  default ~/.cache/kiln, mode 0700
      index/<prekey>.json             the source files the last capture traced (see key)
      <key>/                          one entry (see entry)

KILN_DISABLE_COMPILE_CACHE=1 turns the cache off.
"""

from __future__ import annotations

import contextlib
import errno
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


# What a write meets on a volume that has no room (or no right) for it: the cache is given up
# for this process, not the start.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}
_warned_no_room = False


def no_room(error: BaseException) -> OSError | None:
    """The out-of-space OSError behind `error` (a compiler may wrap it), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _NO_ROOM:
            return error
        error = error.__cause__ or error.__context__
    return None


def warn_no_room(error: OSError, what: str) -> None:
    """One warning a process: the cache cannot be written, the start goes on without it."""
    global _warned_no_room
    if not _warned_no_room:
        _warned_no_room = True
        logger.warning("compile cache: cannot write %s (%s); this process keeps nothing in the cache and "
                       "compiles as if it were off. Free space under %s (or point KILN_CACHE_ROOT elsewhere)",
                       what, os.strerror(error.errno), cache_root())


def sha256_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def private_dir(path: Path) -> Path:
    """`path` and every missing parent, each made with mode 0700 (as ssh treats ~/.ssh)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:  # another process made it first
            continue
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
    return path


def make_private(folder: Path) -> None:
    """Every directory under `folder` 0700 and every file 0600: what Inductor and Triton wrote
    there with their own modes."""
    for path in [folder, *folder.rglob("*")] if folder.exists() else []:
        if not path.is_symlink():
            os.chmod(path, 0o700 if path.is_dir() else 0o600)


def write_atomic(path: Path, data: bytes) -> None:
    """Write a temporary file beside `path`, then rename it over: readers see all or nothing."""
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # e.g. the volume is full: leave no partial file behind
        tmp.unlink(missing_ok=True)
        raise


def check_root(path: Path) -> None:
    """Refuse a cache root that someone else could write: its entries hold pickles that a
    start loads, which is running whatever code they hold."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise ValueError(f"the compile cache root {path} belongs to another user (uid {st.st_uid}, this process "
                         f"runs as {os.geteuid()}); a start unpickles what is there, so kiln will not use it. "
                         f"Set KILN_CACHE_ROOT to a directory of your own")
    if st.st_mode & 0o022:
        raise ValueError(f"the compile cache root {path} is writable by group or others (mode "
                         f"{oct(st.st_mode & 0o777)}); a start unpickles what is there, so kiln will not use it. "
                         f"Fix it with `chmod 700 {path}`, or set KILN_CACHE_ROOT to a directory of your own")


class EntryBusy(Exception):
    """Another process holds an entry's lock (EntryLock.hold(wait=False))."""


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
    def hold(self, wait: bool = True):
        """wait=False: raise EntryBusy at once if another process holds the lock."""
        with self.mutex:
            if self.depth == 0:
                self.fd = self._acquire(wait)
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0:
                    os.close(self.fd)  # releases the flock
                    self.fd = None

    def _acquire(self, wait: bool) -> int:
        while True:
            private_dir(self.path.parent)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    raise EntryBusy(self.path.parent) from None
                logger.info("compile cache: waiting for another process to finish with %s", self.path.parent)
                fcntl.flock(fd, fcntl.LOCK_EX)
            # `kiln cache clear` may have removed the entry while this process waited.
            if self.path.exists() and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                return fd
            os.close(fd)


