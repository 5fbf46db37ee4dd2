"""What Inductor is compiling right now, for passes that apply to some token shapes only.

The piece compiler publishes the piece and its token shape around each compile; the pass
manager, called from deep inside Inductor, reads them here. A context variable, because
nothing in Inductor's call chain carries kiln's own state down to the post-grad hook.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from kiln.compile.shapes import TokenShape


@dataclass(frozen=True)
class CompileTarget:
    piece: str  # the unique piece's name, e.g. "submod_0"
    shape: TokenShape

    @property
    def label(self) -> str:
        """A file-name-safe 'submod_0-size_8' or 'submod_0-range_1_64'."""
        s = self.shape
        return f"{self.piece}-size_{s.lo}" if s.is_size else f"{self.piece}-range_{s.lo}_{s.hi}"


_current: contextvars.ContextVar[CompileTarget | None] = contextvars.ContextVar("kiln_compile_target", default=None)


@contextlib.contextmanager
def compiling(piece: str, shape: TokenShape):
    token = _current.set(CompileTarget(piece, shape))
    try:
        yield
    finally:
        _current.reset(token)


def current_target() -> CompileTarget | None:
    return _current.get()
