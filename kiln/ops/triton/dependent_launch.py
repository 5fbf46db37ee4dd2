"""Programmatic dependent launch (PDL, sm_90 and later) for kiln's own Triton kernels.

A decode step is a chain of ~270 short kernels (at batch 1: GEMVs, norms, rotary, attention),
each of which reads what the one before wrote. Launched plainly, a kernel starts only once the
one before has finished and flushed, so every boundary leaves the GPU idle for the launch and
for the new kernel's first memory round trip. With PDL a kernel's programs may be scheduled
while its predecessor still runs; each program signals at once that its own successor may start
(`gdc_launch_dependents`) and waits (`gdc_wait`) for its predecessor's writes before it reads or
writes anything another kernel touches. The GEMV may load its first chunk of weights before that
wait (weights are never written by a kernel), so the chain's boundaries overlap weight traffic.

The wait makes the order the plain launch's order for any predecessor, PDL-launched or not, and a
CUDA graph captured with PDL launches keeps them as programmatic edges. Only kernels that wait are
launched this way: a launch of a kernel without the wait could read its inputs too early.

`KILN_PDL` picks (for benchmarks): 0 off, 1 wait at the start of every kernel, 2 as 1 with the
GEMV's first weight chunk loaded before the wait.
"""

from __future__ import annotations

import functools
import os

import torch

OFF, WAIT, PREFETCH = 0, 1, 2


def _setting() -> int:
    value = os.environ.get("KILN_PDL", "0").strip()
    if value not in ("0", "1", "2"):
        raise ValueError(f"KILN_PDL must be 0 (off), 1 (wait first) or 2 (wait after the first weight chunk), "
                         f"got {value!r}")
    return int(value)


@functools.cache
def _launch_args(device: torch.device, gemv: bool) -> dict:
    mode = _setting()  # read (and checked) on every device
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        mode = OFF
    if not gemv and mode == PREFETCH:
        mode = WAIT
    return {"PDL": mode, "launch_pdl": mode != OFF}


def pdl_args(device: torch.device) -> dict:
    """A launch's keyword arguments: the kernel's PDL constant and Triton's launch_pdl option."""
    return _launch_args(device, False)


def gemv_pdl_args(device: torch.device) -> dict:
    """pdl_args for the GEMV kernels, which may also load weights before the wait."""
    return _launch_args(device, True)
