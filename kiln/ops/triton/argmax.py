"""Row-wise argmax of the logits (greedy decoding) as one Triton launch.

torch's argmax reduces a 128k-wide row of a decode batch with few programs (~28 us for one
row on the H200, profiled in a decode step); this launch gives each row CHUNKS programs of
BLOCK columns, and the last of a row's programs to finish (a per-row counter in a persistent
zeroed buffer, which it zeroes again) picks among their partials. The result is torch's: the
first index of the largest value. A NaN counts as +inf: torch takes the first NaN over any
number, this kernel the first NaN or +inf (logits hold neither unless the model is broken).
"""

from __future__ import annotations

import torch
import triton

from kiln.ops.triton.dependent_launch import pdl_args
from kiln.ops.triton.device_buffers import kept_buffer
from kiln.ops.triton.kernels.argmax import argmax_kernel
from kiln.ops.triton.launch import launch

BLOCK = 4096  # columns per program
MAX_ROWS = 8192  # the counters' length; a larger batch takes torch's argmax


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [rows, width] -> int64 [rows]: each row's first index of its largest value."""
    if x.dim() != 2 or x.stride(-1) != 1 or not 0 < x.shape[0] <= MAX_ROWS or x.shape[1] == 0:
        return x.argmax(dim=-1)
    return _launch(x, None, None)


def gumbel_argmax(x: torch.Tensor, threshold: torch.Tensor, seeds: torch.Tensor,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, width] fp32 logits, threshold [rows] fp32, seeds [rows] int64 -> int64 [rows]: per
    row a draw from softmax(x) over the columns at or above its threshold (Gumbel-max), the noise
    a function of the row's seed and the column only. With temperature [rows] fp32, the draw is
    from x / temperature (threshold in those units), divided as it is read."""
    if x.dim() != 2 or x.stride(-1) != 1 or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"gumbel_argmax takes rows with contiguous columns, got {tuple(x.shape)}")
    threshold, seeds = threshold.contiguous(), seeds.contiguous()
    temperature = temperature.contiguous() if temperature is not None else None
    if x.shape[0] <= MAX_ROWS:
        return _launch(x, threshold, seeds, temperature)
    return torch.cat([_launch(x[i:i + MAX_ROWS], threshold[i:i + MAX_ROWS], seeds[i:i + MAX_ROWS],
                              temperature[i:i + MAX_ROWS] if temperature is not None else None)
                      for i in range(0, x.shape[0], MAX_ROWS)])


def _launch(x: torch.Tensor, threshold: torch.Tensor | None, seeds: torch.Tensor | None,
            temperature: torch.Tensor | None = None) -> torch.Tensor:
    rows, width = x.shape
    chunks = triton.next_power_of_2(triton.cdiv(width, BLOCK))
    block = BLOCK if chunks > 1 else max(triton.next_power_of_2(width), 16)
    out = torch.empty(rows, dtype=torch.long, device=x.device)
    part_value = torch.empty(rows * chunks if chunks > 1 else 1, dtype=torch.float32, device=x.device)
    part_index = torch.empty(part_value.shape, dtype=torch.int32, device=x.device)
    gumbel = threshold is not None
    launch(argmax_kernel, (rows, chunks), x, out, part_value, part_index, _counters(x.device), width, x.stride(0),
           threshold if gumbel else x, seeds if gumbel else out, temperature if temperature is not None else x,
           BLOCK=block, CHUNKS=chunks, GUMBEL=gumbel, SCALED=temperature is not None,
           num_warps=8 if block >= 4096 else 4, **pdl_args(x.device))
    return out


def _counters(device: torch.device) -> torch.Tensor:
    return kept_buffer("argmax row counters", MAX_ROWS, torch.int32, device)
