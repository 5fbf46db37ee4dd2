"""The HTTP routes of `kiln serve`, and the app's life: the engine starts after the port opens.

    /health               200 once requests are served, 503 while starting (with the phase), 500 if the engine failed
    /metrics              Prometheus text
    /v1/models            the one served model
    /v1/completions       plain prompt (text or token ids), streaming or not
    /v1/chat/completions  messages through the model's chat template, streaming or not
    /tokenize, /detokenize  vLLM's: a prompt's (or messages') token ids, and ids' text
    /version              kiln's version (vLLM's route)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import kiln

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.timeline import StartupTimeline
from kiln.loader import DEFAULT_MODEL, ModelSource
from kiln.server.body_limit import DEFAULT_MAX_REQUEST_BYTES, BodyLimit
from kiln.server.errors import install_error_handlers
from kiln.server.metrics import ServerMetrics
from kiln.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                  ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from kiln.server.serving import OpenAIServing


def build_app(config: EngineConfig, served_model_name: str | None = None,
              timeline: StartupTimeline | None = None,
              on_failure: Callable[[BaseException], None] | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, source: ModelSource | None = None) -> FastAPI:
    """The app; its engine is built in a background thread when the app starts (lifespan), from
    `source` where the caller loaded the model already."""
    engine = AsyncEngine(config, timeline, source)
    model_name = served_model_name or config.model or DEFAULT_MODEL
    metrics = ServerMetrics(engine)
    serving = OpenAIServing(engine, model_name, metrics)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(on_failure)
        yield
        # Under `kiln serve` the engine was stopped with the shutdown timeout when the signal
        # came (see run.py) and open requests have ended; anything still running is aborted.
        await engine.shutdown(timeout_s=0)

    app = FastAPI(title="kiln", lifespan=lifespan)
    app.state.engine = engine
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    @app.get("/health")
    async def health() -> JSONResponse:
        info = {"model": model_name, **engine.timeline.as_dict()}
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": str(engine.failure), **info}, 500)
        if engine.ready:
            return JSONResponse({"status": "ready", "ready_s": engine.timeline.ready_seconds, **info})
        status = "starting" if engine.engine is None else "shutting_down"
        return JSONResponse({"status": status, **info}, 503, headers={"Retry-After": "1"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": kiln.__version__})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        serving.check_ready()
        return ModelList(data=[ModelCard(id=model_name, created=created,
                                         max_model_len=engine.engine.max_model_len)])

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await serving.complete(request, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(request, raw)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(request)

    return app
