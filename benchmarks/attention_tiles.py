"""Decode attention tile shapes and KV splits, timed inside CUDA graphs (a benchmark, not a test).

    python benchmarks/attention_tiles.py --out $OUT          (on the GPU)

For Llama-3-8B's attention (32 query heads, 8 kv heads, head dim 128, bf16), or with
--shape gemma-2-9b Gemma 2's (16 query heads, 8 kv heads, head dim 256, a 4096-token window,
scores soft-capped at 50), and decode batches with ~160-token contexts (and longer ones),
each (block_n, num_warps, num_stages, kv_splits) is launched 32 times in one CUDA graph, like
the layers of a step, and compared with what paged_attention picks by itself. Bandwidth is
the KV bytes read.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from decode_attention import time_step  # this script's folder is on sys.path

from kiln.forward_context import AttentionMetadata
from kiln.ops.triton.attention import AttentionTiles, choose_kv_splits, choose_tiles, paged_attention

BLOCK = 16
LAYERS = 32


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    dim: int
    window: int = 0
    softcap: float = 0.0


SHAPES = {"llama-3-8b": Shape(32, 8, 128), "gemma-2-9b": Shape(16, 8, 256, window=4096, softcap=50.0)}


def decode_batch(shape: Shape, batch: int, context: int, device: str):
    blocks_per_seq = -(-context // BLOCK)
    kv = torch.randn(2, batch * blocks_per_seq + 1, BLOCK, shape.kv_heads, shape.dim, dtype=torch.bfloat16, device=device)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).int() + 1
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device=device), block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=context, num_actual_tokens=batch,
        seq_lens_cpu=[context] * batch, query_start_loc_cpu=list(range(batch + 1)))
    q = torch.randn(batch, shape.heads, shape.dim, dtype=torch.bfloat16, device=device)
    return q, kv, meta


def time_graph(fn, iters: int = 20) -> float:
    """ms per call of fn, replayed LAYERS times per graph (all on one cache: see decode_attention.py)."""
    return time_step(lambda layer: fn(), 1, iters) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3-8b")
    p.add_argument("--quick", action="store_true", help="only 64- and 128-key tiles, 4 warps, 2 stages or the default")
    p.add_argument("--large-batches", action="store_true",
                   help="batches 64 and 256 only: 32- and 64-key tiles, 2 or 4 warps, 2 or 3 stages, 1 or 2 splits")
    args = p.parse_args()
    shape = SHAPES[args.shape]
    # (block_n, num_warps, num_stages, kv_splits)
    if args.quick:
        sweep = ((64, 128), (4,), (None, 2), (1,))
    elif args.large_batches:
        sweep = ((32, 64), (2, 4), (2, 3), (1, 2))
    else:
        sweep = ((32, 64, 128), (2, 4, 8), (None, 1, 2), (1, 4, 16))
    if shape.dim > 128 and not args.quick:  # a 256-wide key tile holds twice the bytes of Llama's
        sweep = ((16, 32, 64), (4, 8), (None, 2), (1, 2, 4, 8))
    device = "cuda"
    # Contexts that are not tile multiples (160: 1.25 tiles of 128 keys) are what a decode meets.
    cases = [(1, 160), (8, 160), (64, 160), (256, 160), (64, 1000), (256, 1000), (1, 4096), (8, 2048)]
    if args.large_batches:
        cases = [(64, 130), (64, 160), (256, 160), (64, 1000), (256, 1000)]
    results = []
    for batch, context in cases:
        q, kv, meta = decode_batch(shape, batch, context, device)
        out = torch.empty_like(q)
        reference = torch.empty_like(q)
        options = {"window": shape.window, "softcap": shape.softcap}
        paged_attention(q, kv, reference, meta, shape.dim**-0.5, **options)
        kv_bytes = batch * context * shape.kv_heads * shape.dim * 2 * 2
        default_tiles = choose_tiles(1, shape.heads // shape.kv_heads, shape.dim, batch * shape.kv_heads, q.device)
        default_splits = choose_kv_splits(meta, shape.kv_heads, q.device, shape.dim)
        rows = []
        for block_n, warps, stages, splits in itertools.product(*sweep[:3], sorted({*sweep[3], default_splits})):
            if splits > 1 and (context // splits < block_n or (batch > 8 and not args.large_batches)):
                continue
            tiles = AttentionTiles(block_m=default_tiles.block_m, block_n=block_n, num_warps=warps, num_stages=stages)

            def run(tiles=tiles, splits=splits):
                paged_attention(q, kv, out, meta, shape.dim**-0.5, kv_splits=splits, tiles=tiles, **options)

            try:
                ms = time_graph(run)
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                rows.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "kv_splits": splits,
                             "error": str(e)[:120]})
                continue
            err = float((out.float() - reference.float()).abs().max())
            rows.append({"block_n": block_n, "num_warps": warps, "num_stages": stages, "kv_splits": splits, "us": ms * 1e3,
                         "tb_per_s": kv_bytes / (ms / 1e3) / 1e12, "max_err": err})
        ok = [r for r in rows if "us" in r]
        best = min(ok, key=lambda r: r["us"])
        default = next((r for r in ok if r["block_n"] == default_tiles.block_n
                        and r["num_warps"] == default_tiles.num_warps and r["num_stages"] == default_tiles.num_stages
                        and r["kv_splits"] == default_splits), None)
        if default is None:  # the sweep does not hold the default: time it on its own
            ms = time_graph(lambda: paged_attention(q, kv, out, meta, shape.dim**-0.5, **options))
            default = {"block_n": default_tiles.block_n, "num_warps": default_tiles.num_warps,
                       "num_stages": default_tiles.num_stages, "kv_splits": default_splits, "us": ms * 1e3,
                       "tb_per_s": kv_bytes / (ms / 1e3) / 1e12}
        results.append({"batch": batch, "context": context, "kv_bytes": kv_bytes, "default": default,
                        "best": best, "all": rows})
        print(f"b{batch:<4d} ctx {context:5d}: default (n{default['block_n']} w{default['num_warps']} "
              f"st{default['num_stages']} s{default['kv_splits']}) {default['us']:.1f} us {default['tb_per_s']:.2f} TB/s; "
              f"best (n{best['block_n']} w{best['num_warps']} st{best['num_stages']} s{best['kv_splits']}) "
              f"{best['us']:.1f} us {best['tb_per_s']:.2f} TB/s", flush=True)
        for r in sorted(ok, key=lambda r: r["us"])[:6]:
            print(f"    n{r['block_n']} w{r['num_warps']} st{r['num_stages']} s{r['kv_splits']}: "
                  f"{r['us']:.1f} us {r['tb_per_s']:.2f} TB/s")
    name = "".join(f"_{n}" for n in (args.shape if args.shape != "llama-3-8b" else None,
                                     "quick" if args.quick else "large_batches" if args.large_batches else None) if n)
    path = Path(args.out) / f"attention_tiles_cuda{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"torch": torch.__version__, "shape": args.shape, "cases": results}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
