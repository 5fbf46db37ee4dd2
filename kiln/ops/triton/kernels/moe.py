"""The grouped GEMM of a mixture-of-experts MLP as a Triton kernel (the device code;
kiln.ops.triton.moe sorts the tokens by expert and launches it twice)."""

import triton
import triton.language as tl


# The pair count changes with every batch: as for the GEMV's row count, specialising on it would
# compile the kernel again mid-serving for a new kind of count.
@triton.jit(do_not_specialize=["num_pairs"])
def moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weight_ptr, sorted_pairs_ptr, block_expert_ptr,
                    num_pairs, N, K, a_row_stride, b_expert_stride, b_row_stride, c_row_stride,
                    TOP_K_DIV: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """C[pair] = A[pair // TOP_K_DIV] @ B[expert]^T (times the pair's routing weight if WEIGHTED)
    for the BLOCK_M (token, slot) pairs of this program's block, all routed to one expert.

    sorted_pairs holds pair indices grouped by expert, each group padded to whole blocks with
    num_pairs (no pair); block_expert gives each block's expert, -1 past the used blocks, whose
    programs return at once: the grid is fixed by the token count, so a CUDA graph holds it.
    B is [experts, N, K] (weights stored as output rows).
    """
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    valid = pair < num_pairs
    a_rows = (pair // TOP_K_DIV).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_base = b_ptr + expert.to(tl.int64) * b_expert_stride + cols[None, :].to(tl.int64) * b_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * a_row_stride + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)
        b = tl.load(b_base + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out = acc.to(c_ptr.dtype.element_ty)
    if WEIGHTED:
        # HF weighs the expert's output as rounded to the model dtype: round first, then scale in fp32.
        out = out.to(tl.float32) * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    c_rows = pair.to(tl.int64)
    tl.store(c_ptr + c_rows[:, None] * c_row_stride + cols[None, :], out.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])
