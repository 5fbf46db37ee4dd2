"""`kiln bisect`: the first piece and op where a compiled forward parts from eager.

    stages   capture once, split, run each stage's pieces on the same real inputs, binary search
    report   the table and the verdict (text or JSON)

    kiln bisect --model smollm2 --dtype bf16 --prompt "The capital of France is"
"""

from __future__ import annotations

import argparse

from kiln.tools.bisect.report import render, to_json
from kiln.tools.bisect.stages import BisectError, BisectReport, bisect, relative_error

__all__ = ["BisectError", "BisectReport", "bisect", "bisect_model", "register", "relative_error", "render", "to_json"]


def bisect_model(model: str | None, prompt: str, *, device: str = "auto", dtype: str = "auto",
                 custom_ops: str = "none", **options) -> BisectReport:
    """Load a model the way the engine does and bisect it on `prompt` (plain text, no chat template)."""
    from kiln.config import EngineConfig, resolve_custom_ops
    from kiln.loader import load_source
    from kiln.models import build_model

    config = EngineConfig(model=model, device=device, dtype=dtype)
    source = load_source(model)
    ops = resolve_custom_ops(custom_ops, "none")
    weights = source.weights() if source.weights else None
    net = build_model(source.config, config.torch_dtype, config.torch_device, ops, weights)
    tokenizer = source.tokenizer
    if tokenizer is not None:
        ids = tokenizer.encode(prompt)
    else:  # a random-weight preset without a tokenizer: the prompt's bytes stand in for tokens
        ids = [b % source.config.vocab_size for b in prompt.encode()]
    report = bisect(net, ids, model_name=source.name, prompt_text=prompt, **options)
    report.decode = tokenizer.decode if tokenizer is not None else None
    return report




def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("bisect", help="first piece and op where Dynamo, AOT-eager or Inductor parts from eager")
    p.add_argument("--model", default=None, help="'smollm2' (default), a .gguf file, an HF folder, or a preset")
    p.add_argument("--prompt", default="The capital of France is", help="plain text, no chat template")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens compared per stage")
    p.add_argument("--tolerance", type=float, default=None,
                   help="relative error |a-b|/|b| allowed (default: fp32 1e-4, bf16 2e-2, fp16 5e-3)")
    p.add_argument("--custom-ops", default="none", help="op paths the model is built with (default: native)")
    p.add_argument("--stages", nargs="+", default=None,
                   help="backends to check: aot_eager inductor (dynamo+eager always runs)")
    p.add_argument("--json", default=None, help="also write the report as JSON here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    report = bisect_model(args.model, args.prompt, device=args.device, dtype=args.dtype,
                          custom_ops=args.custom_ops, tolerance=args.tolerance, new_tokens=args.tokens,
                          stages=args.stages)
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(report), f, indent=2)
        print(f"wrote {args.json}")
    return 0
