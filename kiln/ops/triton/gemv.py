"""Skinny matmul y = x @ W.T for a few rows of x (decode: M <= 64), as Triton kernels.

At batch 1..64 a linear layer reads every weight once and does little arithmetic per byte,
so its speed is the weight bytes over HBM bandwidth. cuBLAS splits K for these shapes and
launches a separate `splitKreduce` kernel per matmul, and at 64 rows its tiles stream W at
~85% of the copy rate; these kernels stream W once and keep the reduction inside the launch.

W is [N, K] with K contiguous (nn.Linear's layout). A program owns BLOCK_N output features
for all M rows and walks K in BLOCK_K chunks, loading W rows along K (wide, coalesced) and
accumulating in fp32. There are two kernels, chosen by M:

- `gemv_fma_kernel` (M <= FMA_MAX_ROWS): multiply-adds on CUDA cores into an fp32 tile
  [BLOCK_M, BLOCK_N, BLOCK_K] that is summed over K once, after the loop, so the loop has
  no cross-thread reductions. Its registers grow with BLOCK_M, hence the row limit.
- `gemv_dot_kernel` (more rows): at 16 rows CUDA cores cannot keep up with HBM on an
  H200 (~9 bf16 weights per SM per cycle need ~144 FMAs, the SM has 128), so this one uses
  tensor cores, computing y.T = W @ x.T: W's tile is the dot's M side (>= 64 rows, what
  sm90 wants) and the x rows, padded to 16, 32 or 64, its N side.

Split-K (SPLIT_K > 1, for N too small to fill the GPU, e.g. o_proj and down_proj): the
programs of one column tile each sum a contiguous range of K and store fp32 partials in a
workspace; each then bumps a per-tile counter, and the last to arrive adds the partials
in split order (0, 1, ...), so the result does not depend on timing, writes y and resets
the counter to 0. One launch, no atomics on the data, deterministic, and safe to capture
in a CUDA graph (the counters are a persistent zeroed buffer that every launch leaves
zeroed). The counters are shared by all launches on a device: launches that could overlap
(two streams at once) are not supported.

Gated (the MLP's down projection at one row, `activation="silu"` or `"gelu_tanh"`): x's row is
[gate | up], twice W's K, and each chunk of x is act(gate) * up, computed as it is loaded and
rounded as kiln's activation kernel rounds, so the result is bitwise the unfused pair's and the
activation's launch is gone. It shares the plain launch's tuning key. Only the FMA kernel has it: in the dot
kernel the SiLU between x's load and the dot measured 1.4-2.6x slower than the pair (H200,
down_proj at 2-64 rows: 49-100 us against 33-38), at one row 0.6 us faster (32.5 against 33.1).

A launch takes the config kiln.ops.triton.gemv_configs knows for its (N, K, padded rows,
dtype): kept by kiln prewarm, or from kiln's table, else a fixed one; nothing is timed on a
start. Inside gemv_configs.tuning() (kiln prewarm) an unknown shape is autotuned instead;
configs that cannot help a shape (too many registers for its row count, split-K where the
columns alone fill the GPU) are pruned.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
import triton

from kiln.ops.activation import GATED_ACTIVATIONS
from kiln.ops.triton import gemv_configs
from kiln.ops.triton.dependent_launch import gemv_pdl_args
from kiln.ops.triton.device_buffers import kept_buffer
from kiln.ops.triton.kernels.gemv import gemv_dot_kernel, gemv_fma_kernel
from kiln.ops.triton.launch import launch

MAX_ROWS = 64  # above this, callers use cuBLAS
ACTIVATIONS = tuple(GATED_ACTIVATIONS)  # what a gated launch can compute in its loads
# Measured on the H200 (benchmarks/gemv.py): the FMA kernel wins at one row (qkv 1.14x,
# o_proj 1.09x over cuBLAS) but lost 0.5-0.9x at 2 and 4 rows, where the tl.dot kernel
# (x padded to 16 rows) matched or beat cuBLAS.
FMA_MAX_ROWS = 1
MIN_DOT_ROWS = 16  # x rows are padded to a power of two, at least this (tl.dot's minimum)
# The FMA kernel's accumulator: at most this many fp32 registers per thread.
MAX_ACC_PER_THREAD = 64
# Column tiles a split-K launch may have (the counter buffer's length).
MAX_SPLIT_TILES = 1024
_FALLBACK_NUM_SMS = 132  # an H200, for pruning when no GPU is visible (the interpreter)


def _config(block_n, block_k, split_k, num_warps, num_stages) -> triton.Config:
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k},
                         num_warps=num_warps, num_stages=num_stages)


# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages). Each thread loads 8-64 weights (one
# to eight 16-byte vectors of bf16) per chunk; the pruning keeps those whose accumulator fits.
# Where a chunk of x is narrower than one 16-byte vector a thread (BLOCK_K < 8 x 32 x
# num_warps), Triton lays x out narrower than W and moves W's chunk through shared memory to
# match, every chunk: 2-8 barriers in the sm_90 loop of each of the first eight. The last four
# are that wide: no barrier, and at qkv's shape 3.6-3.8 instructions a weight against 3.7-4.3
# (benchmarks/kernel_code.py; untimed on a GPU).
FMA_CONFIGS = [
    _config(8, 512, 1, 4, 3),
    _config(16, 512, 1, 8, 3),
    _config(32, 256, 1, 8, 3),
    _config(16, 256, 1, 4, 4),
    _config(16, 256, 1, 8, 4),
    _config(8, 256, 1, 4, 4),
    _config(16, 512, 2, 8, 3),
    _config(16, 256, 4, 8, 4),
    _config(8, 1024, 1, 4, 3),
    _config(4, 1024, 1, 4, 3),
    _config(8, 2048, 1, 8, 3),
    _config(4, 2048, 1, 8, 3),
]
# The dot kernel stages W and x tiles in shared memory (num_stages x (BLOCK_N + rows) x
# BLOCK_K elements; the pruning drops those past MAX_SHARED_BYTES). Wide column tiles are
# for 32 and 64 rows, where every program reads all of x (64 rows: 512 KB at K = 4096).
DOT_CONFIGS = [
    _config(64, 128, 1, 4, 4),
    _config(64, 256, 1, 4, 3),
    _config(128, 128, 1, 4, 4),
    _config(32, 256, 1, 4, 4),
    _config(64, 128, 2, 4, 4),
    _config(64, 256, 4, 4, 3),
    _config(32, 256, 2, 4, 4),
    _config(128, 64, 1, 4, 5),
    _config(128, 128, 1, 8, 3),
    _config(256, 64, 1, 8, 4),
    _config(128, 64, 2, 4, 5),
    _config(64, 64, 1, 4, 2),  # fits where nothing else does (fp32 at 64 rows)
]
MAX_SHARED_BYTES = 200 << 10  # an H100/H200 SM has 227 KB


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _FALLBACK_NUM_SMS


def config_fits(config: triton.Config, rows: int, N: int, K: int, num_sms: int, fma: bool,
                element_size: int = 2) -> bool:
    """Whether `config` is worth trying for this shape (rows: the padded BLOCK_M)."""
    block_n, block_k, split_k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.kwargs["SPLIT_K"]
    if fma and rows * block_n * block_k > MAX_ACC_PER_THREAD * 32 * config.num_warps:
        return False
    if not fma and config.num_stages * (block_n + rows) * block_k * element_size > MAX_SHARED_BYTES:
        return False
    if split_k > 1:
        tiles = triton.cdiv(N, block_n)
        # Split only when the column tiles alone leave SMs short of work, and each split
        # still streams at least two chunks.
        if tiles >= 2 * num_sms or tiles > MAX_SPLIT_TILES or triton.cdiv(K, block_k) < 2 * split_k:
            return False
    return True


def _fitting(configs, rows, N, K, num_sms, fma, element_size=2):
    fitting = [c for c in configs if config_fits(c, rows, N, K, num_sms, fma, element_size)]
    # Never prune everything: the smallest accumulator always compiles.
    return fitting or [min(configs, key=lambda c: c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] / c.num_warps)]


def _prune(fma):
    def prune(configs, named_args, **kwargs):
        x = named_args["x_ptr"]
        return _fitting(configs, kwargs["BLOCK_M"], named_args["N"], named_args["K"], _num_sms(x.device), fma,
                        x.element_size())
    return prune


def _bench(fn, quantiles):
    if not torch.cuda.is_available():
        # The interpreter (CPU tests): no timers to read; one run, so tuning still runs
        # every candidate end to end.
        start = time.perf_counter()
        fn()
        return [time.perf_counter() - start] * len(quantiles)
    # Short runs: tuning happens in warm-up, once per shape; do_bench still clears L2 between
    # runs, so W streams from HBM as it does in a decode step.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _median(fn) -> float:
    return _bench(fn, [0.5, 0.5])[0]  # do_bench returns a bare float for one quantile


def default_config(N: int, K: int, block_m: int, num_sms: int, fma: bool, element_size: int = 2) -> triton.Config:
    """A config that suits any shape, for one no tuning has seen: the FMA kernel's widest K
    chunk, the dot kernel's 64x128 tile, split in two where the column tiles leave SMs idle."""
    if fma:
        wanted = _config(8, 512 if K >= 512 else 256, 1, 4, 3)
    else:
        wanted = _config(64, 128, 2 if triton.cdiv(N, 64) < num_sms else 1, 4, 4)
    if config_fits(wanted, block_m, N, K, num_sms, fma, element_size):
        return wanted
    return _fitting(FMA_CONFIGS if fma else DOT_CONFIGS, block_m, N, K, num_sms, fma, element_size)[0]


_launch_configs: dict[tuple, triton.Config] = {}


def launch_config(device: torch.device, N: int, K: int, block_m: int, dtype: torch.dtype,
                  fma: bool) -> triton.Config | None:
    """The config a launch of this shape takes; None while tuning a shape kiln knows no config
    for (the autotuner picks)."""
    key = (device, N, K, block_m, dtype, fma)
    config = _launch_configs.get(key)
    if config is None:
        known = gemv_configs.known(device, N, K, block_m, dtype)
        if known is None and gemv_configs.is_tuning():
            return None
        if known is None:
            gemv_configs.log_default_once(device)
        if isinstance(known, tuple):
            config = _config(*known)
        else:  # none known, or CUBLAS (the kernel is asked for anyway: tests, benchmarks)
            config = default_config(N, K, block_m, _num_sms(device), fma, torch.empty(0, dtype=dtype).element_size())
        _launch_configs[key] = config
    return config


def tuned_choices() -> dict[tuple, triton.Config | str]:
    """What tuning picked in this process: (N, K, padded rows, dtype) -> config, or CUBLAS /
    CUBLASLT where that library beat the autotuner's pick."""
    choices = {}
    for autotuned in (fma_kernel, dot_kernel):
        for key, config in autotuned.cache.items():
            dtype = next((d for d in (torch.bfloat16, torch.float16, torch.float32) if str(d) in key[3:]), None)
            if dtype is not None:
                choices[(*key[:3], dtype)] = config
    for key, winner in _winners.items():
        if winner != KERNEL:
            choices[key[1:]] = winner
    return choices


KERNEL = "kernel"
# (device, N, K, padded rows, dtype) -> KERNEL, CUBLAS or CUBLASLT: what runs there (past MIN_DOT_ROWS rows)
_winners: dict[tuple, str] = {}


def linear(x: torch.Tensor, weight: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """x @ weight.T for at most MAX_ROWS rows by the kernel, cuBLAS or cuBLASLt, whichever is known
    to be fastest for this shape: up to MIN_DOT_ROWS rows always the kernel; past them what tuning
    or kiln's table says, cuBLAS for a shape neither knows. Inside gemv_configs.tuning() an unknown
    shape past MIN_DOT_ROWS rows is autotuned, then timed against both libraries. activation
    ("silu" or "gelu_tanh"): x is [gate | up] and the product is act(gate) * up @ weight.T: in the
    GEMV's loads at one row, else the activation kernel first."""
    if activation is not None and x.numel() // x.shape[-1] > FMA_MAX_ROWS:
        from kiln.ops.triton.activation import gated_activation

        x, activation = gated_activation(x, activation), None
    winner = _winner(x, weight)
    if winner == KERNEL:
        return skinny_matmul(x, weight, activation=activation)
    return cublaslt_linear(x, weight) if winner == gemv_configs.CUBLASLT else F.linear(x, weight)


def cublaslt_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear through cuBLASLt: its heuristics pick other kernels than cuBLAS's, faster for some
    decode shapes (benchmarks/gemm_choices.py). torch's switch is process-wide, so it is set for
    this call only; inside a CUDA graph the kernel chosen at capture replays. Off CUDA (the
    interpreted tests) there is no library to choose: F.linear."""
    if x.device.type != "cuda":
        return F.linear(x, weight)
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, weight)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _winner(x: torch.Tensor, weight: torch.Tensor) -> str:
    """What multiplies x's rows by this weight: always the kernel up to MIN_DOT_ROWS rows, past
    them what tuning or kiln's table says; under tuning an unknown shape is timed all three ways."""
    rows = x.numel() // x.shape[-1]
    if rows <= MIN_DOT_ROWS:
        return KERNEL
    N, K = weight.shape
    block_m = padded_rows(rows, "dot")
    key = (x.device, N, K, block_m, x.dtype)
    winner = _winners.get(key)
    if winner is None:
        known = gemv_configs.known(x.device, N, K, block_m, x.dtype)
        if known is None and gemv_configs.is_tuning():
            skinny_matmul(x, weight)  # autotunes
            config = chosen_config(rows, N, K, x.dtype)
            times = {KERNEL: _median(lambda: skinny_matmul(x, weight, config=config)),
                     gemv_configs.CUBLAS: _median(lambda: F.linear(x, weight)),
                     gemv_configs.CUBLASLT: _median(lambda: cublaslt_linear(x, weight))}
            winner = min(times, key=times.get)
        else:
            winner = KERNEL if isinstance(known, tuple) else known or gemv_configs.CUBLAS
        _winners[key] = winner
    return winner


_KEY = ["N", "K", "BLOCK_M"]
_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
# Autotuned only while gemv_configs.tuning(); the timings also go to Triton's cache dir.
fma_kernel = triton.autotune(FMA_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune(True)},
                             do_bench=_bench, cache_results=True)(_even_k(gemv_fma_kernel))
dot_kernel = triton.autotune(DOT_CONFIGS, key=_KEY, prune_configs_by={"early_config_prune": _prune(False)},
                             do_bench=_bench, cache_results=True)(_even_k(gemv_dot_kernel))


def _split_counters(device: torch.device) -> torch.Tensor:
    return kept_buffer("gemv split counters", MAX_SPLIT_TILES, torch.int32, device)


def _unread_workspace(device: torch.device) -> torch.Tensor:
    return kept_buffer("gemv unread workspace", 1, torch.float32, device, zeroed=False)


def choose_kernel(rows: int) -> str:
    return "fma" if rows <= FMA_MAX_ROWS else "dot"


@functools.cache
def padded_rows(rows: int, kernel: str) -> int:
    """BLOCK_M of a launch: the autotuning key's row count."""
    if kernel == "fma":
        return max(triton.next_power_of_2(rows), 1)
    return max(triton.next_power_of_2(rows), MIN_DOT_ROWS)


def skinny_matmul(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                  kernel: str | None = None, config: triton.Config | None = None,
                  activation: str | None = None, pdl: int | None = None) -> torch.Tensor:
    """x @ weight.T for x [..., K] with at most MAX_ROWS rows and weight [N, K] (K contiguous);
    with an activation (the FMA kernel only; "silu" or "gelu_tanh"), x is [..., 2K], [gate | up],
    and the product is (act(gate) * up) @ weight.T.

    Accumulates in fp32; the result has x's dtype. `out` ([rows, N] or x.shape[:-1] + (N,),
    last dim contiguous) receives it if given. `kernel` ("fma" / "dot") and `config` force a
    kernel and a config instead of the row-count rule and launch_config, `pdl` a dependent-launch
    mode (kiln.ops.triton.dependent_launch) instead of the device's (tests, benchmarks).
    """
    if activation not in (None, *ACTIVATIONS):
        raise ValueError(f"skinny_matmul: activation {activation!r} is not one of {ACTIVATIONS}")
    gated = activation is not None
    K = x.shape[-1] // 2 if gated else x.shape[-1]
    if gated and x.shape[-1] != 2 * K:
        raise ValueError(f"skinny_matmul: a gated x holds [gate | up] halves, so its last dim must be even; "
                         f"got {x.shape[-1]}")
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(1) != 1:
        raise ValueError(f"skinny_matmul: weight must be [N, {K}] with K contiguous, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"skinny_matmul: x {x.dtype} on {x.device} and weight {weight.dtype} on {weight.device} "
                         f"must match")
    N = weight.shape[0]
    rows_view = x.reshape(-1, x.shape[-1])
    if rows_view.stride(-1) != 1:
        rows_view = rows_view.contiguous()
    M = rows_view.shape[0]
    if M > MAX_ROWS:
        raise ValueError(f"skinny_matmul: {M} rows, at most {MAX_ROWS}")
    shape = (*x.shape[:-1], N)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) not in (shape, (M, N)) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"skinny_matmul: out must be {shape} {x.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if out.device != x.device:
        raise ValueError(f"skinny_matmul: out is on {out.device}, x on {x.device}; they must match")
    out_rows = out.view(M, N)
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()

    kernel = kernel or choose_kernel(M)
    fma = kernel == "fma"
    if gated and not fma:
        raise ValueError(f"skinny_matmul: only the FMA kernel (at most {FMA_MAX_ROWS} row(s) by default) takes a "
                         f"gated x; run kiln.ops.triton.activation.gated_activation first")
    block_m = padded_rows(M, kernel)
    autotuned = fma_kernel if fma else dot_kernel
    if config is None:
        config = launch_config(x.device, N, K, block_m, x.dtype, fma)
    candidates = [config] if config is not None else _fitting(autotuned.configs, block_m, N, K,
                                                            _num_sms(x.device), fma, x.element_size())
    max_split = max(c.kwargs["SPLIT_K"] for c in candidates)
    # Every split writes M x N fp32 partials; a workspace for the largest split any
    # candidate uses (unread when none splits: then one shared element, not an allocation a call).
    workspace = torch.empty(max_split * M * N, dtype=torch.float32, device=x.device) if max_split > 1 \
        else _unread_workspace(x.device)
    args = (rows_view, weight, out_rows, workspace, _split_counters(x.device), M, N, K,
            rows_view.stride(0), weight.stride(0), out_rows.stride(0))
    extra = {"ACTIVATION": activation or ""} if fma else {"DOT_PRECISION": "ieee" if x.dtype == torch.float32 else "tf32"}
    extra.update(gemv_pdl_args(x.device) if pdl is None else {"PDL": pdl, "launch_pdl": bool(pdl)})

    def grid(meta):
        return (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])

    if config is None:
        autotuned[grid](*args, BLOCK_M=block_m, **extra)
    else:
        if config.kwargs["SPLIT_K"] > 1 and triton.cdiv(N, config.kwargs["BLOCK_N"]) > MAX_SPLIT_TILES:
            raise ValueError(f"skinny_matmul: split-K over more than {MAX_SPLIT_TILES} column tiles")
        block_k = config.kwargs["BLOCK_K"]
        # The autotuner's inner function, with the heuristic applied by hand.
        launch(autotuned.fn.fn, grid, *args, BLOCK_M=block_m, EVEN_K=K % block_k == 0, **extra,
               **config.all_kwargs())
    return out


def chosen_config(rows: int, N: int, K: int, dtype: torch.dtype, kernel: str | None = None) -> triton.Config | None:
    """The config the autotuner picked for this shape (None before its first call)."""
    kernel = kernel or choose_kernel(rows)
    block_m = padded_rows(rows, kernel)
    autotuned = fma_kernel if kernel == "fma" else dot_kernel
    for key, config in autotuned.cache.items():
        if tuple(key[:3]) == (N, K, block_m) and str(dtype) in key[3:]:
            return config
    return None
