"""AOT packages (kiln.compile.aot_piece): `kiln prewarm --aot` packages every piece, each checked
bitwise against its Inductor artifact; an engine that starts from them imports neither Dynamo nor
Inductor and generates the tokens the Inductor artifacts generate; a damaged package is dropped
for its artifact. Plus the key's parts that make such a start possible without Inductor."""

import importlib.util
import json
import shutil

import pytest
import torch
from cache_process import MAX_TOKENS, max_error, run_python, start
from torch import fx

from kiln.compile.aot_piece import PackageMismatch, check_package
from kiln.compile.cache.entry import packaged
from kiln.compile.cache.key import _module_source, compiler_factor
from kiln.compile.piece_input import TOKENS, PieceInput
from kiln.compile.shapes import TokenShape

PREWARM = ["-m", "kiln.cli", "prewarm", "--model", "tiny-llama", "--device", "cpu",
           "--max-num-batched-tokens", str(MAX_TOKENS)]

# An engine on the root, greedy tokens for three prompts (one longer than a decode step), and what it imported.
GENERATE = f"""
import json, sys
from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig
llm = LLM("tiny-llama", device="cpu", max_num_batched_tokens={MAX_TOKENS},
          compilation_config=CompilationConfig.level(2))
outs = llm.generate([[5, 9, 2], list(range(3, 40)), [7] * 11], SamplingParams(max_tokens=12, temperature=0),
                    use_tqdm=False)
stats = llm.engine.runner.compiled.stats
print(json.dumps({{"tokens": [o.outputs[0].token_ids for o in outs], "packages_loaded": stats["packages_loaded"],
                  "pieces_loaded": stats["pieces_loaded"], "inductor_compiles": stats["inductor_compiles"],
                  "graphs_seen": stats["graphs_seen"],
                  "imported": sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)}}))
"""


def _generate(root):
    run = run_python("-c", GENERATE, env={"KILN_CACHE_ROOT": str(root)})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


@pytest.fixture(scope="module")
def prewarmed(tmp_path_factory, cpu_kernels_dir):
    """A cache root that `kiln prewarm --aot` filled, and its report."""
    root = tmp_path_factory.mktemp("aot") / "root"
    if cpu_kernels_dir is not None:
        from kiln.compile.cache.root import CPU_KERNELS

        shutil.copytree(cpu_kernels_dir, root / CPU_KERNELS, dirs_exist_ok=True)
    run = run_python(*PREWARM, "--aot", env={"KILN_CACHE_ROOT": str(root)}, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return root, run.stdout


def _entry(root):
    return next(p for p in root.iterdir() if (p / "manifest.json").exists())


def test_prewarm_aot_packages_every_piece_and_checks_each(prewarmed):
    root, report = prewarmed
    assert "AOT packages: 3 built" in report and "starts load them without Dynamo or Inductor" in report
    assert "not packaged" not in report
    manifest = json.loads((_entry(root) / "manifest.json").read_text())
    assert packaged(manifest)
    packages = [f for f in manifest["files"] if f.endswith(".aot.pt2")]
    assert len(packages) == 3 and all(manifest["files"][f] for f in packages)  # each with its checksum
    listed = run_python("-m", "kiln.cli", "cache", "ls", env={"KILN_CACHE_ROOT": str(root)})
    assert "complete+aot" in listed.stdout, listed.stdout


def test_a_start_from_packages_imports_neither_dynamo_nor_inductor_and_generates_the_same_tokens(prewarmed, tmp_path):
    root, _ = prewarmed
    aot, _ = _generate(root)
    assert aot["packages_loaded"] == 3 and aot["pieces_loaded"] == 3
    assert aot["inductor_compiles"] == 0 and aot["graphs_seen"] == 0
    assert aot["imported"] == []
    # The same entry without its packages: Inductor's artifacts serve, and say the same tokens.
    inductor, _ = _generate(_without_packages(root, tmp_path))
    assert inductor["packages_loaded"] == 0 and inductor["pieces_loaded"] == 3 and inductor["inductor_compiles"] == 0
    assert "torch._inductor" in inductor["imported"]
    assert aot["tokens"] == inductor["tokens"]


def _without_packages(root, tmp_path):
    """A copy of `root` whose entry lists no package (its Inductor artifacts serve)."""
    plain = tmp_path / "root"
    shutil.copytree(root, plain)
    manifest_path = _entry(plain) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for rel in [rel for rel in manifest["files"] if rel.endswith(".aot.pt2")]:
        del manifest["files"][rel]
    manifest_path.write_text(json.dumps(manifest))
    return plain


def test_a_piece_aotinductor_fails_on_is_reported_and_keeps_its_artifact(prewarmed, tmp_path, monkeypatch):
    import kiln.compile.aot_piece

    def fail(*args):
        raise RuntimeError("C++ compile failed\nthe compiler's output")

    monkeypatch.setattr(kiln.compile.aot_piece, "build_package", fail)
    root = _without_packages(prewarmed[0], tmp_path)
    model, compiled, _ = start(root)
    report = compiled.package_pieces()
    assert report["packages"] == 0 and len(report["refused"]) == 3
    assert all(why == "AOTInductor failed (RuntimeError: C++ compile failed)" for why in report["refused"].values())
    assert not compiled.entry.packaged() and compiled.entry.complete()
    assert not list((_entry(root) / "pieces").glob("*.aot.pt2*"))  # nothing half-written left
    assert max_error(model, compiled) <= 1e-4


def test_a_damaged_package_is_dropped_and_its_inductor_artifact_serves(prewarmed, tmp_path):
    root, _ = prewarmed
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    package = sorted((_entry(copy) / "pieces").glob("*.aot.pt2"))[1]
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    out, log = _generate(copy)
    assert f"{package} fails its checksum" in log
    assert out["packages_loaded"] == 2 and out["pieces_loaded"] == 3 and out["inductor_compiles"] == 0
    reference, _ = _generate(root)
    assert out["tokens"] == reference["tokens"]
    assert not packaged(json.loads((_entry(copy) / "manifest.json").read_text()))


def _double(x):
    return x * 2


def test_a_package_whose_output_differs_from_its_artifact_is_refused():
    graph = fx.symbolic_trace(_double)
    inputs = [PieceInput("tensor", torch.float32, torch.device("cpu"), (TOKENS, 4), (4, 1))]
    check_package(lambda x: (x * 2,), lambda x: (x * 2,), graph, inputs, TokenShape(1, 8))
    with pytest.raises(PackageMismatch, match="output 0 at 1 tokens differs"):
        check_package(lambda x: (x * 2 + 1e-6,), lambda x: (x * 2,), graph, inputs, TokenShape(1, 8))


def test_the_compiler_factor_needs_no_inductor_import_and_sees_its_changes():
    code = ("import sys, torch\nfrom kiln.compile.cache.key import compiler_factor\n"
            "f = compiler_factor(torch.device('cpu'))\n"
            "print(f['inductor_changes'], 'torch._inductor' in sys.modules, f['inductor_env'])")
    run = run_python("-c", code, env={"CXX": "g++"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["{}", "False", "{'CXX':", "'g++'}"]
    import torch._inductor.config

    before = compiler_factor(torch.device("cpu"))
    with torch._inductor.config.patch(max_autotune=not torch._inductor.config.max_autotune):
        changed = compiler_factor(torch.device("cpu"))
    assert changed["inductor_changes"] == {"max_autotune": not torch._inductor.config.max_autotune}
    assert compiler_factor(torch.device("cpu")) == before  # a patch undone leaves no trace


def test_the_compiler_factor_does_not_see_kilns_own_patches_in_any_thread():
    """torch 2.11's patches are global: the ISA probes' patch, held by the preload thread while
    the main thread made the key, gave a prewarm an entry its starts never found."""
    import threading

    import torch._inductor.config

    from kiln.compile.inductor_patches import patched

    before = compiler_factor(torch.device("cpu"))
    setting = {"max_autotune": not torch._inductor.config.max_autotune}
    with patched(setting), patched({"cpp.vec_isa_ok": True}):
        assert compiler_factor(torch.device("cpu")) == before
    entered, release = threading.Event(), threading.Event()

    def hold():
        with patched(setting):
            entered.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(30)
        assert compiler_factor(torch.device("cpu")) == before
    finally:
        release.set()
        holder.join()
    with torch._inductor.config.patch(setting):  # a patch of someone else's still counts
        assert compiler_factor(torch.device("cpu"))["inductor_changes"] == setting


@pytest.mark.parametrize("name", ["torch._dynamo.polyfills.builtins", "torch.nn.modules.container",
                                  "torch._higher_order_ops.invoke_subgraph", "kiln.ops.norm", "torch._inductor"])
def test_a_traced_modules_source_is_found_without_importing_its_package(name):
    found = run_python("-c", f"import sys, torch, kiln\nfrom kiln.compile.cache.key import _module_source\n"
                             f"print(_module_source({name!r}), {name.rpartition('.')[0]!r} in sys.modules)")
    assert found.returncode == 0, found.stderr
    path, parent_imported = found.stdout.split()
    assert path == importlib.util.find_spec(name).origin
    if name.startswith("torch._dynamo"):
        assert parent_imported == "False"
    assert _module_source("torch.no_such_module") is None


def test_prewarm_aot_is_refused_without_a_piecewise_compile(tmp_path):
    run = run_python(*PREWARM, "-O0", "--aot", env={"KILN_CACHE_ROOT": str(tmp_path)})
    assert run.returncode != 0
    assert "--aot packages the pieces of a piecewise compile (-O1..-O3); mode 0 has none" in run.stderr


def test_prewarm_aot_is_refused_on_cuda_before_anything_starts(monkeypatch):
    import argparse

    import kiln.config
    from kiln.tools import prewarm

    monkeypatch.setattr(kiln.config, "has_cuda_gpu", lambda: True)
    monkeypatch.setattr(prewarm, "prewarm", lambda *a, **k: pytest.fail("prewarm started"))
    commands = argparse.ArgumentParser().add_subparsers()
    prewarm.register(commands)
    args = commands.choices["prewarm"].parse_args(["--model", "tiny-llama", "--device", "cuda", "-O2", "--aot"])
    with pytest.raises(ValueError, match="AOT packages are not made for CUDA: .*prewarm without --aot"):
        prewarm.run(args)
