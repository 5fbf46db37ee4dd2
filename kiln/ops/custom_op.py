"""Ops with two implementations, and which one a model gets.

Every op here has a native PyTorch reference (plain tensor math: what Dynamo traces and
Inductor fuses) and a kernel path (an opaque `torch.ops.kiln.*` op: a fused Triton kernel
on CUDA; on the CPU kiln's C++ kernel or prepacked matmul where there is one (kiln/ops/cpu),
else the same native math). Which path a layer takes is fixed when the layer is
built, from the `custom_ops` list, so the forward never branches on it. A layer calls its op
through `call`, which outside a compile goes straight to the function torch would run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from kiln.config import CUSTOM_OPS

_KNOWN: set[str] = set()
_enabled: frozenset[str] | None = None
# Per kiln op, the functions torch would run for it: its own (None) and each device's kernel.
_functions: dict[object, dict[str | None, Callable]] = {}
_qualnames: dict[object, str] = {}  # per kiln op, "namespace::name"
# Devices whose dispatch keys get each op's function directly (register_direct_kernels).
DIRECT_DEVICES = {"cpu": "CPU", "cuda": "CUDA"}
_direct_libraries: dict[str, torch.library.Library] = {}
_registered: set[tuple[str, str]] = set()  # (op, dispatch key)

def known_ops() -> list[str]:
    return sorted(_KNOWN)


def is_enabled(name: str) -> bool:
    """Whether a layer built now takes the kernel path of op `name`."""
    return _enabled is not None and name in _enabled


@contextlib.contextmanager
def enabled_custom_ops(names: frozenset[str]):
    """Layers built inside this block take the kernel path for the ops in `names`."""
    global _enabled
    previous, _enabled = _enabled, names
    try:
        yield
    finally:
        _enabled = previous


class CustomOp(nn.Module):
    """A layer whose forward is bound, at construction, to its native or kernel path."""

    # Every op name a subclass lists can be switched in `custom_ops`.
    op_names: ClassVar[tuple[str, ...]]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        names = cls.__dict__.get("op_names", ())
        undeclared = sorted(set(names) - set(CUSTOM_OPS))
        if undeclared:
            raise TypeError(f"{cls.__qualname__} lists op(s) {', '.join(undeclared)} that kiln.config.CUSTOM_OPS "
                            f"does not declare; add them there, so custom_ops can switch them")
        _KNOWN.update(names)

    def __init__(self):
        super().__init__()
        self.uses_kernel = is_enabled(self.op_names[0])

    def forward(self, *args):
        if self.uses_kernel:
            return self.forward_kernel(*args)
        return self.forward_native(*args)

    def forward_native(self, *args):
        raise NotImplementedError

    def forward_kernel(self, *args):
        raise NotImplementedError


def kiln_op(name: str, *, mutates_args):
    """torch.library.custom_op(name), its function also kept for `call`."""

    def define(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        _functions[op] = {None: fn}
        _qualnames[op] = name
        return op

    return define


def kernel(op, device_type: str):
    """The op's kernel on `device_type`, for `call` and (register_direct_kernels) the dispatcher."""

    def register(fn):
        if (_qualnames[op], DIRECT_DEVICES.get(device_type)) in _registered:
            raise RuntimeError(f"{_qualnames[op]}: a {device_type} kernel defined after kiln.ops registered the "
                               f"ops' kernels would reach `call` but not the dispatcher; define it in kiln.ops")
        _functions[op][device_type] = fn
        return fn

    return register


def register_direct_kernels() -> None:
    """Register each kiln op's function for each device straight on that device's dispatch key.

    Compiled code calls the ops through torch's dispatcher (`call`'s shortcut is for eager
    layers). custom_op's register_kernel puts a kernel behind torch's Python wrappers (device
    lookup, the outputs' aliasing check): ~2.3 us more a call on the dev CPU (torch 2.13), and
    6-10% of the engine thread's time in -O2 serving on an H100 host (py-spy), where mixed steps
    too large for a CUDA graph run the compiled pieces. Fake tensors, Dynamo and dispatch modes see the
    op as before. Run once every op and kernel is defined (kiln.ops does); idempotent.
    """
    for op, functions in _functions.items():
        name = _qualnames[op]
        namespace, short = name.split("::")
        library = _direct_libraries.get(namespace)
        if library is None:
            library = _direct_libraries[namespace] = torch.library.Library(namespace, "IMPL")
        for device_type, key in DIRECT_DEVICES.items():
            if (name, key) not in _registered:
                library.impl(short, functions.get(device_type, functions[None]), key)
                _registered.add((name, key))


def call(op, *args):
    """op(*args): outside a compile and any dispatch mode, with a plain tensor first, straight into
    the function torch would run for it there. torch's way to it costs ~30 us a call on the H200
    host (an RMSNorm: 65 us through the op, 35 us for its kernel; ~260 calls per eager forward of
    an 8B model), and its first call imports all of Dynamo (~1 s) that an eager start never uses.
    Dynamo, fake tensors and dispatch modes (breakable graphs, the tests' op counters) see the op."""
    first = args[0]
    if not torch.compiler.is_compiling() and type(first) is torch.Tensor and _get_current_dispatch_mode() is None:
        functions = _functions.get(op)
        if functions is not None:
            return functions.get(first.device.type, functions[None])(*args)
    return op(*args)
