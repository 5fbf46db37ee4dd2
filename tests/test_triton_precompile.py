"""kiln.compile.triton_precompile without a GPU: kernels compiled for sm_90 in worker processes
(all at once, or each as the hook records it) land in Triton's cache dir under the key the
parent's own compile looks up, and the launch hook records a missing kernel (and skips it, its
later launches without a cache lookup) but lets a cached one through.

Triton's launch path needs a GPU driver, so the hook is called the way JITFunction._do_compile
calls it, with the specialization a launch of the RMSNorm kernel would have. The checks run
in a process outside interpret mode (the package's other tests run Triton's interpreter).
"""

import json
import os
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("triton")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_workers_fill_the_cache_the_parent_reads():
    root = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as cache_dir:
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=cache_dir,
                   PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
        result = subprocess.run([sys.executable, os.path.abspath(__file__), "precompile"], env=env, cwd=root,
                                capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checked" in result.stdout


def _check() -> None:
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile
    from triton.compiler.compiler import make_backend

    from kiln.compile.triton_precompile import KernelCompiler, MissingKernels, in_cache
    from kiln.compile.triton_worker import source_and_options
    from kiln.ops.triton.kernels.norm import fused_add_rms_norm_kernel, rms_norm_kernel

    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4})

    def launch(kernel, block: int, recorder: MissingKernels):
        """What JITFunction.run hands the hook for a launch with 16-aligned pointers and strides."""
        signature, constexprs, attrs = {}, {}, {}
        for index, name in enumerate(kernel.arg_names):
            if name == "BLOCK":
                signature[name], constexprs[(index,)] = "constexpr", block
            elif name.endswith("_ptr"):
                signature[name], attrs[(index,)] = "*bf16", [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32" if name == "eps" else "i32"
        return kernel._call_hook(recorder._hook, (block, tuple(signature.values())), signature, 0, constexprs, options, [attrs],
                                 False)

    import kiln.compile.triton_precompile as precompile

    def compile_all(launches, workers=None):
        compiler = KernelCompiler(target, knobs.cache.dir, workers)
        for launch in launches:
            compiler.submit(launch)
        return compiler.finish()

    lookups = []
    real_in_cache = precompile.in_cache
    precompile.in_cache = lambda *args: lookups.append(args) or real_in_cache(*args)
    recorder = MissingKernels(target)
    assert launch(rms_norm_kernel, 4096, recorder) is True  # nothing cached: recorded and skipped
    assert launch(rms_norm_kernel, 4096, recorder) is True
    assert len(lookups) == 1  # a recorded kernel's next launch does not look in the cache again
    precompile.in_cache = real_in_cache
    assert launch(rms_norm_kernel, 2048, recorder) is True
    assert launch(fused_add_rms_norm_kernel, 4096, recorder) is True
    assert len(recorder.launches) == 3, recorder.launches  # one per specialization
    done = compile_all(list(recorder.launches.values()), workers=2)
    assert done == {**done, "compiled": 3, "failed": 0, "workers": 2}, done
    assert sorted(name for name, _, _ in done["kernels"]) == ["fused_add_rms_norm_kernel", "rms_norm_kernel",
                                                              "rms_norm_kernel"], done["kernels"]
    assert all(0 <= submitted <= finished <= done["seconds"] for _, submitted, finished in done["kernels"])

    # The parent finds each in the cache: the hook lets the launch through, and Triton's own
    # compile of the same specialization is a cache hit, not a compile.
    again = MissingKernels(target)
    for kernel, block in ((rms_norm_kernel, 4096), (rms_norm_kernel, 2048), (fused_add_rms_norm_kernel, 4096)):
        assert launch(kernel, block, again) is False
    assert not again.launches
    hits = []
    knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: hits.append(cache_hit)
    for launch_record in recorder.launches.values():
        fn = rms_norm_kernel if launch_record.name == "rms_norm_kernel" else fused_add_rms_norm_kernel
        src, opts = source_and_options(fn, launch_record.specialization)
        assert in_cache(fn, launch_record.specialization, target)
        triton_compile(src, target=target, options=opts)
    assert hits == [True, True, True], hits

    # Streamed: a recorder with a compiler hands each launch over as it records it, and the
    # compiles are done when the compiler finishes.
    # The recorder puts a stand-in that launches nothing into the kernel's in-memory cache (what
    # Triton's launch looks in first, here made by hand: no driver), and takes it out once compiled.
    kernels = {}
    rms_norm_kernel.device_caches[0] = (kernels, {}, None, None, None)
    streamed = MissingKernels(target)
    streamed.compiler = KernelCompiler(target, knobs.cache.dir, workers=2)
    assert launch(rms_norm_kernel, 1024, streamed) is True
    assert launch(fused_add_rms_norm_kernel, 2048, streamed) is True
    assert launch(rms_norm_kernel, 1024, streamed) is True  # recorded once, submitted once
    assert len(kernels) == 1 and next(iter(kernels))[0] == 1024  # the launch's key (the helper's: block first)
    stand_in = kernels[next(iter(kernels))]
    assert stand_in.launch_metadata((1,), 0) is None and stand_in.run(1, 1, 1, 0) is None
    done = streamed.compiler.finish()
    assert done == {**done, "compiled": 2, "failed": 0, "workers": 2}, done
    streamed.compiled()
    assert kernels == {} and not streamed.launches
    del rms_norm_kernel.device_caches[0]
    for kernel, block in ((rms_norm_kernel, 1024), (fused_add_rms_norm_kernel, 2048)):
        assert launch(kernel, block, MissingKernels(target)) is False

    # The workers key their cache entries with the parent's Triton key, which they do not compute
    # again: given another, a worker's kernel lands where the parent never looks.
    fresh = MissingKernels(target)
    assert launch(rms_norm_kernel, 512, fresh) is True
    (fresh_launch,) = fresh.launches.values()
    compiler = KernelCompiler(target, knobs.cache.dir, workers=1)
    compiler.header = compiler.header.replace(json.loads(compiler.header)["triton_key"], "another-triton-key")
    compiler.submit(fresh_launch)
    assert compiler.finish()["compiled"] == 1
    assert not in_cache(rms_norm_kernel, fresh_launch.specialization, target)
    assert compile_all([fresh_launch])["compiled"] == 1
    assert in_cache(rms_norm_kernel, fresh_launch.specialization, target)

    # A kernel the worker cannot load is counted as failed (it would compile at its launch).
    broken = next(iter(recorder.launches.values()))
    broken = type(broken)(broken.module, "/nonexistent/kernels.py", broken.name, broken.specialization)
    done = compile_all([broken])
    assert (done["compiled"], done["failed"]) == (0, 1), done
    print("checked")


if __name__ == "__main__" and sys.argv[1:] == ["precompile"]:
    _check()
