"""Which config the GEMV kernels launch with, found without timing anything on a start.

Autotuning compiles and times every candidate on a machine's first start (11.7 s for the
Llama-3-8B shapes on the H200). So a start takes, in order: the configs `kiln prewarm` tuned
on this GPU and kept in kiln's cache root; the table below, tuned on the GPUs named in it;
else a fixed config that suits any shape (kiln.ops.triton.gemv, logged once). Past 16 rows
cuBLAS or cuBLASLt is faster for some shapes, so there an entry may name the library, and a
shape with no entry takes cuBLAS. The autotuner runs only inside `tuning()`, which prewarm
enters; there a shape past 16 rows is also timed against both libraries.
"""

from __future__ import annotations

import contextlib
import json
import logging

import torch
import triton

logger = logging.getLogger("kiln")

# cuBLAS or cuBLASLt is faster for this shape: the linear calls it, not the kernel (tuned past
# 16 rows only). The two libraries' heuristics pick different kernels for the same shape.
CUBLAS = "cublas"
CUBLASLT = "cublaslt"
LIBRARIES = (CUBLAS, CUBLASLT)
# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), CUBLAS or CUBLASLT per (N, K, padded rows),
# bf16: the autotuner's picks in benchmarks/gemv.py on an H200 (benchmarks/results/gemv_cuda.json:
# Llama-3-8B's qkv, o_proj, gate_up, down and lm_head; one row takes the FMA kernel, 2-16
# rows the dot kernel padded to 16, then 32 and 64, where cuBLAS won some shapes), and at 32
# and 64 rows cuBLASLt where benchmarks/gemm_choices.py timed it fastest (gemm_choices_cuda*.json;
# at 64 rows it took the engine's decode step from 5.48 to 5.26 ms, same call).
TUNED = {
    "NVIDIA H200": {
        (6144, 4096, 1): (8, 512, 1, 4, 3), (4096, 4096, 1): (8, 512, 1, 4, 3),
        (28672, 4096, 1): (16, 256, 1, 4, 4), (4096, 14336, 1): (8, 512, 1, 4, 3),
        (128256, 4096, 1): (16, 256, 1, 4, 4),
        (6144, 4096, 16): (64, 256, 1, 4, 3), (4096, 4096, 16): (32, 256, 2, 4, 4),
        (28672, 4096, 16): (64, 128, 1, 4, 4), (4096, 14336, 16): (64, 128, 2, 4, 4),
        (128256, 4096, 16): (64, 128, 1, 4, 4),
        (6144, 4096, 32): CUBLASLT, (4096, 4096, 32): CUBLASLT,
        (28672, 4096, 32): CUBLAS, (4096, 14336, 32): CUBLASLT,
        (128256, 4096, 32): (128, 64, 1, 4, 5),
        (6144, 4096, 64): CUBLASLT, (4096, 4096, 64): CUBLAS,
        (28672, 4096, 64): CUBLASLT, (4096, 14336, 64): CUBLASLT,
        (128256, 4096, 64): (128, 128, 1, 4, 4),
    },
    # The same on an H100 (gemv_cuda_h100.json), and at 32 and 64 rows the library where gemv.py's
    # graphed calls or gemm_choices_cuda_h100.json timed it fastest.
    "NVIDIA H100 80GB HBM3": {
        (6144, 4096, 1): (4, 2048, 1, 8, 3), (4096, 4096, 1): (4, 2048, 1, 8, 3),
        (28672, 4096, 1): (4, 2048, 1, 8, 3), (4096, 14336, 1): (4, 2048, 1, 8, 3),
        (128256, 4096, 1): (4, 1024, 1, 4, 3),
        (6144, 4096, 16): (64, 256, 1, 4, 3), (4096, 4096, 16): (32, 256, 1, 4, 4),
        (28672, 4096, 16): (64, 128, 1, 4, 4), (4096, 14336, 16): (64, 128, 2, 4, 4),
        (128256, 4096, 16): (64, 256, 1, 4, 3),
        (6144, 4096, 32): (64, 256, 1, 4, 3), (4096, 4096, 32): CUBLAS,
        (28672, 4096, 32): (128, 128, 1, 8, 3), (4096, 14336, 32): CUBLASLT,
        (128256, 4096, 32): (128, 128, 1, 8, 3),
        (6144, 4096, 64): CUBLAS, (4096, 4096, 64): CUBLASLT,
        (28672, 4096, 64): CUBLAS, (4096, 14336, 64): CUBLASLT,
        (128256, 4096, 64): (128, 128, 1, 8, 3),
    },
}
TUNED_FILE = "gemv.json"  # under <cache root>/tuning/, written by kiln prewarm

_tuning = False
_kept: dict[str, dict] | None = None  # the tuned file, read once a process
_logged_default = False


def is_tuning() -> bool:
    return _tuning


@contextlib.contextmanager
def tuning():
    """Inside: a shape with no kept config is autotuned (kiln prewarm's warm-up)."""
    global _tuning
    previous, _tuning = _tuning, True
    try:
        yield
    finally:
        _tuning = previous


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def known(device: torch.device, N: int, K: int, block_m: int, dtype: torch.dtype) -> tuple | str | None:
    """A kept or tabled config for this shape, CUBLAS, CUBLASLT, or None."""
    name = device_name(device)
    kept = _kept_configs().get(_file_key(name, dtype), {}).get(f"{N},{K},{block_m}")
    if kept is not None:
        return kept if kept in LIBRARIES else tuple(kept)
    return TUNED.get(name, {}).get((N, K, block_m)) if dtype == torch.bfloat16 else None


def log_default_once(device: torch.device) -> None:
    global _logged_default
    if not _logged_default:
        _logged_default = True
        logger.info("GEMV: no tuned configs for some shapes on %s (none kept by kiln prewarm, none in kiln's "
                    "table): they launch with fixed configs; kiln prewarm tunes them once and keeps them",
                    device_name(device))


def _file_key(name: str, dtype: torch.dtype) -> str:
    return f"{name}|triton {triton.__version__}|{str(dtype).removeprefix('torch.')}"


def _tuned_path():
    from kiln.compile.cache.store import cache_root

    return cache_root() / "tuning" / TUNED_FILE


def _kept_configs() -> dict[str, dict]:
    global _kept
    if _kept is None:
        try:
            _kept = json.loads(_tuned_path().read_text())
        except (OSError, ValueError):
            _kept = {}
    return _kept


def as_entry(choice: triton.Config | str) -> list | str:
    """A tuning choice as the kept file (and the table) writes it."""
    if isinstance(choice, str):
        return choice
    kw = choice.kwargs
    return [kw["BLOCK_N"], kw["BLOCK_K"], kw["SPLIT_K"], choice.num_warps, choice.num_stages]


def keep(device: torch.device, choices: dict[tuple, triton.Config | str]) -> int:
    """Write the autotuner's `choices` ((N, K, padded rows, dtype) -> config, CUBLAS or
    CUBLASLT) for this GPU into the cache root, beside what was kept before; returns how many."""
    from kiln.compile.cache.store import write_atomic

    global _kept
    path = _tuned_path()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    for (N, K, block_m, dtype), c in choices.items():
        kept.setdefault(_file_key(device_name(device), dtype), {})[f"{N},{K},{block_m}"] = as_entry(c)
    write_atomic(path, json.dumps(kept, indent=1, sort_keys=True).encode())
    _kept = kept
    return len(choices)
