"""`kiln generate "prompt"`: one prompt through the engine, the answer streamed to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from kiln.config import DEFAULT_FORWARD_REASON, EngineConfig


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate text for one prompt (chat template applied)")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--no-chat", action="store_true", help="send the prompt as plain text")
    EngineConfig.add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    config = EngineConfig.from_args(args)
    engine = LLMEngine(config)
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
          f"{engine.runner.compiled.describe() if config.compilation else DEFAULT_FORWARD_REASON})",
          file=sys.stderr)
    return 0
