"""kiln's decode attention beside mh_decode (HP kv heads a program) at short and long contexts."""
import itertools, json, os, sys
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, "gpu_snap")
from decode_attention import decode_batch, time_step, caches_for, KV_HEADS, DIM
from kiln.ops.triton.attention import paged_attention
from kiln.tools.bench import measure_copy
from multihead_decode import mh_decode

copy = measure_copy("cuda", torch.bfloat16)
print("copy TB/s", copy / 1e12)
g = torch.Generator(device="cuda").manual_seed(0)
rows = []
for batch, ctx in [(256, 130), (64, 130), (256, 190), (128, 150), (256, 1000), (64, 1000)]:
    kv_bytes = batch * ctx * KV_HEADS * DIM * 2 * 2
    caches = caches_for(kv_bytes)
    q, kv, meta = decode_batch(batch, ctx, caches, "cuda", g)
    ref, out = torch.empty_like(q), torch.empty_like(q)
    scale = DIM ** -0.5
    paged_attention(q, kv[0], ref, meta, scale)
    floor = kv_bytes / copy
    base = time_step(lambda i: paged_attention(q, kv[i], out, meta, scale), caches)
    print(f"b{batch} ctx{ctx}: floor {floor*1e6:.1f} us, kiln {base*1e6:.1f} ({base/floor:.2f}x)", flush=True)
    res = []
    for hp, bn, w, st in itertools.product((1, 2, 4, 8), (16, 32, 64), (2, 4), (2, 3)):
        try:
            f = lambda i: mh_decode(q, kv[i], out, meta.block_tables, meta.seq_lens, scale, hp, bn, w, st)
            t = time_step(f, caches)
            f(0); err = float((out.float() - ref.float()).abs().max())
        except Exception as e:
            continue
        res.append((t, hp, bn, w, st, err))
    res.sort()
    for t, hp, bn, w, st, err in res[:6]:
        print(f"   hp{hp} n{bn} w{w} st{st}: {t*1e6:.1f} us ({t/floor:.2f}x, {base/t:.2f}x faster) err {err:.1e}", flush=True)
    rows.append({"batch": batch, "context": ctx, "floor_us": floor * 1e6, "kiln_us": base * 1e6,
                 "variants": [dict(us=t * 1e6, hp=hp, block_n=bn, warps=w, stages=st, err=err) for t, hp, bn, w, st, err in res]})
out_dir = os.environ.get("OUT", "/tmp")
json.dump({"gpu": torch.cuda.get_device_name(), "copy_bytes_per_s": copy, "cases": rows},
          open(f"{out_dir}/mh_decode_bench.json", "w"), indent=1)
