"""A graph pass: one rewrite of Inductor's post-grad graph, switched on by name in the config.

A subclass registers itself under its `name` when its module is imported (as CustomOp
subclasses register their op names), so a pass that knows kiln's ops lives next to those
ops and this package stays generic. `order` places it in the pipeline, whatever the order
of the config's list:

    10  clean-up (no-op elimination): later patterns need not see through identity views
    20  fusion (add + RMSNorm)
    30  whole-graph rewrites (sequence parallelism)
    90  re-inplacing: it brings mutation back, and every pass before it expects a
        functional graph
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import TYPE_CHECKING, ClassVar

from torch import fx

from kiln.compile.passes import fx_edit

if TYPE_CHECKING:
    from kiln.compile.pieces import TokenShape

_REGISTRY: dict[str, type[GraphPass]] = {}


class GraphPass:
    name: ClassVar[str]
    order: ClassVar[int]
    # True for a pass that changes what would cross an FX piece boundary (the shape of the
    # residual stream, say): it can only run on the whole graph.
    needs_whole_graph: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is None:
            return
        known = _REGISTRY.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"graph pass name {name!r} is taken by {known.__module__}.{known.__qualname__}")
        _REGISTRY[name] = cls

    def __call__(self, graph: fx.Graph) -> int:
        """Rewrite `graph` in place; return the number of matches rewritten."""
        raise NotImplementedError

    def applies_to(self, shape: TokenShape | None) -> bool:
        """Whether to run when Inductor compiles for `shape` (None: a graph kiln did not
        hand over, e.g. a test calling the manager directly)."""
        return True

    def settings(self) -> dict:
        """What, besides the pass's source code, changes what it does."""
        return {}

    def uuid(self) -> str:
        """Changes whenever the pass's source (its class, the classes it derives from, the
        shared rewrite helpers) or its settings change: a compiled artifact is reused only
        under the same uuid."""
        hasher = hashlib.sha256(json.dumps([self.name, self.settings()], sort_keys=True, default=str).encode())
        files = [inspect.getsourcefile(cls) for cls in type(self).__mro__ if issubclass(cls, GraphPass)]
        for file in dict.fromkeys([*files, fx_edit.__file__]):
            with open(file, "rb") as f:
                hasher.update(f.read())
        return hasher.hexdigest()


def known_passes() -> list[str]:
    return sorted(_REGISTRY)


def pass_class(name: str) -> type[GraphPass]:
    return _REGISTRY[name]


def check_pass_names(names: list[str]) -> None:
    """Fail on a name no registered pass answers to, or on a name given twice."""
    for name in names:
        if not isinstance(name, str) or name not in _REGISTRY:
            raise ValueError(f"compilation passes: {name!r} is not a graph pass; known: {', '.join(known_passes())}")
    if len(set(names)) != len(names):
        raise ValueError(f"compilation passes lists a pass twice: {names!r}")
