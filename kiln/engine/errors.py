"""Faults the engine cannot run past."""


class EngineDead(RuntimeError):
    """The engine lost something it cannot serve without (a tensor-parallel worker): every open
    request fails with this message, and the engine must be built again (kiln serve exits 1, so
    that whatever started it can start it again)."""
