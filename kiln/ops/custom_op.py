"""Ops with two implementations, and which one a model gets.

Every op here has a native PyTorch reference (plain tensor math: what Dynamo traces and
Inductor fuses) and a kernel path (an opaque `torch.ops.kiln.*` op: a fused Triton kernel
on CUDA; on the CPU kiln's C++ kernel or prepacked matmul where there is one (kiln/ops/cpu),
else the same native math). Which path a layer takes is fixed when the layer is
built, from the `custom_ops` list, so the forward never branches on it.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

from torch import nn

from kiln.config import CUSTOM_OPS

_KNOWN: set[str] = set()
_enabled: frozenset[str] | None = None

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
