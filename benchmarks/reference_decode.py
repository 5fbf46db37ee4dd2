"""The stock reference: a plain Llama decode loop under torch.compile(mode="reduce-overhead",
fullgraph=True), with a static KV cache (a benchmark, not a test). Written here, ~100 lines, in
the style of gpt-fast: what a user gets from torch.compile without an inference engine.

    python benchmarks/reference_decode.py --batches 1 64 256 --out $OUT     (on the GPU)
    python benchmarks/reference_decode.py --device cpu --layers 2 --hidden 256 --batches 1 --steps 3

Per batch size it reports the first call (Dynamo, Inductor, autotuning: a recompile per batch
size, as a static cache has one shape per batch), the steady decode step (CUDA graphs
replayed by cudagraph trees, timed one step at a time: step_ms), and the step of the loop
left to run ahead of the GPU (loop_step_ms), with greedy tokens at a ~context-token context. Random bf16
weights of the Llama-3-8B shape by default. JSON to --out/reference_decode_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Shape:
    vocab: int = 128256
    hidden: int = 4096
    layers: int = 32
    heads: int = 32
    kv_heads: int = 8
    ffn: int = 14336
    rope_theta: float = 500000.0
    eps: float = 1e-5


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s, self.head_dim = s, s.hidden // s.heads
        self.qkv = nn.Linear(s.hidden, (s.heads + 2 * s.kv_heads) * self.head_dim, bias=False)
        self.o = nn.Linear(s.heads * self.head_dim, s.hidden, bias=False)
        self.gate_up = nn.Linear(s.hidden, 2 * s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.hidden, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(s.hidden, s.eps), nn.RMSNorm(s.hidden, s.eps)

    def forward(self, x, cos, sin, pos, k_cache, v_cache, mask):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split([self.s.heads * self.head_dim, self.s.kv_heads * self.head_dim,
                                                 self.s.kv_heads * self.head_dim], dim=-1)
        q = rope(q.view(b, t, self.s.heads, self.head_dim), cos, sin).transpose(1, 2)
        k = rope(k.view(b, t, self.s.kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v.view(b, t, self.s.kv_heads, self.head_dim).transpose(1, 2))
        attn = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, t, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


class Llama(nn.Module):
    def __init__(self, s: Shape, batch: int, max_len: int, dtype, device):
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm, self.head = nn.RMSNorm(s.hidden, s.eps), nn.Linear(s.hidden, s.vocab, bias=False)
        head_dim = s.hidden // s.heads
        inv = 1.0 / s.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
        self.register_buffer("cos", torch.cat([angles.cos()] * 2, -1).to(dtype), persistent=False)
        self.register_buffer("sin", torch.cat([angles.sin()] * 2, -1).to(dtype), persistent=False)
        cache = (batch, s.kv_heads, max_len, head_dim)
        self.k = [torch.zeros(cache, dtype=dtype, device=device) for _ in range(s.layers)]
        self.v = [torch.zeros(cache, dtype=dtype, device=device) for _ in range(s.layers)]
        self.max_len = max_len

    def forward(self, ids, pos):
        """ids [B, T] at positions pos [T] (every sequence at the same place): next tokens [B]."""
        x = self.embed(ids)
        cos, sin = self.cos[pos][None], self.sin[pos][None]
        mask = (torch.arange(self.max_len, device=ids.device)[None, :] <= pos[:, None])[None, None]
        for block, k, v in zip(self.blocks, self.k, self.v):
            x = block(x, cos, sin, pos, k, v, mask)
        return self.head(self.norm(x[:, -1])).argmax(-1)


def run(shape: Shape, batch: int, context: int, steps: int, dtype, device) -> dict:
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(shape, batch, context + 2 * steps + 8, dtype, device).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.02)
    step = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, shape.vocab, (batch, context), device=device)
    with torch.inference_mode():
        model(ids, torch.arange(context, device=device))  # prefill, eager: the reference times decode
        token = ids[:, -1:]
        pos = torch.tensor([context], device=device)  # on the device: a host int would be a blocking copy a step
        sync(device)
        start = time.perf_counter()
        token = decode(step, token, pos)
        sync(device)
        first = time.perf_counter() - start
        times = []
        for _ in range(1, steps):
            start = time.perf_counter()
            token = decode(step, token, pos)
            sync(device)
            times.append(time.perf_counter() - start)
        # The loop as a user runs it: no wait between steps, so the host queues step n+1 while
        # step n runs (the token feeds back on the device).
        start = time.perf_counter()
        for _ in range(steps):
            token = decode(step, token, pos)
        sync(device)
        loop = (time.perf_counter() - start) / steps
    steady = times[len(times) // 2:] or times
    return {"batch": batch, "first_call_s": first, "step_ms": statistics.median(steady) * 1e3 if steady else None,
            "loop_step_ms": loop * 1e3, "tokens": token[:2, 0].tolist()}


def decode(step, token, pos):
    """One step at position `pos` (a 1-element device tensor), which then moves on by one."""
    # cudagraph trees reuse the output buffer on the next replay: the token fed back in is a copy.
    torch.compiler.cudagraph_mark_step_begin()
    token = step(token, pos)[:, None].clone()
    pos += 1
    return token


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None, help="a smaller model for a CPU smoke run")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = Shape()
    if args.layers:
        shape.layers = args.layers
    if args.hidden:
        shape = Shape(vocab=1024, hidden=args.hidden, layers=shape.layers, heads=4, kv_heads=2, ffn=4 * args.hidden)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    results = []
    for b in args.batches:
        r = run(shape, b, args.context, args.steps, dtype, args.device)
        print(f"reference b{b}: first call {r['first_call_s']:.1f} s, step {r['step_ms']:.2f} ms, "
              f"in a loop {r['loop_step_ms']:.2f} ms", flush=True)
        results.append(r)
        torch._dynamo.reset()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "shape": asdict(shape), "context": args.context, "dtype": str(dtype), "results": results}
    if args.out:
        path = Path(args.out) / f"reference_decode_{torch.device(args.device).type}.json"
        path.write_text(json.dumps(report, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
