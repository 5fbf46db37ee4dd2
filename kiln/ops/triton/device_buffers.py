"""Small device tensors a kernel keeps between its launches (split-K counters, an unread
workspace), made once per device on the first call, the warm-up before any CUDA-graph capture:
a captured graph replays their addresses, so they are never made again. The counters are zero
between launches because each kernel's last program resets what it counted."""

from __future__ import annotations

import torch

_kept: dict[tuple[str, torch.device], torch.Tensor] = {}


def kept_buffer(name: str, size: int, dtype: torch.dtype, device: torch.device, *, zeroed: bool = True) -> torch.Tensor:
    key = (name, device)
    if key not in _kept:
        _kept[key] = (torch.zeros if zeroed else torch.empty)(size, dtype=dtype, device=device)
    return _kept[key]
