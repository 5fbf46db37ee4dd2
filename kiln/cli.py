"""`kiln generate | serve | ...`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="'smollm2' (embedded default), a .gguf file, an HF folder, or a random preset")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--custom-ops", default="", help="e.g. 'none,+rms_norm' (one base: all or none)")


def _engine_config(args):
    from kiln.config import EngineConfig

    return EngineConfig(
        compilation=args.compilation, model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        custom_ops=[s for s in args.custom_ops.split(",") if s])


def cmd_generate(args) -> int:
    from kiln.config import DEFAULT_FORWARD_REASON
    from kiln.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    engine = LLMEngine(_engine_config(args))
    if args.no_chat or engine.tokenizer.chat_template is None:
        prompt = engine.tokenizer.encode(args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.tokenizer.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    engine.add_request(prompt, params)
    printed, num_tokens = 0, 0
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.text[printed:])
            sys.stdout.flush()
            printed, num_tokens = len(out.text), len(out.token_ids)
    elapsed = time.perf_counter() - start
    print()
    print(f"[kiln] {num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s "
          f"(model {engine.source.name}, {engine.runner.device}, {str(engine.runner.dtype).removeprefix('torch.')}, "
          f"start-up {engine.timeline.ready_seconds:.1f} s; forward "
          f"{engine.runner.compiled.describe() if args.compilation else DEFAULT_FORWARD_REASON})",
          file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from kiln.engine.timeline import StartupTimeline

    timeline = StartupTimeline()  # before the server's imports, so /health times them too
    from kiln.server.run import serve

    return serve(_engine_config(args), args.host, args.port, args.served_model_name, args.shutdown_timeout,
                 args.access_log, timeline)


def cmd_traffic(args) -> int:
    from kiln.loader import load_source
    from kiln.tools.traffic import render, traffic

    cfg = load_source(args.model).config
    report = traffic(cfg, {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype])
    print(render(args.model, report, args.tokens, args.bandwidth, args.share))
    return 0


def main(argv: list[str] | None = None) -> int:
    from kiln.config import parse_compilation_args

    parser = argparse.ArgumentParser(prog="kiln", description=__doc__,
                                     epilog="Compilation: -O0..-O3, -cc.<key>=<value>, "
                                            "--compilation-config '<json>', --enforce-eager")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt (chat template applied)")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--system", default=None, help="a system message for the chat template")
    gen.add_argument("--no-chat", action="store_true", help="send the prompt as plain text")
    _engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/chat/completions, /health, /metrics)")
    serve.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds open requests may take to finish on SIGTERM before they are aborted")
    serve.add_argument("--access-log", action="store_true", help="log every HTTP request")
    _engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    try:
        # -O<n>, -cc.<key>=<value>, --compilation-config and --enforce-eager are not argparse-shaped.
        rest, compilation = parse_compilation_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        parser.error(str(e))
    explicit = rest != (sys.argv[1:] if argv is None else argv)
    traf = sub.add_parser("traffic", help="logical-bytes model of fused add+RMSNorm vs its decomposition")
    traf.add_argument("--model", default="llama-3-8b", help="a preset, .gguf or HF folder (only its shape is read)")
    traf.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    traf.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024])
    traf.add_argument("--bandwidth", type=float, default=3.35, help="memory bandwidth in TB/s for the floor")
    traf.add_argument("--share", type=float, nargs="+", default=[0.1, 0.25],
                      help="report the token count where extra elementwise bytes reach this share of weight bytes")
    traf.set_defaults(func=cmd_traffic)
    args = parser.parse_args(rest)
    args.compilation = compilation if explicit else None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
