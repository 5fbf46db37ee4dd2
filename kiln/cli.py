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
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over N processes kiln starts itself: one per GPU, or gloo processes on CPU")


def _engine_config(args):
    from kiln.config import EngineConfig

    return EngineConfig(
        compilation=args.compilation, model=args.model, device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, kv_cache_gib=args.kv_cache_gib,
        gpu_memory_utilization=args.gpu_memory_utilization,
        custom_ops=[s for s in args.custom_ops.split(",") if s], tensor_parallel_size=args.tensor_parallel_size)


def cmd_generate(args) -> int:
    from kiln.config import DEFAULT_FORWARD_REASON
    from kiln.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    engine = LLMEngine(_engine_config(args))
    if engine.tokenizer is None:
        engine.shutdown()
        raise ValueError(f"model {engine.source.name!r} has no tokenizer (a random-weight preset), so `kiln "
                         f"generate` cannot read the prompt; use the default SmolLM2, a .gguf file or an HF "
                         f"folder (`kiln bench --model {engine.source.name}` times a preset)")
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


def cmd_bisect(args) -> int:
    import json

    from kiln.tools.bisect import bisect_model, render, to_json

    report = bisect_model(args.model, args.prompt, device=args.device, dtype=args.dtype,
                          custom_ops=args.custom_ops, tolerance=args.tolerance, new_tokens=args.tokens,
                          stages=args.stages)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(report), f, indent=2)
        print(f"wrote {args.json}")
    return 0


def cmd_bench(args) -> int:
    import json
    from pathlib import Path

    import torch

    from kiln.tools.bench import Workload, plot, render, run_bench

    device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    workload = Workload.default(device, args.model, batches=args.batches, context=args.context, modes=args.modes,
                                timed_steps=args.steps, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    result = run_bench(workload)
    print(render(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_{Path(workload.model).name}_{device}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(f"wrote {stem.with_suffix('.json')}")
    if not args.no_plot:
        plot(result, str(stem.with_suffix(".png")))
        print(f"wrote {stem.with_suffix('.png')}")
    return 0


def cmd_prewarm(args) -> int:
    from kiln.tools.prewarm import main as prewarm

    return prewarm(args)


def cmd_inspect(args) -> int:
    from kiln.tools.inspect_cmd import main as inspect

    return inspect(args)


def cmd_cache(args) -> int:
    from kiln.tools.cache_cli import main as cache

    return cache(args)


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
    bis = sub.add_parser("bisect", help="first piece and op where Dynamo, AOT-eager or Inductor parts from eager")
    bis.add_argument("--model", default=None, help="'smollm2' (default), a .gguf file, an HF folder, or a preset")
    bis.add_argument("--prompt", default="The capital of France is", help="plain text, no chat template")
    bis.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    bis.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    bis.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per stage")
    bis.add_argument("--tolerance", type=float, default=None,
                     help="relative error |a-b|/|b| allowed (default: fp32 1e-4, bf16 2e-2, fp16 5e-3)")
    bis.add_argument("--custom-ops", default="none", help="op paths the model is built with (default: native)")
    bis.add_argument("--stages", nargs="+", default=None, help="backends to check: aot_eager inductor (dynamo+eager always runs)")
    bis.add_argument("--json", default=None, help="also write the report as JSON here")
    bis.set_defaults(func=cmd_bisect)
    bench = sub.add_parser("bench", help="decode step time: eager, stock torch.compile and kiln modes side by side")
    bench.add_argument("--model", default=None, help="default: smollm2 on CPU, llama-3-8b (random bf16) on CUDA")
    bench.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    bench.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    bench.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 32 (CPU), 1 8 64 256 (CUDA)")
    bench.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (default 128)")
    bench.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    bench.add_argument("--modes", nargs="+", default=None, help="of eager stock once O2 O3 (default: all)")
    bench.add_argument("--out", default=".", help="folder for bench_<model>_<device>.json and .png")
    bench.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    bench.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="run every mode on N processes (one per GPU; gloo processes on CPU)")
    bench.set_defaults(func=cmd_bench)
    warm = sub.add_parser("prewarm", help="compile everything a server needs into the compile cache; "
                                          "print what the entry covers")
    warm.add_argument("--manifest", default=None,
                      help="JSON with compile_ranges, compile_sizes, cudagraph_capture_sizes (each optional)")
    _engine_args(warm)
    warm.set_defaults(func=cmd_prewarm)
    about = ("split ops, pieces, ranges and sizes, custom ops, cache entry and split graph of a model under "
             "the compile flags (default -O2); starts warm from the compile cache, or, with no entry for these "
             "flags, compiles as a server start would (--no-compile: capture and split only)")
    look = sub.add_parser("inspect", help=about, description=about)
    look.add_argument("--no-compile", action="store_true",
                      help="with no cache entry, capture and split only: pieces uncompiled, no entry shown")
    look.add_argument("--json", action="store_true", help="print the report as JSON")
    _engine_args(look)
    look.set_defaults(func=cmd_inspect)
    cache = sub.add_parser("cache", help="list, verify, clear or compare compile-cache entries (KILN_CACHE_ROOT)")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True)
    cache_sub.add_parser("ls", help="every entry: model, device, size, age, complete or not, shapes")
    check = cache_sub.add_parser("verify", help="check every file of the entries against its checksum")
    check.add_argument("keys", nargs="*", help="entry keys or unique prefixes (default: all)")
    drop = cache_sub.add_parser("clear", help="remove entries")
    drop.add_argument("keys", nargs="*", help="entry keys or unique prefixes")
    drop.add_argument("--all", action="store_true", help="remove every entry")
    compare = cache_sub.add_parser("diff", help="why two entries' keys differ, factor by factor")
    compare.add_argument("a")
    compare.add_argument("b")
    cache.set_defaults(func=cmd_cache)
    args = parser.parse_args(rest)
    args.compilation = compilation if explicit else None
    args.compilation_config = compilation  # the -O2 preset when no flag was given
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
