"""Dynamo's share of a cold compile, alone (a benchmark, not a test): prints, writes JSON.

    OMP_NUM_THREADS=1 python benchmarks/dynamo_trace.py --out /tmp/dyn

A Llama-shaped model with the layer count of Llama-3-8B (32) but tiny widths, captured in
mode 3 with eager pieces (no Inductor), fresh each run: what is timed is Dynamo tracing the
forward (the monitor's dynamo_s), which grows with the layers and the ops and Python frames
in each, not with the widths. The median of --runs separate captures, alternating, side by side:
without layer stamping (plain), and with each stamping mechanism this torch has (Dynamo traces
each kind of layer once: kiln.compile.layer_stamping): nested_compile_region (torch >= 2.12) and
kiln (any torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

from kiln.compile import compile_model, layer_stamping  # noqa: E402
from kiln.compile.config import CompilationConfig  # noqa: E402
from kiln.models import build_model  # noqa: E402
from kiln.models.presets import PRESETS  # noqa: E402


def trace_once(layers: int, tokens: int, mechanism: str | None) -> dict:
    torch._dynamo.reset()
    cfg = dataclasses.replace(PRESETS["llama-3-8b"], num_layers=layers, hidden_size=256, intermediate_size=512,
                              num_heads=8, num_kv_heads=2, head_dim=32, vocab_size=1024)
    model = build_model(cfg, torch.float32, torch.device("cpu"), frozenset(), None)
    config = CompilationConfig(mode=3, piece_compiler="eager", stamp_repeated_layers=mechanism is not None,
                               stamp_mechanism=mechanism or "auto")
    compiled = compile_model(model, config, 256)
    with torch.inference_mode():
        compiled(torch.randint(0, 1000, (tokens,)), torch.arange(tokens))
    return compiled.stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="folder for dynamo_trace_torch<version>.json")
    args = p.parse_args()
    mechanisms = {"plain": None, "kiln": "kiln"}
    if layer_stamping.supported():
        mechanisms["nested_compile_region"] = "nested_compile_region"
    runs = {name: [] for name in mechanisms}
    for _ in range(args.runs):
        for name, mechanism in mechanisms.items():
            runs[name].append(trace_once(args.layers, args.tokens, mechanism))
    report = {"layers": args.layers, "tokens": args.tokens, "torch": torch.__version__,
              "stamping_supported": layer_stamping.supported()}
    for name, stats in runs.items():
        dynamo = [r["dynamo_s"] for r in stats]
        report[name] = {"dynamo_s": dynamo, "dynamo_median_s": statistics.median(dynamo),
                        "split_s": [r["split_s"] for r in stats], "stamped_layers": stats[0]["stamped_layers"],
                        "pieces": stats[0]["pieces"], "unique_pieces": stats[0]["unique_pieces"]}
        print(f"Dynamo trace of a {args.layers}-layer Llama, {name}: {', '.join(f'{t:.2f}' for t in dynamo)} s "
              f"(median {report[name]['dynamo_median_s']:.2f} s); {stats[0]['stamped_layers']} layers stamped, "
              f"{report[name]['pieces']} pieces, {report[name]['unique_pieces']} unique")
    for name in mechanisms:
        if name != "plain":
            report[f"plain_over_{name}"] = report["plain"]["dynamo_median_s"] / report[name]["dynamo_median_s"]
            print(f"plain / {name}: {report[f'plain_over_{name}']:.2f}x")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        # Per torch version: whether it can stamp (>= 2.12) is the first thing this shows.
        name = f"dynamo_trace_torch{torch.__version__.split('+')[0]}.json"
        (args.out / name).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
