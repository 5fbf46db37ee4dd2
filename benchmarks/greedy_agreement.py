"""How often compiled greedy decoding says what eager says (a benchmark, not a test).

    OMP_NUM_THREADS=1 python benchmarks/greedy_agreement.py                      (CPU, SmolLM2)
    python benchmarks/greedy_agreement.py --device cuda --model llama-3-8b       (GPU)

50 chat prompts, greedy, the same tokens budget, through kiln's eager forward (the
reference) and -O2: as it comes; with Inductor's own norms (custom_ops none: Inductor fuses
the RMSNorms too); and with Inductor's default rounding (emulate_precision_casts off, as a
plain torch.compile does), per dtype. A prompt agrees when every generated token equals eager's. Each engine is a fresh process-local LLM;
one compile cache root per run (a temporary one unless --cache-root).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "What is 12 times 12?", "Who wrote Romeo and Juliet?", "Why is the sky blue?",
    "Give me a synonym for happy.", "What is the boiling point of water in Celsius?",
    "Write a haiku about autumn.", "What does a bee make?", "Translate 'good morning' into Spanish.",
    "What is the largest planet in the solar system?", "How do plants make food?",
    "Name a mammal that can fly.", "What is the opposite of cold?", "How many days are in a leap year?",
    "What gas do humans breathe out?", "Tell me a fun fact about octopuses.", "What is the square root of 81?",
    "Which ocean is the largest?", "What language is spoken in Brazil?", "Describe a rainbow in one sentence.",
    "What is the freezing point of water in Fahrenheit?", "Who painted the Mona Lisa?",
    "What is photosynthesis?", "List the days of the week.", "What is the chemical symbol for gold?",
    "How many continents are there?", "Suggest a name for a pet cat.", "What is a noun?",
    "Explain gravity to a child.", "What is the tallest mountain on Earth?", "What do caterpillars turn into?",
    "How many hours are in a day?", "Write one sentence about the sea.", "What is the capital of Japan?",
    "Why do we need sleep?", "What colour do you get by mixing blue and yellow?",
    "What is the main ingredient of bread?", "Name a famous scientist.", "What is the speed of light?",
    "How does a compass work?", "What is the capital of Italy?", "Give an example of a prime number.",
    "What instrument has 88 keys?", "What is the longest river in Africa?", "How many sides does a hexagon have?",
    "What do you call a baby dog?", "What is the currency of the United Kingdom?", "Why do leaves change colour?",
]


def run(model: str, device: str, dtype: str, level: int, variant: dict, tokens: int,
        prompts: list[str]) -> tuple[list[list[int]], list[str], float]:
    """variant: "inductor" (Inductor settings over kiln's), "custom_ops" (over the default list)."""
    from kiln import LLM, SamplingParams

    # A dict is CompilationConfig fields over -O2.
    compilation = {"inductor_compile_config": variant["inductor"]} if "inductor" in variant else level
    start = time.perf_counter()
    llm = LLM(model, device=device, dtype=dtype, compilation_config=compilation,
              custom_ops=variant.get("custom_ops", []))
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(max_tokens=tokens, temperature=0), use_tqdm=False)
    seconds = time.perf_counter() - start
    ids, texts = [o.outputs[0].token_ids for o in outs], [o.outputs[0].text for o in outs]
    llm.shutdown()
    del llm
    gc.collect()
    return ids, texts, seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompts", type=int, default=len(PROMPTS))
    p.add_argument("--cache-root", default=None, help="compile cache root (default: a new temporary one)")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args()
    os.environ["KILN_CACHE_ROOT"] = args.cache_root or tempfile.mkdtemp(prefix="kiln-agreement-")
    if args.device == "cpu":
        from kiln.ops.cpu import extension

        extension.build()  # the C++ attention a deployment has, into this run's cache root
    prompts = PROMPTS[:args.prompts]
    variants = {"O2": {}, "O2 with Inductor's norms": {"custom_ops": ["none"]},
                "O2 with Inductor's rounding": {"inductor": {"emulate_precision_casts": False}}}
    report = {"model": args.model, "device": args.device, "tokens": args.tokens, "prompts": len(prompts),
              "dtypes": {}}
    for dtype in args.dtypes:
        eager, eager_texts, eager_s = run(args.model, args.device, dtype, 0, {}, args.tokens, prompts)
        row = {"eager_s": eager_s, "eager_first_answer": eager_texts[0], "variants": {}}
        for name, variant in variants.items():
            ids, texts, seconds = run(args.model, args.device, dtype, 2, variant, args.tokens, prompts)
            equal = [a == b for a, b in zip(ids, eager)]
            row["variants"][name] = {
                "prompts_equal": sum(equal), "rate": sum(equal) / len(prompts), "seconds": seconds,
                "first_answer": texts[0],
                "differing": [{"prompt": prompts[i], "eager": eager_texts[i], "compiled": texts[i]}
                              for i, same in enumerate(equal) if not same]}
            print(f"{dtype:9s} {name:28s} {sum(equal):3d}/{len(prompts)} prompts equal eager "
                  f"(first: {texts[0][:40]!r}; eager {eager_texts[0][:40]!r})", flush=True)
        report["dtypes"][dtype] = row
    report["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
    path = Path(args.out) / f"greedy_agreement_{args.model.replace('/', '_')}_{args.device}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
