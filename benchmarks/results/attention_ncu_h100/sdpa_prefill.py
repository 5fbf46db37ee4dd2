"""A whole causal prompt's attention: kiln's paged kernel beside torch SDPA's backends (cuDNN, flash,
efficient) on contiguous K/V, Llama-3-8B heads, bf16. Prints us and the share of the matmul rate."""
import json, os, sys
import torch
import triton
import triton.testing
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, "benchmarks")
from decode_attention import time_step, HEADS, KV_HEADS, DIM, BLOCK
from kiln.forward_context import AttentionMetadata
from kiln.ops.triton.attention import paged_attention
from kiln.tools.bench import measure_matmul

rate = measure_matmul("cuda", torch.bfloat16)
print(torch.__version__, torch.cuda.get_device_name(), "matmul TFLOP/s", rate / 1e12,
      "cudnn", torch.backends.cudnn.version())
try:
    import torch.nn.attention.varlen as varlen
    print("varlen:", [n for n in dir(varlen) if not n.startswith("_")])
except Exception as e:
    print("no varlen", e)
g = torch.Generator(device="cuda").manual_seed(1)
rows = []
for tokens in (512, 1024, 2048, 4096, 8192):
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
    out = torch.empty_like(q)
    flops = 2 * 2 * HEADS * DIM * tokens * (tokens + 1) / 2
    paged_attention(q, kv, out, meta, DIM ** -0.5)
    t_kiln = time_step(lambda i: paged_attention(q, kv, out, meta, DIM ** -0.5), 1)
    t_bench = triton.testing.do_bench(lambda: paged_attention(q, kv, out, meta, DIM ** -0.5), warmup=20, rep=200) / 1e3
    row = {"tokens": tokens, "kiln_us": t_kiln * 1e6, "kiln_do_bench_us": t_bench * 1e6, "kiln_vs_matmul": flops / t_kiln / rate}
    k = kv[0, 1:].flatten(0, 1)[:tokens].transpose(0, 1)[None]  # [1, Hkv, T, D] (a strided view)
    v = kv[1, 1:].flatten(0, 1)[:tokens].transpose(0, 1)[None]
    qq = q.transpose(0, 1)[None]
    for name, backend in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
            try:
                with sdpa_kernel(backend):
                    f = lambda i: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=gqa)
                    o = f(0)
                    try:
                        t = time_step(f, 1)
                    except Exception:
                        t = triton.testing.do_bench(lambda: f(0), warmup=20, rep=200) / 1e3
                        row[f"{name}{'_gqa' if gqa else ''}_no_graph"] = True
                err = float((o[0].transpose(0, 1).float() - out.float()).abs().max())
                row[f"{name}{'_gqa' if gqa else ''}_us"] = t * 1e6
                row[f"{name}{'_gqa' if gqa else ''}_err"] = err
            except Exception as e:
                row[f"{name}{'_gqa' if gqa else ''}_error"] = str(e)[:200]
    rows.append(row)
    print(json.dumps(row), flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "matmul_flops_per_s": rate,
           "rows": rows}, open(os.environ.get("OUT", "/tmp") + "/sdpa_prefill.json", "w"), indent=1)
