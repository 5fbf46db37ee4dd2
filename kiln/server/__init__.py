"""`kiln serve`: the OpenAI-compatible HTTP API over the engine."""

from kiln.server.app import build_app

__all__ = ["build_app"]
