"""One cache entry: its manifest, the checksum of every file, repair of what fails it, and
the artifacts it holds (the split program, a piece artifact per unique piece and shape).

      <key>/                          one entry
        lock                          held (flock) by any process reading or writing the entry
        manifest.json                 what the entry holds, and a sha256 of every other file
        env.json config.json code.json compiler.json   the key's factors, readable
        computation_graph.py          the split graph as Python, to read
        graph.pkl                     the split graph, its pieces and how to call it, to load
        pieces/piece<i>.<shape>.<compiler>.bin   an artifact per unique piece and token shape
        pieces/piece<i>.<shape>.aot.pt2          its AOTInductor package, where kiln prewarm --aot made one
        inductor/                     TORCHINDUCTOR_CACHE_DIR while the entry compiles or loads:
                                      on CPU an artifact does not carry its built .so, this does

A file that fails its checksum is logged with its path and rebuilt, never loaded.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kiln.compile.cache import graph_pickle
from kiln.compile.cache.key import FACTORS
from kiln.compile.cache.store import EntryBusy, EntryLock, make_private, no_room, private_dir, sha256_file, write_atomic
from kiln.compile.gc_pause import collector_paused
from kiln.compile.inductor_patches import patched
from kiln.compile.monitor import logger
from kiln.compile.shapes import TokenShape

MANIFEST = "manifest.json"
GRAPH = "graph.pkl"
READABLE_GRAPH = "computation_graph.py"
INDUCTOR = "inductor"
MAX_GRAPH_BYTES = 256 * 2**20
# Inductor rewrites these from the artifact on every load (or keeps locks and temporary
# files there), so they are not the entry's to check.
_RESTORED_ON_LOAD = ("fxgraph", "aotautograd", "triton", "locks", "cache")


class CacheEntry:
    """One directory of the cache. Every method that touches files runs under its lock."""

    def __init__(self, path: Path, key: str):
        self.path, self.key = path, key
        self.manifest: dict = {}
        self.warm = False  # loaded at start-up: from then on a compile is a miss worth a warning
        # part of a warm start -> seconds, measured here ("open.verify", "pieces.load", ...)
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def _timed(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start

    @property
    def model_name(self) -> str:
        return self.manifest.get("model") or "the model"

    @contextlib.contextmanager
    def lock(self, wait: bool = True):
        lock = EntryLock.of(self.path / "lock")
        with lock.hold(wait):
            if lock.depth == 1 and self.manifest:
                self._refresh()  # another process may have written since this one last held it
            yield

    def exists(self) -> bool:
        return (self.path / MANIFEST).exists()

    # -- opening: read, check, repair ---------------------------------------------------

    def open(self, factors: dict, info: dict) -> None:
        """Read the manifest and check every file; create the entry if it is new or unreadable."""
        with self.lock():
            manifest = self.read_manifest(repair=True)
            if manifest is None:
                manifest = self._create(info)
            manifest["plan"] = _merge_plan(manifest.get("plan"), info.get("plan"))
            self.manifest = manifest
            with self._timed("open.verify"):
                bad = self.bad_files()
            self._repair(bad)
            for name in FACTORS:  # new, or failed its checksum: this process knows them
                if f"{name}.json" not in manifest["files"]:
                    self._write_file(f"{name}.json", json.dumps(factors[name], indent=1, sort_keys=True).encode())
            with self._timed("open.write_manifest"):
                self._write_manifest()

    def read_manifest(self, repair: bool = False) -> dict | None:
        path = self.path / MANIFEST
        if not path.exists():
            return None
        try:
            manifest = json.loads(path.read_text())
            if not isinstance(manifest, dict) or manifest.get("key") != self.key:
                raise ValueError("not this entry's manifest")
            return manifest
        except (OSError, ValueError) as e:
            if not repair:
                raise ValueError(f"{path} is unreadable: {e}") from None
            logger.warning("compile cache: manifest %s is unreadable (%s); rebuilding the entry", path, e)
            self._wipe()
            return None

    def _create(self, info: dict) -> dict:
        private_dir(self.path)
        now = _now()
        return {"key": self.key, "kiln": kiln_version(), **info, "created": now, "updated": now,
                "shapes": {}, "graph": None, "files": {}, "file_sizes": {}}

    def bad_files(self) -> list[str]:
        return [rel for rel, digest in self.manifest.get("files", {}).items()
                if sha256_file(self.path / rel) != digest]

    def _repair(self, bad: list[str]) -> None:
        for rel in bad:
            logger.warning("compile cache: %s fails its checksum (corrupted, truncated or missing); "
                           "rebuilding it", self.path / rel)
            self._forget(rel)
        if any(rel.startswith(INDUCTOR + "/") for rel in bad):
            # Which artifact needs which built file is Inductor's secret: rebuild them all.
            for rel in [r for r in self.manifest["files"] if r.startswith((INDUCTOR + "/", "pieces/"))]:
                self._forget(rel)
            shutil.rmtree(self.path / INDUCTOR, ignore_errors=True)
        if GRAPH in bad or READABLE_GRAPH in bad:
            self._forget(GRAPH)
            self._forget(READABLE_GRAPH)
            self.manifest["graph"] = None

    def _forget(self, rel: str) -> None:
        self.manifest["files"].pop(rel, None)
        self.manifest.setdefault("file_sizes", {}).pop(rel, None)
        with contextlib.suppress(FileNotFoundError):
            (self.path / rel).unlink()

    def _wipe(self) -> None:
        for child in self.path.iterdir():
            if child.name != "lock":
                shutil.rmtree(child) if child.is_dir() else child.unlink()

    # -- writing ------------------------------------------------------------------------

    def _write_file(self, rel: str, data: bytes) -> None:
        write_atomic(self.path / rel, data)
        self._record(rel, hashlib.sha256(data).hexdigest(), len(data))

    def _record(self, rel: str, digest: str | None, size: int | None = None) -> None:
        """A file of the entry, its checksum and size (what `complete` and `verify` check)."""
        path = self.path / rel
        if size is None:
            os.chmod(path, 0o600)  # written by Inductor or a worker with their own mode
            size = path.stat().st_size
        self.manifest["files"][rel] = digest
        self.manifest.setdefault("file_sizes", {})[rel] = size

    def _write_manifest(self) -> None:
        shapes = [TokenShape(s["lo"], s["hi"]) for s in self.manifest["shapes"].values() if self._has_shape(s)]
        self.manifest["ranges"] = sorted([s.lo, s.hi] for s in shapes if not s.is_size)
        self.manifest["sizes"] = sorted(s.lo for s in shapes if s.is_size)
        self.manifest["updated"] = _now()
        write_atomic(self.path / MANIFEST, json.dumps(self.manifest, indent=1, sort_keys=True).encode())

    def _refresh(self) -> None:
        with contextlib.suppress(ValueError):  # unreadable now: keep what was read at open
            self.manifest = self.read_manifest() or self.manifest

    def save_program(self, program, readable: str) -> None:
        try:
            data = graph_pickle.dumps(program)
        except Exception as e:  # a node whose target will not pickle: torch's way, its code re-traced at load
            logger.debug("compile cache: the split graph keeps its code, not its nodes (%s: %s)", type(e).__name__, e)
            data = pickle.dumps(program, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_GRAPH_BYTES:  # weights baked into the graph as constants: not worth a file
            logger.warning("compile cache: the split graph pickles to %.0f MiB (constants in the graph?); "
                           "not kept, so a warm start will run Dynamo", len(data) / 2**20)
            return
        with self.lock():
            self._write_file(GRAPH, data)
            self._write_file(READABLE_GRAPH, readable.encode())
            self.manifest["graph"] = {"file": GRAPH, "bytes": len(data), **program.summary()}
            self._write_manifest()

    def load_program(self):
        """The pickled split program, or None if there is none (or it fails its checksum)."""
        with self.lock():
            if not self.manifest.get("graph"):
                return None
            with self._timed("program.read_verify"):
                data = (self.path / GRAPH).read_bytes()
                good = hashlib.sha256(data).hexdigest() == self.manifest["files"].get(GRAPH)
            if not good:
                self._repair([GRAPH])
                self._write_manifest()
                return None
            try:
                with self._timed("program.unpickle"), collector_paused():
                    return pickle.loads(data)
            except Exception as e:  # e.g. an op or module it names is gone from this install
                logger.warning("compile cache: %s could not be loaded (%s: %s); capturing again",
                               self.path / GRAPH, type(e).__name__, e)
                self._repair([GRAPH])
                self._write_manifest()
                return None

    # -- pieces ---------------------------------------------------------------------------

    def artifact(self, index: int, shape: TokenShape) -> str:
        return f"pieces/piece{index}.{shape_tag(shape)}.inductor.bin"  # the only piece compiler with artifacts

    def load_piece(self, index: int, shape: TokenShape) -> Callable | None:
        """The artifact of unique piece `index` for `shape`; None if absent or bad (then removed)."""
        rel = self.artifact(index, shape)
        if not self._checked(rel):
            return None
        try:
            return self._load_artifact(rel)
        except Exception as e:  # a valid checksum over bytes this torch cannot read
            logger.warning("compile cache: %s could not be loaded (%s: %s); rebuilding it",
                           self.path / rel, type(e).__name__, e)
            self._forget(rel)
            self._write_manifest()
            return None

    def _load_artifact(self, rel: str) -> Callable:
        import torch._inductor

        with self.loader_dirs(), self._timed("pieces.inductor_load"), collector_paused():
            return torch._inductor.CompiledArtifact.load(path=str(self.path / rel), format="binary")

    def save_piece(self, index: int, shape: TokenShape, artifact) -> None:
        rel = self.artifact(index, shape)
        target = self.path / rel
        private_dir(target.parent)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            artifact.save(path=str(tmp), format="binary")
        except Exception as e:  # e.g. a graph AOTAutograd will not cache: run it, but keep nothing
            tmp.unlink(missing_ok=True)
            if no_room(e) is not None:
                raise  # the volume is full: the caller stops using the cache
            logger.warning("compile cache: cannot keep %s (%s: %s); it will compile again on the next start",
                           target, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return
        os.replace(tmp, target)
        self._record(rel, sha256_file(target))

    def adopt_piece(self, index: int, shape: TokenShape, saved: Path) -> None:
        """Take in an artifact another process saved at `saved` (in this entry's directory)."""
        target = self.path / self.artifact(index, shape)
        os.replace(saved, target)
        self._record(self.artifact(index, shape), sha256_file(target))

    # -- AOT packages (kiln.compile.aot_piece) -------------------------------------------------

    def package(self, index: int, shape: TokenShape) -> str:
        return _package_of(self.artifact(index, shape))

    def package_path(self, index: int, shape: TokenShape) -> Path | None:
        """The checked package of unique piece `index` for `shape`; None if absent or bad (then removed)."""
        rel = self.package(index, shape)
        return self.path / rel if self._checked(rel) else None

    def _checked(self, rel: str) -> bool:
        """Whether piece file `rel` is listed and passes its checksum (a failing one is repaired)."""
        if rel not in self.manifest["files"]:
            return False
        with self._timed("pieces.verify"):
            good = sha256_file(self.path / rel) == self.manifest["files"][rel]
        if not good:
            self._repair([rel])
            self._write_manifest()
        return good

    def save_package(self, index: int, shape: TokenShape, build: Callable[[Path], None]) -> Path:
        """`build(path)` writes the package; kept under its name once it is whole."""
        rel = self.package(index, shape)
        target = self.path / rel
        private_dir(target.parent)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp.pt2")
        try:
            build(tmp)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        self._record(rel, sha256_file(target))
        self._write_manifest()
        return target

    def forget_package(self, index: int, shape: TokenShape) -> None:
        self._forget(self.package(index, shape))
        self._write_manifest()

    def shape_done(self, shape: TokenShape, size_hint: int, num_pieces: int) -> None:
        """Record `shape` and the built files Inductor left for it; write the manifest."""
        self.manifest["shapes"][shape_tag(shape)] = {
            "lo": shape.lo, "hi": shape.hi, "size_hint": size_hint,
            "artifacts": [self.artifact(i, shape) for i in range(num_pieces)]}
        inductor = self.path / INDUCTOR
        make_private(inductor)
        for path in sorted(inductor.rglob("*")) if inductor.exists() else []:
            rel = path.relative_to(self.path).as_posix()
            if path.is_file() and rel not in self.manifest["files"] and _kept(path.relative_to(inductor)):
                self._record(rel, sha256_file(path))
        self._write_manifest()

    def has_shape(self, shape: TokenShape) -> bool:
        record = self.manifest.get("shapes", {}).get(shape_tag(shape))
        return record is not None and self._has_shape(record)

    def _has_shape(self, record: dict) -> bool:
        return all(rel in self.manifest["files"] for rel in record["artifacts"])

    def packaged(self) -> bool:
        """Every shape held has a package for every piece: a warm start needs no Inductor."""
        return packaged(self.manifest)

    # -- Inductor's directories -------------------------------------------------------------

    @contextlib.contextmanager
    def compiler_dirs(self):
        """Inductor compiles into this entry's own cache dir (so the built .so files are here)."""
        probe = self.path not in _PROBED and str(self.manifest.get("device", "cpu")).startswith("cpu")
        if probe:
            _PROBED.add(self.path)
            # Before Inductor's dir is set: the probes' thread sets (and at its end restores) it too.
            with self._timed("pieces.isa_probe"):
                probe = not _adopt_probes_ahead(self.path / INDUCTOR)
        with _inductor_dir(self.path):
            if probe:
                with self._timed("pieces.isa_probe"):
                    probe_isa_here()
            yield

    @contextlib.contextmanager
    def loader_dirs(self):
        # One thread: loading compiles nothing, and a worker pool would only cost start-up.
        with self.compiler_dirs(), patched({"compile_threads": 1}):
            yield

    # -- what `kiln cache` shows ------------------------------------------------------------

    def coverage(self) -> dict:
        shapes = [s for s in self.manifest.get("shapes", {}).values() if self._has_shape(s)]
        plan = self.manifest.get("plan") or {}
        wanted = {shape_tag(TokenShape(*r)) for r in plan.get("ranges", [])} | \
                 {shape_tag(TokenShape(n, n)) for n in plan.get("sizes", [])}
        have = {shape_tag(TokenShape(s["lo"], s["hi"])) for s in shapes}
        needs_artifacts = self.manifest.get("piece_compiler", "inductor") == "inductor"
        return {"ranges": sorted([s["lo"], s["hi"]] for s in shapes if s["lo"] != s["hi"]),
                "sizes": sorted(s["lo"] for s in shapes if s["lo"] == s["hi"]),
                "capture_sizes": self.manifest.get("capture_sizes", []),
                "missing": sorted(wanted - have) if needs_artifacts else [],
                "graph": bool(self.manifest.get("graph"))}

    def complete(self) -> bool:
        """Every shape the plan wants is held, and every listed file is there at its recorded size."""
        cover = self.coverage()
        return cover["graph"] and not cover["missing"] and not self.absent_files()

    def absent_files(self) -> list[str]:
        """Listed files that are gone or have another size than recorded (cheap: no checksum)."""
        sizes = self.manifest.get("file_sizes", {})
        absent = []
        for rel in self.manifest.get("files", {}):
            try:
                size = (self.path / rel).stat().st_size
            except OSError:
                absent.append(rel)
                continue
            if rel in sizes and sizes[rel] != size:
                absent.append(rel)
        return absent

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())

    def clear(self) -> None:
        with self.lock():
            doomed = self.path.with_name(f".{self.key}.removing.{os.getpid()}")
            os.replace(self.path, doomed)  # atomic: no reader sees half an entry
        shutil.rmtree(doomed, ignore_errors=True)


_PROBED: set[Path] = set()  # entries whose Inductor dir holds this process's ISA probes


@contextlib.contextmanager
def _inductor_dir(path: Path):
    """Inductor's cache dir set to the entry at `path`'s own."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    # The base vector ISA is taken from the CPU's flags instead of probed with a compiler
    # run and a subprocess per ISA; compile and load must agree, as the ISA is in the .so's name.
    with temporary_cache_dir(str(path / INDUCTOR)), patched({"cpp.vec_isa_ok": True}):
        yield


def probe_isa_in(path: Path) -> None:
    """The probes of the entry at `path` (what its compiler_dirs would run first), ahead of its
    warm start: the compile preload runs them while the weights load, since most of their time
    is spent waiting on a subprocess per ISA extension."""
    with _inductor_dir(path):
        probe_isa_here()
    _PROBED.add(path)


def load_pieces_in(path: Path) -> None:
    """Load every piece artifact of the entry at `path` once and drop them, ahead of its warm
    start: the compile preload runs this while the weights load. The first load of C++ kernels
    in a process runs the compiler's preprocessor over Inductor's precompiled header, to check
    that it is current (a subprocess, ~0.15 s on a 2-core CPU); Inductor keeps the check's
    result for the process, so the warm start's own loads then take milliseconds. What is
    missing or fails its checksum is left to the warm start, which reports and rebuilds it; and
    an entry another process is writing now (a prewarm, a shape compiled while serving) is left
    alone rather than waited for: this start may well not use it."""
    entry = CacheEntry(path, path.name)
    try:
        with entry.lock(wait=False):
            entry.manifest = entry.read_manifest() or {}
            files = entry.manifest.get("files", {})
            for record in entry.manifest.get("shapes", {}).values():
                for rel in record["artifacts"]:
                    if rel in files and sha256_file(path / rel) == files[rel]:
                        entry._load_artifact(rel)
    except EntryBusy:
        logger.debug("compile preload: %s is busy; its pieces are not loaded ahead", path)


_ahead: tuple[threading.Thread, Path] | None = None  # probe_isa_ahead's thread and its scratch dir


def probe_isa_ahead() -> None:
    """A cold capture's entry is known only after Dynamo has traced, but most of its probes' time
    (~2 s on a 2-core CPU) is a subprocess per ISA extension: run them now on a thread, in a scratch
    dir, while the weights load and Dynamo traces; the entry's compiler_dirs then waits for them and
    takes their files. The Inductor modules the probes use are imported here, on the caller's thread
    (two threads importing the same circular modules can deadlock)."""
    global _ahead
    for module in ("torch._inductor.codecache", "torch._inductor.cpp_builder", "torch._inductor.cpu_vec_isa"):
        importlib.import_module(module)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-isa-probes-"))
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)  # if no entry ever takes them
    thread = threading.Thread(target=probe_isa_in, args=(scratch,), name="kiln-isa-probes", daemon=True)
    thread.start()
    _ahead = (thread, scratch)


def _adopt_probes_ahead(inductor: Path) -> bool:
    """Wait for probe_isa_ahead's probes and copy their files into `inductor` (an entry's Inductor
    dir); False if none were started."""
    global _ahead
    if _ahead is None:
        return False
    (thread, scratch), _ahead = _ahead, None
    thread.join()
    try:
        if not (scratch / INDUCTOR).is_dir():
            return False  # they did not run (another torch): the entry probes for itself
        shutil.copytree(scratch / INDUCTOR, inductor, dirs_exist_ok=True, copy_function=_copy_if_absent)
        return True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _copy_if_absent(source: str, target: str) -> None:
    """Never over a file the entry has (its manifest may hold that file's checksum: another process
    filling the entry probed first), and whole or not at all."""
    if not os.path.exists(target):
        partial = f"{target}.{os.getpid()}.tmp"
        shutil.copy2(source, partial)
        os.replace(partial, target)


def probe_isa_here() -> None:
    """Inductor still probes ISA extensions (AVX-512 BF16, VNNI, AMX) by building tiny .so
    files in the current cache dir, once per process. A warm start repeats the probes in the
    entry's dir and must find those files there, or it runs the C++ compiler: so the probes
    are forgotten and run again inside each entry (guarded: these are Inductor internals)."""
    try:
        from torch._inductor import cpu_vec_isa

        classes = {c for isa in cpu_vec_isa.supported_vec_isa_list for c in type(isa).__mro__}
        for cls in classes:
            for attr in vars(cls).values():
                getattr(attr, "cache_clear", lambda: None)()
        for isa in cpu_vec_isa.supported_vec_isa_list:  # probe results kept on the instances
            for name in [n for n in vars(isa) if n.startswith("_is_") and n.endswith("_supported")]:
                delattr(isa, name)
        cpu_vec_isa.valid_vec_isa_list.cache_clear()
        cpu_vec_isa.pick_vec_isa()
    except Exception as e:  # another torch: the probes then land wherever Inductor puts them
        logger.debug("compile cache: could not re-run Inductor's ISA probes: %s", e)


def packaged(manifest: dict) -> bool:
    """Whether an entry's manifest holds a package for every piece of every shape it holds."""
    files, shapes = manifest.get("files", {}), manifest.get("shapes", {}).values()
    held = [s for s in shapes if all(rel in files for rel in s.get("artifacts", []))]
    return bool(held) and all(_package_of(rel) in files for s in held for rel in s["artifacts"])


def _package_of(artifact: str) -> str:
    """The AOT package's name beside a piece's Inductor artifact."""
    return artifact.removesuffix(".inductor.bin") + ".aot.pt2"


def shape_tag(shape: TokenShape) -> str:
    return f"size-{shape.lo}" if shape.is_size else f"range-{shape.lo}-{shape.hi}"


def _kept(rel: Path) -> bool:
    # A .best_config is Triton's autotuning result, which Inductor (re)writes when a kernel
    # first runs, after the shape was recorded: checksumming it would fail every warm start.
    return rel.parts[0] not in _RESTORED_ON_LOAD and not rel.name.startswith(".") and not rel.name.endswith(
        (".lock", ".tmp", ".best_config"))


def _merge_plan(old: dict | None, new: dict | None) -> dict:
    old, new = old or {}, new or {}
    ranges = {tuple(r) for r in old.get("ranges", []) + new.get("ranges", [])}
    sizes = set(old.get("sizes", []) + new.get("sizes", []))
    return {"ranges": sorted(list(r) for r in ranges), "sizes": sorted(sizes)}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def kiln_version() -> str:
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
