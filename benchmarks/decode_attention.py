"""Decode attention at batches 64-256 against its byte floor, and a 2048-token prefill against the
matmul rate (a benchmark, not a test).

    python benchmarks/decode_attention.py --quick --out $OUT  (on the GPU; --quick: the chosen tiles only)

Llama-3-8B's attention (32 query heads, 8 kv heads, head dim 128, bf16, 16-token blocks in a
shuffled block table). A step's 32 layers are 32 launches in one CUDA graph, and each launch
reads its own layer's cache, as in the engine: attention_tiles.py re-reads one cache, which at
batch 64 and short contexts fits in the H200's 50 MB L2 and looks faster than a step is.
The floor is the KV bytes read at the measured copy rate (kiln.tools.bench.measure_copy). Every
tile variant in the sweep is timed beside what paged_attention picks by itself, and its output
checked against it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import torch

from kiln.forward_context import AttentionMetadata
from kiln.ops.triton.attention import AttentionTiles, choose_kv_splits, choose_tiles, paged_attention
from kiln.tools.bench import measure_copy, measure_matmul

HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 8, 128, 16, 32
L2_BYTES = 50 * 2**20
CASES = [(64, 130), (64, 190), (64, 512), (64, 1000), (64, 2048), (64, 4096), (128, 190), (128, 1000),
         (256, 130), (256, 190), (256, 512), (256, 1000), (256, 2048), (256, 4096)]


def caches_for(kv_bytes: int) -> int:
    """How many distinct layer caches a step's launches cycle through: enough that the next
    launch's cache is not the one L2 holds (at least 4x L2 between two reads of one cache)."""
    return max(2, min(LAYERS, math.ceil(4 * L2_BYTES / kv_bytes)))


def decode_batch(batch: int, context: int, caches: int, device: str, generator: torch.Generator):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    kv = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device=device, generator=generator)
          for _ in range(caches)]
    tables = (torch.randperm(num_blocks - 1, device=device, generator=generator)
              .view(batch, blocks_per_seq).int() + 1)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long, device=device), block_tables=tables,
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=context, num_actual_tokens=batch,
        seq_lens_cpu=[context] * batch, query_start_loc_cpu=list(range(batch + 1)))
    q = torch.randn(batch, HEADS, DIM, dtype=torch.bfloat16, device=device, generator=generator)
    return q, kv, meta


def time_step(launch, caches: int, iters: int = 10) -> float:
    """Seconds per launch: LAYERS launches (layer i reads cache i % caches) in one CUDA graph."""
    for i in range(caches):
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(LAYERS):
            launch(layer % caches)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters / LAYERS


def decode_cases(copy_rate: float, sweep: list[AttentionTiles], device: str) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(0)
    results = []
    for batch, context in CASES:
        kv_bytes = batch * context * KV_HEADS * DIM * 2 * 2
        caches = caches_for(kv_bytes)
        q, kv, meta = decode_batch(batch, context, caches, device, generator)
        out, reference = torch.empty_like(q), torch.empty_like(q)
        scale = DIM**-0.5
        paged_attention(q, kv[0], reference, meta, scale)
        floor_s = kv_bytes / copy_rate
        default_tiles = choose_tiles(1, HEADS // KV_HEADS, DIM, batch * KV_HEADS, q.device)
        default_splits = choose_kv_splits(meta, KV_HEADS, q.device, DIM)
        default_s = time_step(lambda i: paged_attention(q, kv[i], out, meta, scale), caches)
        rows = []
        splits_options = sorted({1, 2, 4, default_splits} if batch <= 128 else {1, 2, default_splits})
        for tiles, splits in itertools.product(sweep, splits_options):
            try:
                seconds = time_step(lambda i, t=tiles, s=splits: paged_attention(q, kv[i], out, meta, scale,
                                                                                  kv_splits=s, tiles=t), caches)
            except Exception as e:  # a tile that does not fit (shared memory, registers)
                rows.append({**_tiles_row(tiles), "kv_splits": splits, "error": str(e)[:160]})
                continue
            paged_attention(q, kv[0], out, meta, scale, kv_splits=splits, tiles=tiles)
            rows.append({**_tiles_row(tiles), "kv_splits": splits, "us": seconds * 1e6,
                         "vs_floor": seconds / floor_s,
                         "max_err": float((out.float() - reference.float()).abs().max())})
        ok = [r for r in rows if "us" in r]
        default = {**_tiles_row(default_tiles), "kv_splits": default_splits, "us": default_s * 1e6,
                   "vs_floor": default_s / floor_s}
        best = min(ok, key=lambda r: r["us"]) if ok else default
        results.append({"batch": batch, "context": context, "kv_bytes": kv_bytes, "layer_caches": caches,
                        "floor_us": floor_s * 1e6,
                        "default": default,
                        "best": best, "all": rows})
        print(f"b{batch:<4d} ctx {context:5d}: floor {floor_s * 1e6:7.1f} us; default {default_s * 1e6:7.1f} us "
              f"({default_s / floor_s:.2f}x); best {best['us']:7.1f} us ({best['vs_floor']:.2f}x: "
              f"n{best['block_n']} w{best['num_warps']} st{best['num_stages']} "
              f"{'heads-first' if best['heads_first'] else 'tiles-first'} s{best['kv_splits']})", flush=True)
        for r in sorted(ok, key=lambda r: r["us"])[:5]:
            print(f"    n{r['block_n']} w{r['num_warps']} st{r['num_stages']} hf{int(r['heads_first'])} "
                  f"s{r['kv_splits']}: {r['us']:.1f} us {r['vs_floor']:.2f}x err {r['max_err']:.1e}")
    return results


def _tiles_row(tiles: AttentionTiles) -> dict:
    return {"block_n": tiles.block_n, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages,
            "heads_first": tiles.heads_first, "max_registers": tiles.max_registers}


def prefill_case(matmul_rate: float, sweep: list[AttentionTiles], device: str, tokens: int = 2048) -> dict:
    """One causal prompt of `tokens` tokens: attention FLOPs (QK^T and PV over the causal half) per
    second, with the tiles paged_attention picks and with each of `sweep`."""
    generator = torch.Generator(device=device).manual_seed(1)
    blocks = -(-tokens // BLOCK)
    kv = torch.randn(2, blocks + 1, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device=device, generator=generator)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long, device=device),
        block_tables=torch.arange(1, blocks + 1, dtype=torch.int32, device=device).view(1, blocks),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        max_query_len=tokens, max_seq_len=tokens, num_actual_tokens=tokens,
        seq_lens_cpu=[tokens], query_start_loc_cpu=[0, tokens])
    q = torch.randn(tokens, HEADS, DIM, dtype=torch.bfloat16, device=device, generator=generator)
    out, reference = torch.empty_like(q), torch.empty_like(q)
    flops = 2 * 2 * HEADS * DIM * tokens * (tokens + 1) / 2
    paged_attention(q, kv, reference, meta, DIM**-0.5)
    seconds = time_step(lambda i: paged_attention(q, kv, out, meta, DIM**-0.5), 1)
    rows = []
    for tiles in sweep:
        try:
            s = time_step(lambda i, t=tiles: paged_attention(q, kv, out, meta, DIM**-0.5, tiles=t), 1)
        except Exception as e:
            rows.append({**_tiles_row(tiles), "block_m": tiles.block_m, "error": str(e)[:160]})
            continue
        paged_attention(q, kv, out, meta, DIM**-0.5, tiles=tiles)
        rows.append({**_tiles_row(tiles), "block_m": tiles.block_m, "us": s * 1e6,
                     "vs_matmul_rate": flops / s / matmul_rate,
                     "max_err": float((out.float() - reference.float()).abs().max())})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    row = {"tokens": tokens, "us": seconds * 1e6, "flops_per_s": flops / seconds,
           "vs_matmul_rate": flops / seconds / matmul_rate, "best": ok[0] if ok else None, "all": rows}
    print(f"prefill {tokens}: {seconds * 1e6:.1f} us, {flops / seconds / 1e12:.0f} TFLOP/s "
          f"({row['vs_matmul_rate']:.2f} of the matmul rate)", flush=True)
    for r in ok[:8]:
        print(f"    m{r['block_m']} n{r['block_n']} w{r['num_warps']} st{r['num_stages']} hf{int(r['heads_first'])} "
              f"r{r['max_registers']}: "
              f"{r['us']:.1f} us {r['vs_matmul_rate']:.2f} err {r['max_err']:.1e}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--quick", action="store_true", help="only the default tiles, no sweep")
    p.add_argument("--prefill-only", action="store_true", help="the prefill and its sweep, no decode")
    p.add_argument("--prefill-lengths", type=int, nargs="*", default=[],
                   help="with --prefill-only: these prompt lengths too, each with a short list of tiles")
    args = p.parse_args()
    if args.prefill_lengths and not args.prefill_only:
        p.error("--prefill-lengths needs --prefill-only")
    device = "cuda"
    copy_rate, matmul_rate = measure_copy(device, torch.bfloat16), measure_matmul(device, torch.bfloat16)
    print(f"copy {copy_rate / 1e12:.2f} TB/s, matmul {matmul_rate / 1e12:.0f} TFLOP/s")
    sweep = [] if args.quick else [
        AttentionTiles(16, block_n, warps, stages, heads_first)
        for block_n, warps, stages, heads_first in itertools.product((32, 64), (2, 4), (2, 3), (False, True))]
    prefill_sweep = [] if args.quick else [
        AttentionTiles(block_m, block_n, warps, stages, heads_first=True)  # as paged_attention's prefill
        for block_m, block_n, warps, stages in itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (None, 2, 3, 4))
        if block_m < 256 or not args.prefill_only] + [
        # 8 warps under a register cap: two blocks a SM (the long-prompt default since session 36)
        AttentionTiles(128, block_n, 8, stages, heads_first=True, max_registers=cap)
        for block_n, stages, cap in itertools.product((32, 64), (3, 4), (128, 168))]
    # The 2048-token sweep's leaders, and the heads-first tiles of session 20, at other lengths.
    short_sweep = [AttentionTiles(m, n, 4, stages, heads_first=True)
                   for m, n, stages in ((64, 64, 2), (64, 64, None), (128, 64, 3), (128, 64, None), (128, 32, 3))]
    short_sweep.append(AttentionTiles(128, 64, 8, 3, heads_first=True, max_registers=128))
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": copy_rate,
              "matmul_flops_per_s": matmul_rate, "prefill": prefill_case(matmul_rate, prefill_sweep, device),
              "prefill_lengths": [prefill_case(matmul_rate, short_sweep, device, tokens)
                                  for tokens in args.prefill_lengths],
              "decode": [] if args.prefill_only else decode_cases(copy_rate, sweep, device)}
    name = "prefill_attention_cuda" if args.prefill_only else "decode_attention_cuda"
    path = Path(args.out) / f"{name}{'' if args.quick else '_sweep'}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
