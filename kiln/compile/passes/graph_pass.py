"""A graph pass: one rewrite of Inductor's post-grad graph, switched on by name in the config.

kiln's own passes are listed in kiln.compile.passes.registry; a subclass defined anywhere
else (a test's probe, a user's pass) registers itself under its `name` when its module is
imported. `order` places a pass in the pipeline, whatever the order of the config's list:

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
from typing import ClassVar

from torch import fx

from kiln.compile.passes import fx_edit
from kiln.compile.shapes import TokenShape

_EXTENSIONS: dict[str, type[GraphPass]] = {}  # passes defined outside kiln.compile.passes


class GraphPass:
    name: ClassVar[str]
    order: ClassVar[int]
    # True for a pass that changes what would cross an FX piece boundary (the shape of the
    # residual stream, say): it can only run on the whole graph.
    needs_whole_graph: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name is None or cls.__module__.startswith("kiln.compile.passes."):
            return
        known = _EXTENSIONS.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"graph pass name {name!r} is taken by {known.__module__}.{known.__qualname__}")
        _EXTENSIONS[name] = cls

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


def extension_passes() -> dict[str, type[GraphPass]]:
    return dict(_EXTENSIONS)
