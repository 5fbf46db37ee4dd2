"""kiln.ops.triton.launch on the CPU: a jitted kernel whose Triton launch is a stand-in (there is no
GPU to compile for) and whose binder is Triton's own, so each launch is specialised as on a GPU.
The kernels themselves, launched this way, are checked on the GPU by benchmarks/gpu_kernels.py."""

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kiln.ops.triton import launch as launch_module
from kiln.ops.triton.launch import launch


def _scale(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    pass  # never compiled here


class Variant:
    """A compiled kernel's launch surface: its C launcher, function handle and packed metadata."""

    def __init__(self, index: int):
        self.function, self.packed_metadata, self.calls = f"function {index}", f"metadata {index}", []

    def run(self, *args):
        self.calls.append(args)


STREAM = 777


@pytest.fixture
def kernel(monkeypatch):
    """A JITFunction on "device 0" whose launch through Triton records the grid and the
    specialisation and returns a new variant."""
    jitted = JITFunction(_scale)
    binder = create_function_from_signature(jitted.signature, jitted.params, BaseBackend)
    jitted.device_caches = {0: ({}, {}, None, None, binder)}
    jitted.through_triton = []
    jitted.variants = []

    def run(*args, grid, warmup, **kwargs):
        _, specialization, _ = binder(*args, **kwargs)
        jitted.through_triton.append((grid, specialization))
        jitted.variants.append(Variant(len(jitted.variants)))
        return jitted.variants[-1]

    jitted.run = run
    monkeypatch.setattr(launch_module, "_driver", [lambda: 0, lambda device: STREAM])
    monkeypatch.setattr(launch_module, "_binders", {})
    monkeypatch.setattr(launch_module, "_variants", {})
    return jitted


def test_a_known_variant_is_launched_directly_with_every_argument_in_signature_order(kernel):
    x, out = torch.zeros(64), torch.zeros(64)
    launch(kernel, (4,), x, out, 64, 0.5, BLOCK=16, num_warps=4)
    assert len(kernel.through_triton) == 1 and kernel.variants[0].calls == []
    # A float is not specialised on: another scale is the same variant.
    launch(kernel, (5, 2), x, out, 64, 0.25, BLOCK=16, num_warps=4)
    launch(kernel, (3, 1, 2), out, x, 48, 1.0, BLOCK=16, num_warps=4)
    assert len(kernel.through_triton) == 1
    variant = kernel.variants[0]
    assert variant.calls == [
        (5, 2, 1, STREAM, "function 0", "metadata 0", None, None, None, x, out, 64, 0.25, 16),
        (3, 1, 2, STREAM, "function 0", "metadata 0", None, None, None, out, x, 48, 1.0, 16),
    ]


@pytest.mark.parametrize("change", ["misaligned pointer", "n is 1", "n not a multiple of 16", "n past int32",
                                    "another constexpr", "another option", "an option more"])
def test_a_launch_specialised_otherwise_goes_through_triton_once_then_directly(kernel, change):
    x, out = torch.zeros(64), torch.zeros(64)
    args, kwargs = [x, out, 64, 0.5], {"BLOCK": 16, "num_warps": 4}
    launch(kernel, (1,), *args, **kwargs)
    if change == "misaligned pointer":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "n is 1":
        args[2] = 1
    elif change == "n not a multiple of 16":
        args[2] = 63
    elif change == "n past int32":
        args[2] = 2**40
    elif change == "another constexpr":
        kwargs["BLOCK"] = 32
    elif change == "another option":
        kwargs["num_warps"] = 8
    else:
        kwargs["num_stages"] = 2
    launch(kernel, (1,), *args, **kwargs)
    assert len(kernel.through_triton) == 2
    # Options (warps, stages) are not in the specialisation, yet pick another variant too.
    options_only = change in ("another option", "an option more")
    assert (kernel.through_triton[0][1] == kernel.through_triton[1][1]) == options_only
    launch(kernel, (2,), *args, **kwargs)
    launch(kernel, (3,), x, out, 64, 0.5, BLOCK=16, num_warps=4)
    assert len(kernel.through_triton) == 2
    assert [call[:3] for call in kernel.variants[1].calls] == [(2, 1, 1)]
    assert [call[:3] for call in kernel.variants[0].calls] == [(3, 1, 1)]


def test_a_grid_function_sees_every_argument_by_name(kernel):
    x, out = torch.zeros(64), torch.zeros(64)

    def grid(meta):
        return (triton.cdiv(meta["n"], meta["BLOCK"]), 2)

    launch(kernel, grid, x, out, 48, 0.5, BLOCK=16)
    launch(kernel, grid, x, out, 80, 0.5, BLOCK=16)
    assert kernel.through_triton[0][0] is grid
    assert [call[:3] for call in kernel.variants[0].calls] == [(5, 2, 1)]


def test_with_a_launch_hook_set_every_launch_goes_through_triton(kernel):
    x, out = torch.zeros(64), torch.zeros(64)
    launch(kernel, (1,), x, out, 64, 0.5, BLOCK=16)
    hooks = triton.knobs.runtime.launch_exit_hook  # a profiler's, say
    hook = lambda metadata: None  # noqa: E731
    hooks.add(hook)
    try:
        launch(kernel, (1,), x, out, 64, 0.5, BLOCK=16)
    finally:
        hooks.remove(hook)
    assert len(kernel.through_triton) == 2 and kernel.variants[0].calls == []
    # The hook is gone: the variant is launched directly again.
    launch(kernel, (1,), x, out, 64, 0.5, BLOCK=16)
    assert len(kernel.through_triton) == 2 and kernel.variants[1].calls != []


def test_pre_run_hooks_or_a_kernel_without_device_caches_keep_every_launch_in_triton(kernel):
    x, out = torch.zeros(64), torch.zeros(64)
    kernel.pre_run_hooks.append(lambda *args, **kwargs: None)
    for _ in range(2):
        launch(kernel, (1,), x, out, 64, 0.5, BLOCK=16)
    assert len(kernel.through_triton) == 2

    class Interpreted:  # as Triton's interpreter: a kernel with a launch and nothing to look up
        launches = 0

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                Interpreted.launches += 1
            return run

    for _ in range(2):
        launch(Interpreted(), (1,), x, out, 64, 0.5, BLOCK=16)
    assert Interpreted.launches == 2 and launch_module._variants == {}
