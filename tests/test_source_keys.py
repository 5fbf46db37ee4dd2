"""torch's and Triton's source keys recorded in the cache root (kiln.compile.cache.source_keys):
taken back only while the files they hash are unchanged, and never computed then."""

import functools
import os
import subprocess
import sys
import textwrap
import types

from kiln.compile.cache import source_keys
from kiln.compile.cache.root import CacheRoot


def _package(tmp_path):
    package = tmp_path / "pkg"
    (package / "_C").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    (package / "notes.txt").write_text("not hashed")
    return package


def test_fingerprint_follows_the_hashed_files_sizes_and_times_only(tmp_path):
    package = _package(tmp_path)
    mark = source_keys.fingerprint(package, "1.0", (".py", ".so"))
    assert source_keys.fingerprint(package, "1.0", (".py", ".so")) == mark
    (package / "notes.txt").write_text("edited, but not a file a key reads")
    assert source_keys.fingerprint(package, "1.0", (".py", ".so")) == mark
    assert source_keys.fingerprint(package, "1.1", (".py", ".so")) != mark
    library = package / "_C" / "libtriton.so"
    st = library.stat()
    os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    touched = source_keys.fingerprint(package, "1.0", (".py", ".so"))
    assert touched != mark
    library.write_bytes(b"\0" * 65)  # a reinstall of another size
    os.utime(library, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert source_keys.fingerprint(package, "1.0", (".py", ".so")) not in (mark, touched)


def _fake_triton(monkeypatch, package, calls):
    """A stand-in for the triton modules that hold triton_key: the tests neither depend on whether
    Triton is installed nor pay its real key's 416 MB hash."""
    @functools.lru_cache()
    def triton_key():
        calls.append(1)
        return "computed-key"

    triton = types.ModuleType("triton")
    triton.__file__, triton.__version__ = str(package / "__init__.py"), "3.6.0"
    runtime, cache, autotuner = (types.ModuleType(f"triton.runtime{name}") for name in ("", ".cache", ".autotuner"))
    cache.triton_key = autotuner.triton_key = triton_key
    triton.runtime, runtime.cache, runtime.autotuner = runtime, cache, autotuner
    for name, module in [("triton", triton), ("triton.runtime", runtime), ("triton.runtime.cache", cache),
                         ("triton.runtime.autotuner", autotuner)]:
        monkeypatch.setitem(sys.modules, name, module)
    return cache, autotuner


def test_triton_key_is_recorded_then_taken_back_without_computing(tmp_path, monkeypatch):
    package, root = _package(tmp_path), tmp_path / "root"
    calls = []
    cache, _ = _fake_triton(monkeypatch, package, calls)
    assert source_keys.triton_key(root) == "computed-key" and len(calls) == 1
    assert [p.name.split("-")[0] for p in (root / source_keys.KEYS_DIR).iterdir()] == ["triton"]

    calls = []  # a later process: its own modules, nothing computed yet
    cache, autotuner = _fake_triton(monkeypatch, package, calls)
    (root / source_keys.KEYS_DIR / os.listdir(root / source_keys.KEYS_DIR)[0]).write_text("recorded-key")
    assert source_keys.triton_key(root) == "recorded-key"
    assert cache.triton_key() == autotuner.triton_key() == "recorded-key"
    # A second engine in that process finds the holders already pointed at the record.
    assert source_keys.triton_key(root) == "recorded-key"
    assert cache.triton_key() == autotuner.triton_key() == "recorded-key"
    assert calls == []


def test_a_changed_triton_install_computes_its_key_again(tmp_path, monkeypatch):
    package, root = _package(tmp_path), tmp_path / "root"
    _fake_triton(monkeypatch, package, [])
    source_keys.triton_key(root)
    (package / "_C" / "libtriton.so").write_bytes(b"\1" * 80)  # reinstalled
    calls = []
    cache, _ = _fake_triton(monkeypatch, package, calls)
    assert source_keys.triton_key(root) == "computed-key" and len(calls) == 1
    assert len(os.listdir(root / source_keys.KEYS_DIR)) == 2


def test_no_root_computes_and_records_nothing(tmp_path, monkeypatch):
    calls = []
    _fake_triton(monkeypatch, _package(tmp_path), calls)
    assert source_keys.triton_key(None) == "computed-key" and len(calls) == 1


def test_torch_key_is_taken_back_from_the_record_in_a_fresh_process(tmp_path):
    """In a fresh process (this one may have computed torch_key already): a record for torch's
    files as they are is what Inductor's torch_key() then returns."""
    root = tmp_path / "root"
    code = textwrap.dedent(f"""
        from pathlib import Path
        import torch
        from torch._inductor import codecache
        from kiln.compile.cache import source_keys
        root = Path({str(root)!r})
        if not (root / source_keys.KEYS_DIR).exists():
            source_keys.torch_key(root)  # computed and recorded
            [record] = (root / source_keys.KEYS_DIR).iterdir()
            assert record.read_text() == codecache.torch_key().hex()
            record.write_text("not hex")  # damaged: computed and written again
            source_keys.torch_key(root)
            assert record.read_text() == codecache.torch_key().hex()
            record.write_text("00ff")  # what the next process must take, not compute
        else:
            source_keys.torch_key(root)
            assert codecache.torch_key() == bytes.fromhex("00ff"), codecache.torch_key()
        print("ok")
    """)
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_the_keys_folder_is_not_an_entry(tmp_path):
    root = tmp_path / "root"
    source_keys.record(root)
    assert "torch" in {p.name.split("-")[0] for p in (root / source_keys.KEYS_DIR).iterdir()}
    assert CacheRoot(root).entries() == []


def test_a_root_it_cannot_write_in_leaves_the_key_computed(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    (root / source_keys.KEYS_DIR).write_text("a file where the folder would go")
    calls = []
    _fake_triton(monkeypatch, _package(tmp_path), calls)
    assert source_keys.triton_key(root) == "computed-key" and len(calls) == 1
    assert source_keys.triton_key(root) == "computed-key" and len(calls) == 1  # cached in the process
