"""Run the app under uvicorn, with a shutdown that ends every open request cleanly.

On SIGTERM or SIGINT the engine stops taking requests at once and gives the running ones
`shutdown_timeout` seconds; what is still running then is aborted, so each stream ends
with an error event instead of a cut connection. Meanwhile uvicorn closes the listening
socket and waits for the open responses to end.
"""

from __future__ import annotations

import logging

import uvicorn

from kiln.compile.gc_pause import collector_paused
from kiln.config import EngineConfig
from kiln.engine.runner import start_compile_workers_ahead
from kiln.engine.timeline import StartupTimeline
from kiln.loader import load_source
from kiln.server.app import build_app

logger = logging.getLogger("kiln")

# uvicorn's own deadline comes later than the engine's: by then every stream has ended.
_UVICORN_GRACE_S = 5.0


def serve(config: EngineConfig, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          shutdown_timeout: float = 30.0, access_log: bool = False,
          timeline: StartupTimeline | None = None, max_request_bytes: int | None = None) -> int:
    """Serve until a signal; returns the exit code (1 if the engine failed)."""
    server: _Server | None = None

    def exit_on_failure(error: BaseException) -> None:  # a server that cannot serve should not linger
        server.should_exit = True

    limit = {} if max_request_bytes is None else {"max_request_bytes": max_request_bytes}
    # The engine is built on a thread beside uvicorn's loop, and compile workers fork only from a
    # process with one thread: a cold start's are started here, now.
    try:
        with collector_paused():
            source = load_source(config.model)
        start_compile_workers_ahead(config, source)
    except Exception:  # only a head start: the engine's own start does both again, and says why they fail
        source = None
    app = build_app(config, served_model_name, timeline, exit_on_failure, source=source, **limit)
    engine = app.state.engine

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            engine.stop(shutdown_timeout)
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, host=host, port=port, log_config=None, access_log=access_log,
                                    timeout_graceful_shutdown=shutdown_timeout + _UVICORN_GRACE_S))
    server.run()
    if engine.failure is not None:
        logger.error("exiting: the engine failed: %s", engine.failure)
        return 1
    return 0
