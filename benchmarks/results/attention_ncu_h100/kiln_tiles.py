"""kiln's decode kernel with the tiles the one-head variant liked, beside its own choice and the variant."""
import sys, torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "gpu_snap")
from decode_attention import decode_batch, time_step, caches_for, KV_HEADS, DIM
from kiln.ops.triton.attention import paged_attention, AttentionTiles
from multihead_decode import mh_decode
g = torch.Generator(device="cuda").manual_seed(0)
for batch, ctx in [(256, 130), (64, 130), (128, 150)]:
    caches = caches_for(batch * ctx * KV_HEADS * DIM * 4)
    q, kv, meta = decode_batch(batch, ctx, caches, "cuda", g)
    out = torch.empty_like(q)
    s = DIM ** -0.5
    for rep in range(2):
        line = [f"b{batch} ctx{ctx}:"]
        line.append(f"kiln {time_step(lambda i: paged_attention(q, kv[i], out, meta, s), caches) * 1e6:.1f}")
        for n, w, st in [(16, 2, 2), (32, 2, 2), (64, 2, 3), (16, 2, 3)]:
            t = AttentionTiles(16, n, w, st, True)
            line.append(f"kiln n{n}w{w}st{st} {time_step(lambda i: paged_attention(q, kv[i], out, meta, s, tiles=t), caches) * 1e6:.1f}")
            line.append(f"mh1 {time_step(lambda i: mh_decode(q, kv[i], out, meta.block_tables, meta.seq_lens, s, 1, n, w, st), caches) * 1e6:.1f}")
        print(" ".join(line), flush=True)
