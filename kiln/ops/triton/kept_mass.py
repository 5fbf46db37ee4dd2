"""Top-p's normaliser beyond topk's picks as one read of the logits.

Where top-k ranks only the largest 1,024 logits, top-p still divides by what the earlier cuts
left of the whole row: exp(x / T - top) summed over the tokens at or above the threshold. In
torch ops that is the scaled logits written out and four more passes over [rows, vocab] fp32;
here each program reads a chunk of a row once, divides as torch does, and leaves a partial
sum; torch adds a row's partials in a fixed order, so a row's sum is the same every run. Its
exp is Triton's (within a few ulp of torch's): the eager sampler and the sampling graph both
sum here, so they agree. At 256 rows of Llama 3's vocabulary on an H100: 0.05 ms.
"""

from __future__ import annotations

import torch
import triton

from kiln.ops.triton.kernels.kept_mass import kept_mass_kernel
from kiln.ops.triton.launch import launch

BLOCK = 4096  # columns per program


def kept_mass(x: torch.Tensor, temperature: torch.Tensor, top: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """x [rows, width] logits, temperature, top and threshold [rows, 1] fp32 -> [rows, 1] fp32:
    per row the sum of exp(x / temperature - top) over the columns whose x / temperature is at
    or above threshold."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"kept_mass takes rows with contiguous columns, got {tuple(x.shape)}")
    rows, width = x.shape
    chunks = triton.cdiv(width, BLOCK)
    block = BLOCK if chunks > 1 else max(triton.next_power_of_2(width), 16)
    parts = torch.empty(rows, chunks, dtype=torch.float32, device=x.device)
    launch(kept_mass_kernel, (rows, chunks), x, temperature.contiguous(), top.contiguous(), threshold.contiguous(),
           parts, width, x.stride(0), chunks, BLOCK=block, num_warps=8 if block >= 4096 else 4)
    return parts.sum(dim=-1, keepdim=True)
