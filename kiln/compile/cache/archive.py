"""One file that carries what a start needs to another machine: `kiln cache export` / `import`.

    <archive>.tar
      kiln-archive.json        what it holds: versions it was made with, a sha256 and size per file
      entries/<key>/...        compile-cache entries (manifest, program, piece artifacts, inductor/)
      triton/...               Triton's kernel cache (kiln's own kernels, compiled for this GPU)
      tuning/...               the GEMV configs kiln prewarm tuned on this GPU

No path inside is absolute, so the archive unpacks into any cache root. Import checks the
versions first (torch, triton, kiln, GPU: a mismatch is refused naming both sides), then
every file against its checksum while it unpacks into a staging directory beside the root;
only when all of it is good does anything move into the root, so a truncated or altered
archive leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import torch

from kiln.compile.cache.entry import MANIFEST, kiln_version
from kiln.compile.cache.key import FACTORS, prekey_of
from kiln.compile.cache.root import CacheRoot
from kiln.compile.cache.store import private_dir, write_atomic
from kiln.compile.cache.triton_kernels import TRITON_DIR

ARCHIVE_MANIFEST = "kiln-archive.json"
FORMAT = 1
TUNING_DIR = "tuning"
# Files that are a process's own while it holds an entry: never exported.
_SKIPPED = ("lock",)


class ArchiveError(ValueError):
    """The archive cannot be imported here; nothing was written."""


def environment() -> dict:
    """What an archive's contents are valid for."""
    try:
        import triton
    except ImportError:  # a CPU-only install: Inductor's C++ kernels need no Triton
        triton = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"kiln": kiln_version(), "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
            "cuda": torch.version.cuda if gpu else None, "gpu": gpu}


def export(root: CacheRoot, keys: list[str], out: Path) -> dict:
    """Write the entries `keys` (unique prefixes), Triton's kernel cache and the tuning files of
    `root` into one tar at `out`; returns its manifest."""
    entries = [root.find(k) for k in keys]
    members: list[tuple[str, Path]] = []
    for entry in entries:
        with entry.lock():
            if not entry.exists():
                raise ValueError(f"cache entry {entry.key} has no manifest; nothing to export")
            members += [(f"entries/{entry.key}/{rel}", path) for rel, path in _files(entry.path)]
    for folder in (TRITON_DIR, TUNING_DIR):
        members += [(f"{folder}/{rel}", path) for rel, path in _files(root.path / folder)]
    manifest = {"format": FORMAT, **environment(), "entries": [e.key for e in entries],
                "models": {e.key: (e.read_manifest() or {}).get("model") for e in entries}, "files": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w") as tar:
            for name, path in members:
                data = path.read_bytes()
                manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            _add(tar, ARCHIVE_MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
            for name, path in members:
                tar.add(path, arcname=name, recursive=False)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return manifest


def import_archive(root: CacheRoot, archive: Path, check_environment: bool = True) -> dict:
    """Unpack `archive` into `root` after checking it whole; returns its manifest."""
    try:
        tar = tarfile.open(archive, "r")
    except (OSError, tarfile.TarError) as e:
        raise ArchiveError(f"{archive} is not a readable kiln cache archive: {e}") from None
    root.ensure()
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=root.path))
    try:
        with tar:
            manifest = _read_manifest(tar, archive)
            if check_environment:
                _check_environment(manifest, archive)
            _unpack(tar, manifest, staging, archive)
        _move_in(root, staging, manifest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest


def _files(folder: Path) -> list[tuple[str, Path]]:
    if not folder.is_dir():
        return []
    return [(p.relative_to(folder).as_posix(), p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name not in _SKIPPED and not p.name.endswith(".tmp")]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), 0o600
    tar.addfile(info, io.BytesIO(data))


def _read_manifest(tar: tarfile.TarFile, archive: Path) -> dict:
    try:
        member = tar.getmember(ARCHIVE_MANIFEST)
        manifest = json.loads(tar.extractfile(member).read())
    except (KeyError, AttributeError, ValueError, tarfile.TarError, OSError) as e:
        raise ArchiveError(f"{archive} has no readable {ARCHIVE_MANIFEST} (not a kiln cache archive, or "
                           f"truncated): {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise ArchiveError(f"{archive}: {ARCHIVE_MANIFEST} is not a format-{FORMAT} kiln archive manifest")
    return manifest


def _check_environment(manifest: dict, archive: Path) -> None:
    here = environment()
    wrong = [f"{name} {manifest.get(name)!r} there, {here[name]!r} here" for name in ("kiln", "torch", "triton", "gpu")
             if manifest.get(name) != here[name]]
    if wrong:
        raise ArchiveError(f"{archive} was made for another environment ({'; '.join(wrong)}): its compiled code "
                           f"would not load here; export it again on a machine like this one")


def _unpack(tar: tarfile.TarFile, manifest: dict, staging: Path, archive: Path) -> None:
    seen = set()
    try:
        for member in tar:
            if member.name == ARCHIVE_MANIFEST:
                continue
            expected = manifest["files"].get(member.name)
            target = (staging / member.name).resolve()
            if expected is None or not member.isfile() or not str(target).startswith(str(staging.resolve()) + os.sep):
                raise ArchiveError(f"{archive}: member {member.name!r} is not one the manifest lists as a file")
            data = tar.extractfile(member).read()
            if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
                raise ArchiveError(f"{archive}: {member.name} fails its checksum (the archive was altered or "
                                   f"truncated); nothing was imported")
            private_dir(target.parent)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            seen.add(member.name)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ArchiveError(f"{archive} is damaged or truncated ({type(e).__name__}: {e}); nothing was imported") from None
    missing = sorted(set(manifest["files"]) - seen)
    if missing:
        raise ArchiveError(f"{archive} is truncated: {len(missing)} file(s) the manifest lists are absent "
                           f"(first: {missing[0]}); nothing was imported")
    for key in manifest.get("entries", []):
        absent = [name for name in (MANIFEST, *(f"{f}.json" for f in FACTORS))
                  if not (staging / "entries" / key / name).is_file()]
        if absent:
            raise ArchiveError(f"{archive}: entry {key} lacks {', '.join(absent)}; nothing was imported")


def _move_in(root: CacheRoot, staging: Path, manifest: dict) -> None:
    """Everything checked: entries replace any of the same key whole; kernel and tuning
    files join what the root has; each entry's index is written, for a warm start to find."""
    for key in manifest["entries"]:
        entry = root.entry(key)
        with entry.lock():
            for child in list(entry.path.iterdir()):
                if child.name not in _SKIPPED:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
            for child in (staging / "entries" / key).iterdir():
                os.replace(child, entry.path / child.name)
        _write_index(root, entry.path)
    for folder in (TRITON_DIR,):
        for rel, path in _files(staging / folder):
            target = root.path / folder / rel
            private_dir(target.parent)
            os.replace(path, target)
    for rel, path in _files(staging / TUNING_DIR):
        _merge_json(path, root.path / TUNING_DIR / rel)


def _write_index(root: CacheRoot, entry_path: Path) -> None:
    """The index a warm start reads to find the entry: its pre-key and traced sources, both
    read back from the entry's own factor files."""
    factors = {name: json.loads((entry_path / f"{name}.json").read_text()) for name in FACTORS}
    root.write_index(prekey_of(factors), sorted(factors["code"]))


def _merge_json(new: Path, target: Path) -> None:
    try:
        kept = json.loads(target.read_text())
    except (OSError, ValueError):
        kept = {}
    incoming = json.loads(new.read_text())
    for key, value in incoming.items():
        kept[key] = {**kept.get(key, {}), **value} if isinstance(value, dict) else value
    write_atomic(target, json.dumps(kept, indent=1, sort_keys=True).encode())
