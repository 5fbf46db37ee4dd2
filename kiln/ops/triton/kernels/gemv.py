"""The skinny-matmul (GEMV) Triton kernels (the device code; kiln.ops.triton.gemv chooses a config and
launches them)."""

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _store_result(acc, rows, cols, M, N, out_ptr, out_row_stride, ws_ptr, counter_ptr, pid_n, pid_k,
                  SPLIT_K: tl.constexpr):
    """Write the fp32 tile `acc` (rows x cols, broadcast index tensors of its shape) to out;
    with split-K, through the workspace and the last-arriver reduction."""
    mask = (rows < M) & (cols < N)
    out_ptrs = out_ptr + rows * out_row_stride + cols
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        slab = M * N
        tl.store(ws_ptr + pid_k * slab + rows * N + cols, acc, mask=mask)
        # Every thread's partial is stored before one thread publishes the arrival (release);
        # the last arriver's acquire makes the other programs' partials visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for split in tl.static_range(SPLIT_K):
                # .cg: read at L2, where the other SMs' stores are, never a stale L1 line.
                total += tl.load(ws_ptr + split * slab + rows * N + cols, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tile_start(x_ptr, w_ptr, M, N, K, x_row_stride, w_row_stride,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """A program's rows, columns, K range and first chunk's pointers (both kernels)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # Splits start at multiples of BLOCK_K, so only the last chunk of K can be partial.
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # Columns past N read row N - 1 (their results are masked at the store): no mask on
    # the weight loads, which keeps them full width.
    w_rows = tl.minimum(cols, N - 1).to(tl.int64)
    w_ptrs = w_ptr + w_rows[:, None] * w_row_stride + (k_start + ks)[None, :]
    x_ptrs = x_ptr + rows[:, None] * x_row_stride + (k_start + ks)[None, :]
    return pid_n, pid_k, rows, cols, ks, k_start, k_end, w_ptrs, x_ptrs


GELU_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
GELU_KAPPA = tl.constexpr(0.044715)

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    @triton.jit
    def tanh(x):
        """The interpreter (CPU tests) has no libdevice: tanh by exp, within an ulp of it."""
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
else:
    tanh = libdevice.tanh


@triton.jit
def _act_mul(gate, up, ACTIVATION: tl.constexpr):
    """act(gate) * up in x's dtype (act: "silu", or GELU's tanh form "gelu_tanh"), rounded where
    kiln's activation kernel rounds (its twin in kernels/activation.py: a worker loads this module
    alone, so it cannot import that one)."""
    dtype = gate.dtype
    gate, up = gate.to(tl.float32), up.to(tl.float32)
    if ACTIVATION == "gelu_tanh":
        # torch's GELU-tanh op for op, with the tanh its CUDA kernel calls (libdevice's), so that
        # Inductor's F.gelu and this kernel round alike (benchmarks/gpu_kernels.py checks it).
        inner = GELU_BETA * (gate + GELU_KAPPA * (gate * gate * gate))
        act = 0.5 * gate * (1.0 + tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    return (act.to(dtype).to(tl.float32) * up).to(dtype)


@triton.jit
def _load_chunk(w_ptrs, x_ptrs, rows, ks, k, M, K, EVEN_K: tl.constexpr, ACTIVATION: tl.constexpr):
    """One BLOCK_K chunk of W's tile (streamed once: evict first) and of x. With an ACTIVATION
    ("silu" or "gelu_tanh"; "" for none), a row of x is [gate | up], K each, and the chunk is
    act(gate) * up (the down projection's input)."""
    x_mask = rows[:, None] < M
    if EVEN_K:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        k_mask = (k + ks) < K
        w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
        x_mask = x_mask & k_mask[None, :]
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if ACTIVATION != "":
        x = _act_mul(x, tl.load(x_ptrs + K, mask=x_mask, other=0.0), ACTIVATION)
    return w, x


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    @triton.jit
    def _start_after_predecessor(PDL: tl.constexpr):
        """The interpreter (CPU tests) runs one launch at a time and has no inline assembly."""
        pass
else:
    @triton.jit
    def _start_after_predecessor(PDL: tl.constexpr):
        """With programmatic dependent launch (kiln.ops.triton.dependent_launch): let the next kernel's
        programs be scheduled now, then wait until the kernel before this one has finished and its
        writes are visible. Nothing another kernel writes may be touched before this."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()


@triton.jit
def _first_chunk(w_ptrs, x_ptrs, rows, ks, k_start, k_end, M, K, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                 ACTIVATION: tl.constexpr):
    """The first BLOCK_K chunk of a program's K range, its weights loaded before the wait for the
    kernel before (no kernel writes weights), x after it. Masked to the range, which may be empty."""
    if EVEN_K:  # the chunk is whole or the range empty: a uniform mask keeps the loads wide
        k_mask = (ks * 0 + k_start) < k_end
    else:
        k_mask = (k_start + ks) < k_end
    w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0, eviction_policy="evict_first")
    _start_after_predecessor(PDL)
    x_mask = (rows[:, None] < M) & k_mask[None, :]
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    if ACTIVATION != "":
        x = _act_mul(x, tl.load(x_ptrs + K, mask=x_mask, other=0.0), ACTIVATION)
    return w, x


@triton.jit
def _accumulate(acc, w, x, BLOCK_M: tl.constexpr, DOT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc plus one chunk's products: on tensor cores into y.T's tile (DOT), else multiply-adds
    into the [BLOCK_M,] BLOCK_N x BLOCK_K tile that is summed over K after the loop."""
    if DOT:
        acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)
    elif BLOCK_M == 1:
        acc += w.to(tl.float32) * x.to(tl.float32)
    else:
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    return acc


@triton.jit
def _multiply_range(acc, w_ptrs, x_ptrs, rows, ks, k_start, k_end, M, K, BLOCK_M: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ACTIVATION: tl.constexpr, DOT: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """acc over the program's K range, chunk by chunk. PDL 2: the first chunk is peeled off the
    loop to load its weights before the wait (the same sums in the same order)."""
    loop_start = k_start
    if PDL == 2:
        w, x = _first_chunk(w_ptrs, x_ptrs, rows, ks, k_start, k_end, M, K, EVEN_K, PDL, ACTIVATION)
        acc = _accumulate(acc, w, x, BLOCK_M, DOT, DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        loop_start += BLOCK_K
    else:
        _start_after_predecessor(PDL)
    for k in range(loop_start, k_end, BLOCK_K):
        w, x = _load_chunk(w_ptrs, x_ptrs, rows, ks, k, M, K, EVEN_K, ACTIVATION)
        acc = _accumulate(acc, w, x, BLOCK_M, DOT, DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


# The row count M changes with every batch: specialising on its value (M % 16 == 0) would compile each
# kernel twice per row bucket, and a step with a new kind of count paid the compile (~0.4 s on the H200:
# the first step that sampled 63 rows of the LM head).
@triton.jit(do_not_specialize=["M"])
def gemv_fma_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, counter_ptr, M, N, K,
                     x_row_stride, w_row_stride, out_row_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, ACTIVATION: tl.constexpr, PDL: tl.constexpr):
    pid_n, pid_k, rows, cols, ks, k_start, k_end, w_ptrs, x_ptrs = _tile_start(
        x_ptr, w_ptr, M, N, K, x_row_stride, w_row_stride, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc = _multiply_range(acc, w_ptrs, x_ptrs, rows, ks, k_start, k_end, M, K, BLOCK_M, BLOCK_K, EVEN_K,
                          ACTIVATION, False, "", PDL)
    if BLOCK_M == 1:
        result = tl.sum(acc, axis=1)[None, :]
    else:
        result = tl.sum(acc, axis=2)
    _store_result(result, rows[:, None], cols[None, :], M, N, out_ptr, out_row_stride, ws_ptr, counter_ptr,
                  pid_n, pid_k, SPLIT_K)


@triton.jit(do_not_specialize=["M"])
def gemv_dot_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, counter_ptr, M, N, K,
                     x_row_stride, w_row_stride, out_row_stride,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                     PDL: tl.constexpr):
    pid_n, pid_k, rows, cols, ks, k_start, k_end, w_ptrs, x_ptrs = _tile_start(
        x_ptr, w_ptr, M, N, K, x_row_stride, w_row_stride, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y.T's tile
    acc = _multiply_range(acc, w_ptrs, x_ptrs, rows, ks, k_start, k_end, M, K, BLOCK_M, BLOCK_K, EVEN_K,
                          "", True, DOT_PRECISION, PDL)
    _store_result(acc, rows[None, :], cols[:, None], M, N, out_ptr, out_row_stride, ws_ptr, counter_ptr,
                  pid_n, pid_k, SPLIT_K)
