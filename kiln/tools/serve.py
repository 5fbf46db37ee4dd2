"""`kiln serve`: the OpenAI-compatible HTTP server (kiln.server), started from the command line."""

from __future__ import annotations

import argparse

from kiln.config import EngineConfig


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /health, /metrics)")
    # vLLM's form, `vllm serve MODEL`, beside --model.
    p.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                   help="the model to serve, as --model says (vLLM's positional form)")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds open requests may take to finish on SIGTERM before they are aborted")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="larger request bodies get a 413 before they are read (default 4 MiB)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.engine.timeline import StartupTimeline

    timeline = StartupTimeline()  # before the server's imports, so /health times them too
    from kiln.server.run import serve

    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise SystemExit(f"kiln serve: --max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise SystemExit(f"kiln serve: the model is given twice, {args.model_tag!r} and --model {args.model!r}; "
                             f"give one")
        args.model = args.model_tag
    return serve(EngineConfig.from_args(args), args.host, args.port, args.served_model_name, args.shutdown_timeout,
                 args.access_log, timeline, args.max_request_bytes)
