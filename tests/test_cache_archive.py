"""`kiln cache export` / `import`: one file carries a start's artifacts to a fresh cache root
(and fresh Inductor and Triton caches), which then starts warm; a damaged, truncated or
foreign archive is refused and leaves nothing behind."""

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
from cache_process import run_python as _run, start

from kiln.compile.cache import CacheRoot
from kiln.compile.cache import archive as cache_archive
from kiln.compile.cache.archive import ARCHIVE_MANIFEST, ArchiveError, export, import_archive

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """tiny-llama's entry compiled into a root that also holds a kernel-cache file and GEMV
    tuning, exported to one archive."""
    where = tmp_path_factory.mktemp("archive")
    root = where / "root"
    _, compiled, _ = start(root)
    kernel = root / "triton" / "ABCDEF" / "kernel.cubin"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"\x7fcubin")
    (root / "tuning").mkdir()
    (root / "tuning" / "gemv.json").write_text(json.dumps({"GPU A|triton 3.6.0|bfloat16": {"64,64,1": [8, 512, 1, 4, 3]}}))
    path = where / "start.tar"
    manifest = export(CacheRoot(root), [compiled.entry.key[:6]], path)
    return path, compiled.entry.key, manifest


def _contents(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def test_an_imported_archive_starts_warm_in_a_fresh_root(exported, tmp_path):
    path, key, manifest = exported
    assert manifest["entries"] == [key] and manifest["models"] == {key: "tiny-llama"}
    assert not any(name.startswith("/") or ".." in name for name in manifest["files"])  # relocatable
    assert "triton/ABCDEF/kernel.cubin" in manifest["files"] and "tuning/gemv.json" in manifest["files"]
    root = tmp_path / "fresh"
    (root / "tuning").mkdir(parents=True)
    (root / "tuning" / "gemv.json").write_text(json.dumps({"GPU B|triton 3.6.0|bfloat16": {"1,1,1": [8, 256, 1, 4, 4]}}))
    import_archive(CacheRoot(root), path)
    assert (root / "triton" / "ABCDEF" / "kernel.cubin").read_bytes() == b"\x7fcubin"
    assert set(json.loads((root / "tuning" / "gemv.json").read_text())) == {"GPU A|triton 3.6.0|bfloat16",
                                                                            "GPU B|triton 3.6.0|bfloat16"}
    assert not [p for p in root.iterdir() if p.name.startswith(".import-")]
    assert [e.key for e in CacheRoot(root).entries()] == [key]  # the kernel and tuning folders are no entries
    # A second process with fresh Inductor and Triton caches finds the entry by its index.
    run = _run(str(HERE / "cache_process.py"), str(root),
               env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "t")})
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["key"] == key and out["stats"]["inductor_compiles"] == 0 and out["stats"]["graphs_seen"] == 0
    assert out["stats"]["pieces_loaded"] == 3 and out["max_error"] <= 1e-4


def _rewritten(path: Path, out: Path, change) -> Path:
    """A copy of the archive with `change(name, data) -> data` applied to each member."""
    with tarfile.open(path) as src, tarfile.open(out, "w") as dst:
        for member in src:
            data = src.extractfile(member).read()
            new = change(member.name, data)
            if new is None:
                continue
            member.size = len(new)
            dst.addfile(member, io.BytesIO(new))
    return out


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "member missing", "stray member"])
def test_a_damaged_archive_is_refused_and_leaves_nothing(exported, tmp_path, damage):
    path, key, _ = exported
    piece = next(n for n in json.loads(tarfile.open(path).extractfile(ARCHIVE_MANIFEST).read())["files"]
                 if "/pieces/" in n)
    bad = tmp_path / "bad.tar"
    if damage == "truncated":
        data = path.read_bytes()
        bad.write_bytes(data[: len(data) * 2 // 3])
        message = "truncated|damaged"
    elif damage == "flipped byte":
        _rewritten(path, bad, lambda n, d: d if n != piece else bytes([d[0] ^ 0xFF]) + d[1:])
        message = "fails its checksum"
    elif damage == "member missing":
        _rewritten(path, bad, lambda n, d: None if n == piece else d)
        message = "truncated: 1 file"
    else:
        with tarfile.open(bad, "w") as tar:
            with tarfile.open(path) as src:
                for member in src:
                    tar.addfile(member, src.extractfile(member))
            info = tarfile.TarInfo("../outside")
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
        message = "is not one the manifest lists"
    root = tmp_path / "root"
    root.mkdir()
    before = _contents(root)
    with pytest.raises(ArchiveError, match=message):
        import_archive(CacheRoot(root), bad)
    assert _contents(root) == before
    assert not (tmp_path / "outside").exists()


def test_an_archive_from_another_environment_is_refused_naming_both_sides(exported, tmp_path, monkeypatch):
    path, _, manifest = exported
    here = dict(cache_archive.environment(), torch="9.9.9", gpu="Some GPU")
    monkeypatch.setattr(cache_archive, "environment", lambda: here)
    with pytest.raises(ArchiveError, match=re.escape(f"torch '{manifest['torch']}' there, '9.9.9' here; gpu None "
                                                     f"there, 'Some GPU' here")):
        import_archive(CacheRoot(tmp_path / "root"), path)
    assert _contents(tmp_path / "root") == []


def test_not_an_archive_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all")
    with pytest.raises(ArchiveError, match="not a readable kiln cache archive"):
        import_archive(CacheRoot(tmp_path / "root"), junk)


def test_prewarm_export_then_import_then_generate_compiles_nothing(tmp_path, seed_cpu_kernels):
    """The command line end to end on the embedded SmolLM2: `kiln prewarm -O2 --export`,
    `kiln cache import` into a fresh root, and `kiln generate -O2` with fresh Inductor and
    Triton caches runs no Dynamo and no Inductor compile."""
    archive = tmp_path / "smollm2.tar"
    seed_cpu_kernels(tmp_path / "a")
    made = _run("-m", "kiln.cli", "prewarm", "-O2", "--export", str(archive),
                env={"KILN_CACHE_ROOT": str(tmp_path / "a"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ia")})
    assert made.returncode == 0, made.stderr
    assert f"wrote {archive}" in made.stdout and "(smollm2)" in made.stdout
    fresh = {"KILN_CACHE_ROOT": str(tmp_path / "b"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ib"),
             "TRITON_CACHE_DIR": str(tmp_path / "tb")}
    imported = _run("-m", "kiln.cli", "cache", "import", str(archive), env=fresh)
    assert imported.returncode == 0, imported.stderr
    # The import recorded torch's source key for this machine: the start below hashes no torch source.
    assert "torch" in {p.name.split("-")[0] for p in (tmp_path / "b" / "source_keys").iterdir()}
    run = _run("-m", "kiln.cli", "generate", "-O2", "--max-tokens", "6", "What is the capital of France?", env=fresh)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "no Dynamo, 0 Inductor compiles" in run.stderr and "Dynamo bytecode transform time" not in run.stderr
