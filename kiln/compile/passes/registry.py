"""Every graph pass kiln knows, by name: the built-in ones listed here, plus any GraphPass
subclass defined outside kiln (a test's probe, a user's own pass), which registers itself.

A pass names the ops it matches by their torch.ops names (torch.ops.kiln.*), so no pass
imports the ops, the models or the distributed package.
"""

from __future__ import annotations

from kiln.compile.passes.fuse_add_rms_norm import FuseAddRMSNorm
from kiln.compile.passes.graph_pass import GraphPass, extension_passes
from kiln.compile.passes.noop_elimination import NoOpElimination
from kiln.compile.passes.reinplace import Reinplace
from kiln.compile.passes.sequence_parallel import SequenceParallel

BUILTIN_PASSES: tuple[type[GraphPass], ...] = (NoOpElimination, FuseAddRMSNorm, SequenceParallel, Reinplace)


def registry() -> dict[str, type[GraphPass]]:
    passes = {cls.name: cls for cls in BUILTIN_PASSES}
    for name, cls in extension_passes().items():
        if name in passes and passes[name] is not cls:
            raise ValueError(f"graph pass name {name!r} is taken by {passes[name].__module__}."
                             f"{passes[name].__qualname__}")
        passes[name] = cls
    return passes


def known_passes() -> list[str]:
    return sorted(registry())


def pass_class(name: str) -> type[GraphPass]:
    return registry()[name]


def check_pass_names(names: list[str]) -> None:
    """Fail on a name no registered pass answers to, or on a name given twice."""
    known = registry()
    for name in names:
        if not isinstance(name, str) or name not in known:
            raise ValueError(f"compilation passes: {name!r} is not a graph pass; known: {', '.join(sorted(known))}")
    if len(set(names)) != len(names):
        raise ValueError(f"compilation passes lists a pass twice: {names!r}")
