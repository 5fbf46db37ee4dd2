import sys, time, importlib.util, torch
sys.path.insert(0, "tests")  # run from the repository root
from kiln.ops.cpu import extension
spec = importlib.util.spec_from_file_location("kiln_cpu_kernels", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); extension._loaded = mod
from kiln.ops.attention import paged_attention_cpu
from test_attention_reference import _metadata
def case(seq_lens, query_lens, dtype, hq=9, hkv=3, d=64, bs=16, blocks=1400):
    gen = torch.Generator().manual_seed(0)
    meta = _metadata(seq_lens, query_lens, bs, blocks, gen)
    cache = torch.randn(2, blocks, bs, hkv, d, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), hq, d, generator=gen).to(dtype)
    return q, cache, meta
for dtype in (torch.float32, torch.bfloat16):
    for B, L in ((16, 100), (16, 512), (64, 300)):
        q, cache, meta = case([L] * B, [1] * B, dtype)
        out = torch.empty_like(q)
        f = lambda: paged_attention_cpu(q, cache, out, meta, 0.125, 0, 0.0)
        for _ in range(5): f()
        ts = []
        for _ in range(7):
            s = time.perf_counter()
            for _ in range(20): f()
            ts.append((time.perf_counter() - s) / 20 * 1e3)
        ts.sort()
        print(f"{dtype} B{B} L{L}: {ts[3]:.3f} ms", flush=True)
