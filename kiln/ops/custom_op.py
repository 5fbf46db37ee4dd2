"""Ops with two implementations, and which one a model gets.

Every op here has a native PyTorch reference (plain tensor math: what Dynamo traces and
Inductor fuses) and a kernel path (an opaque `torch.ops.kiln.*` op: a fused Triton kernel
on CUDA, the same native math on CPU). Which path a layer takes is fixed when the layer is
built, from the `custom_ops` list, so the forward never branches on it.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

from torch import nn

_KNOWN: set[str] = set()
_enabled: frozenset[str] | None = None

BASES = ("all", "none")
EXAMPLE = '["none", "+rms_norm"]'


def known_ops() -> list[str]:
    return sorted(_KNOWN)


def is_enabled(name: str) -> bool:
    """Whether a layer built now takes the kernel path of op `name`."""
    return _enabled is not None and name in _enabled


def resolve_custom_ops(spec: list[str] | tuple[str, ...] | str, default_base: str) -> frozenset[str]:
    """Turn a `custom_ops` list into the set of op names whose kernel path is on.

    The list holds exactly one base, `all` or `none`, plus `+name` / `-name` overrides;
    an empty list means `[default_base]`.
    """
    if isinstance(spec, str):
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    spec = list(spec) or [default_base]
    bases = [s for s in spec if s in BASES]
    if len(bases) != 1:
        raise ValueError(
            f"custom_ops must hold exactly one base ('all' or 'none'), got {len(bases)} in {spec!r}; "
            f"for example custom_ops={EXAMPLE}"
        )
    enabled = set(_KNOWN) if bases[0] == "all" else set()
    for item in spec:
        if item in BASES:
            continue
        sign, name = item[:1], item[1:]
        if sign not in "+-" or not sign or name not in _KNOWN:
            raise ValueError(
                f"custom_ops entry {item!r} is not '+name' or '-name' with a known op "
                f"({', '.join(known_ops())}); for example custom_ops={EXAMPLE}"
            )
        (enabled.add if sign == "+" else enabled.discard)(name)
    return frozenset(enabled)


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
        _KNOWN.update(cls.__dict__.get("op_names", ()))

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
