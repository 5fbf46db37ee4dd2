"""One paged_attention launch per case, for ncu: python gpu_snap/ncu_attention.py CASE
CASE: decode-B-CTX or prefill-T. Launches the kernel 3 times (ncu: --launch-skip 2 --launch-count 1)."""
import sys
import torch
sys.path.insert(0, "benchmarks")
from decode_attention import decode_batch, prefill_case, DIM, HEADS, KV_HEADS, BLOCK
from kiln.forward_context import AttentionMetadata
from kiln.ops.triton.attention import paged_attention

case = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
if case.startswith("decode"):
    _, b, ctx = case.split("-")
    q, kv, meta = decode_batch(int(b), int(ctx), 1, "cuda", g)
    kv = kv[0]
else:
    tokens = int(case.split("-")[1])
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
for _ in range(3):
    paged_attention(q, kv, out, meta, DIM**-0.5)
torch.cuda.synchronize()
print(case, "ok")
