"""kiln's log lines by default, as vLLM prints its own: the `kiln` logger gets a handler of
its own when kiln is imported, so `LLM()` in a script prints the start-up phases and the
compile lines (`torch.compile took X s in total`) with no logging set up.

The handler stands in for an unconfigured root logger: once an application (or the CLI, or
pytest) gives the root logger a handler, kiln's records reach it by propagation and the
stand-in stays quiet, so no line is printed twice. It writes through tqdm, so a log line
never lands inside a progress bar. KILN_LOGGING_LEVEL sets the level (default INFO);
KILN_CONFIGURE_LOGGING=0 leaves kiln's logging entirely to the application.
"""

from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class StandInHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def configure() -> None:
    if os.environ.get("KILN_CONFIGURE_LOGGING", "1").strip().lower() in ("0", "false", "no"):
        return
    logger = logging.getLogger("kiln")
    if any(isinstance(h, StandInHandler) for h in logger.handlers):
        return
    level = os.environ.get("KILN_LOGGING_LEVEL", "INFO").strip().upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"KILN_LOGGING_LEVEL={level!r} is not a logging level; use DEBUG, INFO, WARNING or ERROR")
    logger.setLevel(level)
    handler = StandInHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    logger.addHandler(handler)
