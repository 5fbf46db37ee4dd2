"""Prefill attention: the default tiles (m128 n64 w4 st3 from 2048 tokens: 255 registers + spills) beside
8-warp tiles capped at 128 registers (two blocks a SM), as paged_attention launches them."""
import json, os, sys
import torch
sys.path.insert(0, "benchmarks")
from decode_attention import time_step, HEADS, KV_HEADS, DIM, BLOCK
from kiln.forward_context import AttentionMetadata
import kiln.ops.triton.attention as attention
from kiln.ops.triton.attention import AttentionTiles, paged_attention
from kiln.tools.bench import measure_matmul

cap = {"maxnreg": None}
original = attention.launch
def launch(kernel, grid, *args, **kwargs):
    if cap["maxnreg"]:
        kwargs["maxnreg"] = cap["maxnreg"]
    return original(kernel, grid, *args, **kwargs)
attention.launch = launch

rate = measure_matmul("cuda", torch.bfloat16)
print(torch.cuda.get_device_name(), "matmul TFLOP/s", rate / 1e12, flush=True)
g = torch.Generator(device="cuda").manual_seed(1)
variants = [("default", None, None), ("m128n64w8st3 r128", AttentionTiles(128, 64, 8, 3, True), 128),
            ("m128n64w8st4 r128", AttentionTiles(128, 64, 8, 4, True), 128),
            ("m128n32w8st3 r128", AttentionTiles(128, 32, 8, 3, True), 128),
            ("m64n64w4st3 r128", AttentionTiles(64, 64, 4, 3, True), 128),
            ("m128n64w8st3 r120", AttentionTiles(128, 64, 8, 3, True), 120)]
rows = []
for tokens in (1024, 1536, 2048, 4096, 8192):
    blocks = -(-tokens // BLOCK)
    kv = torch.randn(2, blocks + 1, BLOCK, KV_HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(tokens, dtype=torch.long, device="cuda"),
        block_tables=torch.arange(1, blocks + 1, dtype=torch.int32, device="cuda").view(1, blocks),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"),
        max_query_len=tokens, max_seq_len=tokens, num_actual_tokens=tokens,
        seq_lens_cpu=[tokens], query_start_loc_cpu=[0, tokens])
    q = torch.randn(tokens, HEADS, DIM, dtype=torch.bfloat16, device="cuda", generator=g)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    flops = 2 * 2 * HEADS * DIM * tokens * (tokens + 1) / 2
    paged_attention(q, kv, ref, meta, DIM ** -0.5)
    row = {"tokens": tokens}
    for rep in range(2):
        for name, tiles, maxnreg in variants:
            cap["maxnreg"] = maxnreg
            try:
                t = time_step(lambda i: paged_attention(q, kv, out, meta, DIM ** -0.5, tiles=tiles), 1)
                paged_attention(q, kv, out, meta, DIM ** -0.5, tiles=tiles)
                err = float((out.float() - ref.float()).abs().max())
                row.setdefault(name, []).append(t * 1e6)
                row[name + " err"] = err
            except Exception as e:
                row[name + " error"] = str(e)[:200]
            cap["maxnreg"] = None
    rows.append(row)
    print(tokens, " | ".join(f"{n}: {'/'.join(f'{x:.1f}' for x in row.get(n, []))} us "
                             f"({flops / (min(row[n]) * 1e-6) / rate:.3f})" if n in row else f"{n}: {row.get(n + ' error')}"
                             for n, _, _ in variants), flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "matmul_flops_per_s": rate, "rows": rows},
          open(os.environ.get("OUT", "/tmp") + "/prefill_maxnreg.json", "w"), indent=1)
