"""The Triton kernels against their native references.

Without a CUDA GPU the kernels run in Triton's interpreter on CPU (slowly: sizes are
small). Output buffers are poisoned with NaN first, so an element a kernel forgets to
write shows up. Tolerances per dtype are stated in ELEMENTWISE_TOL and ATTENTION_TOL.

Two limits of the interpreter shape what runs here: it casts fp32 to bf16 by truncation
(the GPU rounds to nearest), so bf16 results may differ by a unit in the last place more;
and its tl.dot multiplies bf16 blocks as raw integers, so attention is checked in fp32
and fp16 here and in bf16 by benchmarks/gpu_kernels.py on the GPU. What only the GPU
compiler would reject is caught by test_kernels_compile_for_sm90, which compiles every
kernel for an H100/H200 without needing one.
"""

import os
import subprocess
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")

from kiln.forward_context import AttentionMetadata  # noqa: E402
from kiln.ops.activation import gelu_tanh_and_mul_native, silu_and_mul_native  # noqa: E402
from kiln.ops.attention_reference import paged_attention_reference, write_kv_reference  # noqa: E402
from kiln.ops.norm import fused_add_rms_norm_native, rms_norm_native  # noqa: E402
from kiln.ops.rotary import rope_cos_sin_cache, rotary_native  # noqa: E402
from kiln.ops.triton.activation import gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from kiln.ops.triton.attention import (  # noqa: E402
    AttentionTiles, choose_kv_splits, choose_tiles, paged_attention, write_kv)
from kiln.ops.triton import gemv  # noqa: E402
from kiln.ops.triton.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from kiln.ops.triton.rotary import rotary_embedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (atol, rtol) for elementwise kernels: fp32 is exact up to reduction order and libm;
# fp16 and bf16 allow about two units in the last place (the kernels round once where
# torch may round after every op, and the interpreter truncates bf16).
ELEMENTWISE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 3e-2)}


if INTERPRETED:
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(triton.language.standard.sum, InterpretedFunction):
        # Triton's own jit helpers (tl.sum, ...) are bound at its import: it must see
        # TRITON_INTERPRET=1 first. kiln.models imports torch._dynamo, which imports triton.
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module); "
                    "set it in tests/conftest.py before anything imports torch._dynamo, or run this file "
                    "alone", allow_module_level=True)


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled float tensors, so unwritten outputs show."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(empty_like(*a, **k)))


def randn(*shape, dtype=torch.float32, generator=None):
    return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)


def assert_close(actual, expected, dtype, tol=None):
    atol, rtol = (tol or ELEMENTWISE_TOL)[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert not actual.isnan().any(), "an output element was not written"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------- norms, activation, rope


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 100), (7, 576)])
def test_rms_norm(shape, dtype, poisoned_empty):
    x, weight = randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    assert_close(rms_norm(x, weight, 1e-5), rms_norm_native(x, weight, 1e-5), dtype)


def test_rms_norm_strided_rows(poisoned_empty):
    x = randn(6, 256)[:, :100]  # rows 256 apart, last dim contiguous
    weight = randn(100)
    assert_close(rms_norm(x, weight, 1e-6), rms_norm_native(x, weight, 1e-6), torch.float32)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (5, 3, 100), (7, 576)])
def test_fused_add_rms_norm(shape, dtype, poisoned_empty):
    x, residual, weight = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype), randn(shape[-1], dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    expected_out, expected_residual = fused_add_rms_norm_native(x, residual, weight, 1e-5)
    assert_close(new_residual, expected_residual, dtype)
    assert_close(out, expected_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_unit_offset_rms_norms(dtype, poisoned_empty):
    """Gemma's norms: scaled by 1 + weight in fp32, rounded once, in the input's dtype."""
    x, residual, weight = randn(5, 3, 100, dtype=dtype), randn(5, 3, 100, dtype=dtype), randn(100, dtype=dtype)
    expected = rms_norm_native(x, weight, 1e-6, unit_offset=True)
    assert expected.dtype == dtype
    assert not torch.allclose(expected.float(), rms_norm_native(x, weight, 1e-6).float(), atol=1e-2)
    assert_close(rms_norm(x, weight, 1e-6, unit_offset=True), expected, dtype)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=True)
    expected_out, expected_residual = fused_add_rms_norm_native(x, residual, weight, 1e-6, unit_offset=True)
    assert_close(new_residual, expected_residual, dtype)
    assert_close(out, expected_out, dtype)


def test_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(randn(2, 64), randn(32), 1e-5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 50), (2, 3, 2 * 1100)])  # the second spans two column tiles
def test_silu_and_mul(shape, dtype, poisoned_empty):
    x = randn(*shape, dtype=dtype) * 3
    assert_close(silu_and_mul(x), silu_and_mul_native(x), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 50), (2, 3, 2 * 1100)])
def test_gelu_tanh_and_mul(shape, dtype, poisoned_empty):
    x = randn(*shape, dtype=dtype) * 3
    assert_close(gelu_tanh_and_mul(x), gelu_tanh_and_mul_native(x), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rotary_embedding_on_qkv_views(head_dim, rotary_dim, dtype, poisoned_empty):
    num_tokens, num_heads, num_kv_heads = 7, 9, 3
    cache = rope_cos_sin_cache(rotary_dim, 4096, 10000.0, None, device=DEVICE)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    q_out, k_out = rotary_embedding(positions, q, k, cache, head_dim)
    q_ref, k_ref = rotary_native(positions, q, k, cache, head_dim)
    assert_close(q_out, q_ref, dtype)
    assert_close(k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if not INTERPRETED else []))
def test_rotary_rounds_as_the_native_path(dtype, poisoned_empty):
    """Bit for bit rotary_native in half precision: eager runs this kernel, a compiled model
    Inductor's rotation of rotary_native, and one ulp between them flipped greedy tokens of every
    random-weight family on the H200 (bf16 only on a GPU: the interpreter truncates to bf16)."""
    head_dim, num_tokens = 128, 33
    cache = rope_cos_sin_cache(head_dim, 4096, 500000.0, None, device=DEVICE)
    q, k = randn(num_tokens, 4 * head_dim, dtype=dtype) * 4, randn(num_tokens, 2 * head_dim, dtype=dtype) * 4
    positions = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
    for out, ref in zip(rotary_embedding(positions, q, k, cache, head_dim), rotary_native(positions, q, k, cache, head_dim)):
        assert torch.equal(out, ref)


@pytest.mark.parametrize("width", [1, 100, 4096, 4097, 50000])
def test_argmax_is_torchs(width):
    """Greedy decoding's argmax: torch's first index of the row maximum, with ties inside a
    block, across blocks and in the last, ragged one; the row counters are left at zero."""
    from kiln.ops.triton import argmax

    x = randn(5, width)
    x[1, :] = 0.5  # a row of ties: index 0
    top = x.max() + 1
    x[2, [width // 2, width - 1]] = top  # two blocks apart (or one block, for narrow rows)
    x[3, width - 1] = top  # the ragged last block
    for _ in range(2):
        assert torch.equal(argmax.argmax(x), x.argmax(dim=-1))
        assert not argmax._counters(x.device).any()
    assert torch.equal(argmax.argmax(x.half()), x.half().argmax(dim=-1))


def test_gumbel_argmax_draws_from_the_kept_softmax_by_seed():
    """Sampling's draw: frequencies follow softmax over the columns at or above each row's threshold
    (never a column below it, here ~300 likelier ones just under it), also across blocks and in the
    ragged last one; a seed gives the same column whatever rows surround it; the row counters are
    left at zero. (The interpreter takes ~7 ms a program: the rows are few.)"""
    from kiln.ops.triton import argmax

    for width, kept, rows in ((400, [5, 200, 399], 1200), (4097 + 3, [5, 4096, 4099], 40)):
        x = torch.full((1, width), -30.0, device=DEVICE)
        x[0, 7:width - 100] = -1.01
        x[0, kept] = torch.tensor([1.0, 0.0, -1.0], device=DEVICE)
        draws = argmax.gumbel_argmax(x.expand(rows, width).contiguous(), torch.full((rows,), -1.0, device=DEVICE),
                                     torch.randint(0, 2**62, (rows,), device=DEVICE)).cpu()
        assert not argmax._counters(x.device).any()
        assert torch.isin(draws, torch.tensor(kept)).all()
        if rows >= 1000:
            freq = torch.stack([(draws == c).float().mean() for c in kept])
            torch.testing.assert_close(freq, torch.tensor([1.0, 0.0, -1.0]).softmax(0), atol=0.05, rtol=0)
    logits, low = randn(4, 300), torch.full((4,), -10.0, device=DEVICE)
    seeds = torch.tensor([11, 12, 13, 2**62 - 1], device=DEVICE)
    alone = [argmax.gumbel_argmax(logits[i:i + 1], low[i:i + 1], seeds[i:i + 1]).item() for i in range(4)]
    assert argmax.gumbel_argmax(logits, low, seeds).tolist() == alone
    logits[0] = randn(1, 300)[0]  # another row beside rows 1-3
    assert argmax.gumbel_argmax(logits, low, seeds).tolist()[1:] == alone[1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_writes_the_kv_cache_as_rotary_then_write_kv(dtype, poisoned_empty):
    """One launch rotates q and k and writes the rotated k and v at their slots: the same q and k as
    the rotary kernel alone, and the same cache as write_kv after it, bit for bit; slot -1 and
    tokens past the slot mapping (CUDA-graph padding) write nothing."""
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 6, 4, 2, 64, 4
    cache = rope_cos_sin_cache(head_dim, 256, 10000.0, None, device=DEVICE)
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 256, (num_tokens,), device=DEVICE)
    slots = torch.tensor([5, 0, -1, 9, 2], device=DEVICE)  # the sixth token has no slot entry
    kv_cache = randn(2, 4, block_size, num_kv_heads, head_dim, dtype=dtype)
    expected_cache = kv_cache.clone()
    q_ref, k_ref = rotary_embedding(positions, q, k, cache, head_dim)
    write_kv(k_ref.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim),
             expected_cache, slots)
    q_out, k_out = rotary_embedding(positions, q, k, cache, head_dim, v, kv_cache, slots)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert torch.equal(kv_cache, expected_cache)
    with pytest.raises(ValueError, match="value must be like k"):
        rotary_embedding(positions, q, k, cache, head_dim, v[:, :head_dim], kv_cache, slots)


# ---------------------------------------------------------------------------- skinny matmul (GEMV)

# Against x @ w.T in fp32 on the same (rounded) inputs; both sum K=300 products in fp32 in a
# different order, and the kernel rounds once to the output dtype (fp16: ~1 ulp of |y| ~ 20).
GEMV_TOL = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 2e-3)}
GEMV_N, GEMV_K = 70, 300  # neither a multiple of any block


def _gemv_case(rows, dtype, n=GEMV_N, k=GEMV_K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, w = randn(rows, k, dtype=dtype, generator=g), randn(n, k, dtype=dtype, generator=g)
    return x, w, (x.float() @ w.float().T).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 40, 64])
def test_skinny_matmul_takes_a_known_config_and_times_nothing(rows, dtype, poisoned_empty):
    x, w, expected = _gemv_case(rows, dtype, n=GEMV_N + rows)  # a shape no other test launched
    assert_close(gemv.skinny_matmul(x, w), expected, dtype, GEMV_TOL)
    assert gemv.chosen_config(rows, GEMV_N + rows, GEMV_K, dtype) is None  # the autotuner never ran


@pytest.mark.parametrize("rows", [1, 5, 33])
def test_skinny_matmul_is_autotuned_only_while_tuning(rows, poisoned_empty):
    from kiln.ops.triton import gemv_configs

    x, w, expected = _gemv_case(rows, torch.float16, n=GEMV_N + 40 + rows)
    with gemv_configs.tuning():
        assert_close(gemv.skinny_matmul(x, w), expected, torch.float16, GEMV_TOL)
    chosen = gemv.chosen_config(rows, GEMV_N + 40 + rows, GEMV_K, torch.float16)
    assert chosen is not None
    block_m = {1: 1, 5: 16, 33: 64}[rows]
    assert gemv.tuned_choices()[(GEMV_N + 40 + rows, GEMV_K, block_m, torch.float16)] is chosen


def test_default_gemv_configs_fit_their_shapes():
    # The fixed configs a start takes for a shape no tuning has seen must be ones the pruning
    # keeps: an FMA accumulator that fits, split-K only where the columns leave SMs idle.
    # A dot config's staged tiles must fit in shared memory, fp32 at 64 rows included.
    for n, k in [(6144, 4096), (4096, 4096), (4096, 14336), (128256, 4096), (70, 300)]:
        for block_m, fma, element_size in [(1, True, 2), (16, False, 2), (32, False, 2), (64, False, 2),
                                           (64, False, 4)]:
            config = gemv.default_config(n, k, block_m, 132, fma, element_size)
            assert gemv.config_fits(config, block_m, n, k, 132, fma, element_size), (n, k, block_m, config)
    assert gemv.default_config(4096, 4096, 16, 132, False).kwargs["SPLIT_K"] == 2
    assert gemv.default_config(28672, 4096, 16, 132, False).kwargs["SPLIT_K"] == 1
    assert not gemv.config_fits(gemv._config(256, 64, 1, 8, 4), 64, 28672, 4096, 132, False, 4)


def test_tuned_gemv_tables_hold_configs_the_pruning_keeps():
    # A table row is typed in from a GPU run's JSON: each entry must be a library or a config
    # the autotuner could have picked for that shape (both GPUs in the table have 132 SMs).
    from kiln.ops.triton import gemv_configs

    for gpu, table in gemv_configs.TUNED.items():
        for (n, k, block_m), entry in table.items():
            assert block_m in (1, 16, 32, 64), (gpu, n, k, block_m)
            if entry in gemv_configs.LIBRARIES:
                assert block_m > gemv.MIN_DOT_ROWS, (gpu, n, k, block_m, entry)
                continue
            config = gemv._config(*entry)
            assert gemv.config_fits(config, block_m, n, k, 132, block_m == 1), (gpu, n, k, block_m, entry)


@pytest.mark.parametrize("kernel,rows", [("fma", 1), ("fma", 3), ("dot", 2), ("dot", 11), ("dot", 37)])
def test_skinny_matmul_every_config(kernel, rows, poisoned_empty):
    """Each config by hand (the autotuner runs only the winner afterwards), split-K ones
    included; the split counters must be left at zero for the next launch."""
    x, w, expected = _gemv_case(rows, torch.float32)
    for config in gemv.FMA_CONFIGS if kernel == "fma" else gemv.DOT_CONFIGS:
        out = gemv.skinny_matmul(x, w, kernel=kernel, config=config)
        assert_close(out, expected, torch.float32, GEMV_TOL)
    assert not gemv._split_counters(x.device).any()


@pytest.mark.parametrize("kernel", ["fma", "dot"])
@pytest.mark.parametrize("split_k", [2, 3, 5, 8])
def test_skinny_matmul_split_k_ragged(kernel, split_k, poisoned_empty):
    # K = 520 over BLOCK_K = 64: 9 chunks, so splits get 5+4, 3+3+3, 2+2+2+2+1 and, with 8,
    # 2+2+2+2+1 and three empty splits that still store zeros and arrive.
    x, w, expected = _gemv_case(4, torch.float16, n=40, k=520)
    config = triton.Config({"BLOCK_N": 32 if kernel == "dot" else 16, "BLOCK_K": 64, "SPLIT_K": split_k},
                           num_warps=4, num_stages=2)
    assert_close(gemv.skinny_matmul(x, w, kernel=kernel, config=config), expected, torch.float16, GEMV_TOL)
    assert not gemv._split_counters(x.device).any()


@pytest.mark.parametrize("kernel,rows", [("fma", 1), ("fma", 3), ("dot", 5)])
def test_skinny_matmul_first_chunk_before_the_wait_is_bitwise_the_loop(kernel, rows, poisoned_empty):
    """With dependent launch mode 2 the first K chunk is peeled off the loop (its weights load
    before the wait for the kernel before): the same sums in the same order, so the same bits, for
    whole chunks (EVEN_K), a ragged last chunk, splits that are empty, and the gated loads."""
    g = torch.Generator().manual_seed(2)
    for k, block_k, split_k in [(512, 64, 1), (520, 64, 1), (520, 64, 8), (512, 128, 8), (40, 64, 1)]:
        x, w = randn(rows, k, dtype=torch.float16, generator=g), randn(40, k, dtype=torch.float16, generator=g)
        config = triton.Config({"BLOCK_N": 32 if kernel == "dot" else 16, "BLOCK_K": block_k, "SPLIT_K": split_k},
                               num_warps=4, num_stages=2)
        plain = gemv.skinny_matmul(x, w, kernel=kernel, config=config, pdl=0)
        assert torch.equal(gemv.skinny_matmul(x, w, kernel=kernel, config=config, pdl=2), plain), (k, split_k)
        assert_close(plain, (x.float() @ w.float().T).half(), torch.float16, GEMV_TOL)
        if kernel == "fma":
            gated = torch.cat([x, x.flip(-1)], dim=-1)
            assert torch.equal(gemv.skinny_matmul(gated, w, kernel=kernel, config=config, activation="silu", pdl=2),
                               gemv.skinny_matmul(gated, w, kernel=kernel, config=config, activation="silu", pdl=0))
    assert not gemv._split_counters(x.device).any()


def test_skinny_matmul_views_and_out(poisoned_empty):
    # x: rows of a wider tensor (strided) with a leading batch dim; w: rows of a fused weight.
    x_full, w_full = randn(2, 3, 400), randn(100, GEMV_K)
    x, w = x_full[..., :GEMV_K], w_full[10:80]
    out = torch.full((2, 3, 70), float("nan"), device=DEVICE)
    assert gemv.skinny_matmul(x, w, out=out) is out
    assert_close(out, x @ w.T, torch.float32, GEMV_TOL)


@pytest.mark.parametrize("activation", gemv.ACTIVATIONS)
@pytest.mark.parametrize("rows", [1, 3])
def test_gated_skinny_matmul_is_the_activation_then_the_gemv(rows, activation, poisoned_empty):
    """With an activation (x = [gate | up]) the FMA kernel computes act(gate) * up as it loads x:
    bitwise the activation kernel followed by the GEMV with the same config, a split and a ragged
    last chunk included; the dot kernel and an unknown activation are refused."""
    kernel = "fma"
    g = torch.Generator().manual_seed(1)
    x = randn(rows, 2 * GEMV_K, dtype=torch.float16, generator=g) * 3
    w = randn(GEMV_N, GEMV_K, dtype=torch.float16, generator=g)
    act = silu_and_mul(x) if activation == "silu" else gelu_tanh_and_mul(x)
    for split_k in (1, 3):
        config = triton.Config({"BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": split_k}, num_warps=4, num_stages=2)
        fused = gemv.skinny_matmul(x, w, kernel=kernel, config=config, activation=activation)
        assert torch.equal(fused, gemv.skinny_matmul(act, w, kernel=kernel, config=config)), split_k
    assert_close(fused, (act.float() @ w.float().T).half(), torch.float16, GEMV_TOL)
    assert not gemv._split_counters(x.device).any()
    with pytest.raises(ValueError, match="gated x holds"):
        gemv.skinny_matmul(x[:, 1:], w, kernel=kernel, activation=activation)
    with pytest.raises(ValueError, match="only the FMA kernel"):
        gemv.skinny_matmul(x, w, kernel="dot", activation=activation)
    with pytest.raises(ValueError, match="'relu' is not one of"):
        gemv.skinny_matmul(x, w, kernel=kernel, activation="relu")


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 64, 65])
def test_skinny_linear_op_cuda_path(rows, monkeypatch):
    """kiln::skinny_linear's CUDA implementation (called here on CPU tensors, the kernel
    interpreted): the GEMV up to 16 rows; from 17 to 64 only where tuning kept a config (32
    padded rows here say CUBLASLT, 64 a config), cuBLAS where nothing is known; F.linear past 64;
    the same result every way."""
    from kiln.ops.linear import act_and_mul_linear_cuda, skinny_linear_cuda
    from kiln.ops.triton import gemv_configs

    kept = {gemv_configs._file_key("cpu", torch.float32): {f"{GEMV_N},{GEMV_K},32": gemv_configs.CUBLASLT,
                                                           f"{GEMV_N},{GEMV_K},64": [64, 64, 1, 4, 2]}}
    launched, through_lt = [], []
    real, real_lt = gemv.skinny_matmul, gemv.cublaslt_linear
    monkeypatch.setattr(gemv, "skinny_matmul", lambda *a, **k: launched.append(1) or real(*a, **k))
    monkeypatch.setattr(gemv, "cublaslt_linear", lambda *a: through_lt.append(1) or real_lt(*a))
    x, w, expected = _gemv_case(rows, torch.float32)
    for kept_file, takes_kernel in (({}, rows <= 16), (kept, rows <= 16 or 32 < rows <= 64)):
        takes_lt = kept_file is kept and 16 < rows <= 32
        monkeypatch.setattr(gemv_configs, "_kept", kept_file)
        monkeypatch.setattr(gemv, "_winners", {})
        launched.clear()
        through_lt.clear()
        assert_close(skinny_linear_cuda(x.view(1, rows, GEMV_K), w), expected.view(1, rows, GEMV_N),
                     torch.float32, GEMV_TOL)
        assert bool(launched) == takes_kernel, kept_file
        assert bool(through_lt) == takes_lt, kept_file
        # The down projection's fused op takes the same choice for the same shape, or the activation
        # then cuBLAS.
        gate_up = torch.cat([x, x.flip(0)], dim=-1)
        for activation, native in (("silu", silu_and_mul_native), ("gelu_tanh", gelu_tanh_and_mul_native)):
            launched.clear()
            assert_close(act_and_mul_linear_cuda(gate_up, w, activation), native(gate_up) @ w.T, torch.float32,
                         GEMV_TOL)
            assert bool(launched) == takes_kernel, (kept_file, activation)


@pytest.mark.parametrize("library", ["cublas", "cublaslt"])
def test_gemv_tuning_past_16_rows_keeps_the_library_that_wins(library, monkeypatch, tmp_path):
    # Under tuning, a shape of 33 rows nothing knows is autotuned and then timed against cuBLAS
    # and cuBLASLt; here the kernel's pick times slowest and `library` fastest (fixed timings:
    # the interpreter's wall times on a busy CPU decide nothing), so that library is what
    # prewarm keeps, and what the next process calls.
    from kiln.ops.triton import gemv_configs

    times = {"kernel": 3.0, "cublas": 2.0, "cublaslt": 2.0}
    times[library] = 1.0
    timings = iter([times["kernel"], times["cublas"], times["cublaslt"]])  # the order they are timed in
    monkeypatch.setattr(gemv, "_median", lambda fn: (fn(), next(timings))[1])
    monkeypatch.setattr(gemv, "_winners", {})
    monkeypatch.setattr(gemv_configs, "_tuned_path", lambda: tmp_path / "gemv.json")
    monkeypatch.setattr(gemv_configs, "_kept", None)
    real_lt = gemv.cublaslt_linear
    lt_calls = []
    monkeypatch.setattr(gemv, "cublaslt_linear", lambda x, w: lt_calls.append(1) or real_lt(x, w))
    x, w, expected = _gemv_case(33, torch.float16, n=GEMV_N + 7)
    with gemv_configs.tuning():
        assert_close(gemv.linear(x, w), expected, torch.float16, GEMV_TOL)
    choices = gemv.tuned_choices()
    assert choices[(GEMV_N + 7, GEMV_K, 64, torch.float16)] == library
    gemv_configs.keep(x.device, choices)
    monkeypatch.setattr(gemv_configs, "_kept", None)  # the next process reads the file
    monkeypatch.setattr(gemv, "_winners", {})
    assert gemv_configs.known(x.device, GEMV_N + 7, GEMV_K, 64, torch.float16) == library
    lt_calls.clear()
    assert_close(gemv.linear(x, w), expected, torch.float16, GEMV_TOL)  # no tuning now
    assert bool(lt_calls) == (library == "cublaslt")


def test_skinny_matmul_rejects_unsupported_inputs():
    x, w = randn(3, 64), randn(8, 64)
    with pytest.raises(ValueError, match="at most"):
        gemv.skinny_matmul(randn(65, 64), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.skinny_matmul(x, randn(64, 8).T)
    with pytest.raises(ValueError, match="match"):
        gemv.skinny_matmul(x.half(), w)


# ---------------------------------------------------------------------------- paged KV cache and attention


class PagedBatch:
    """A mixed batch over a random paged cache whose block tables are shuffled, not the identity.

    Sequence i has query_lens[i] new tokens, the last of a context of seq_lens[i] tokens.
    query, key and value are [T, H, D] views of one fused qkv tensor (strided like the
    model's), with `padding` extra tokens at the end (slot -1, outside every sequence).
    """

    def __init__(self, query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                 dtype=torch.float32, padding=3, seed=0):
        g = torch.Generator().manual_seed(seed)
        blocks_per_seq = [-(-length // block_size) for length in seq_lens]
        num_blocks = sum(blocks_per_seq) + 4
        block_ids = torch.randperm(num_blocks, generator=g).tolist()
        # Spare columns hold real block ids: a kernel reading past a sequence's blocks would see data.
        table = torch.randint(0, num_blocks, (len(seq_lens), max(blocks_per_seq) + 2), generator=g)
        for i, count in enumerate(blocks_per_seq):
            table[i, :count] = torch.tensor(block_ids[:count], dtype=torch.long)
            block_ids = block_ids[count:]

        num_tokens = sum(query_lens) + padding
        slots = []
        for i, (q_len, length) in enumerate(zip(query_lens, seq_lens)):
            for pos in range(length - q_len, length):
                slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
        slots += [-1] * padding
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)

        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        qkv = randn(num_tokens, sum(sizes), dtype=dtype, generator=g)
        q, k, v = qkv.split(sizes, dim=-1)
        self.query = q.view(num_tokens, num_heads, head_dim)
        self.key = k.view(num_tokens, num_kv_heads, head_dim)
        self.value = v.view(num_tokens, num_kv_heads, head_dim)
        self.kv_cache = randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, generator=g)
        self.num_actual_tokens = starts[-1]
        self.scale = head_dim**-0.5
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
            block_tables=table.to(device=DEVICE, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens), num_actual_tokens=starts[-1],
            seq_lens_cpu=list(seq_lens), query_start_loc_cpu=starts,
        )

    def reference_output(self, kv_cache=None, window: int = 0, softcap: float = 0.0):
        """fp32 attention on the same (rounded) inputs; padding rows stay NaN."""
        kv_cache = self.kv_cache if kv_cache is None else kv_cache
        out = torch.full(self.query.shape, float("nan"), device=DEVICE)
        paged_attention_reference(self.query.float(), kv_cache.float(), out, self.meta, self.scale, window, softcap)
        return out

    def kernel_output(self, kv_cache=None, **kwargs):
        kv_cache = self.kv_cache if kv_cache is None else kv_cache
        out = torch.full(self.query.shape, float("nan"), dtype=self.query.dtype, device=DEVICE)
        paged_attention(self.query, kv_cache, out, self.meta, self.scale, **kwargs)
        return out


# fp32: exact up to summation order. fp16: the kernel rounds softmax probabilities to fp16
# before the P @ V product (as flash attention does); the reference stays in fp32.
ATTENTION_TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def assert_attention_matches(batch, out, expected):
    n = batch.num_actual_tokens
    assert_close(out[:n], expected[:n].to(out.dtype), out.dtype, ATTENTION_TOL)
    assert out[n:].isnan().all(), "padding rows past the batch must be left untouched"


DECODE = dict(query_lens=[1, 1, 1, 1], seq_lens=[1, 17, 64, 200])
PREFILL = dict(query_lens=[5, 33], seq_lens=[5, 33])
# decode, a chunk in the middle of a prompt, a fresh prompt, decode again
MIXED = dict(query_lens=[1, 20, 9, 1], seq_lens=[150, 100, 9, 33])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_mixed_batch(block_size, num_heads, num_kv_heads, head_dim):
    batch = PagedBatch(**MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size)
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


@pytest.mark.parametrize("shape", [DECODE, PREFILL], ids=["decode", "prefill"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_attention_decode_and_prefill(shape, num_heads, num_kv_heads, dtype):
    batch = PagedBatch(**shape, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=64,
                       block_size=16, dtype=dtype)
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


@pytest.mark.parametrize("block_size", [64, 128])  # a cache block as long as or longer than a key tile
def test_paged_attention_large_blocks(block_size):
    batch = PagedBatch(**MIXED, num_heads=8, num_kv_heads=1, head_dim=64, block_size=block_size)
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


@pytest.mark.parametrize("head_dim", [80, 256])  # 80 is padded to 128 inside the kernel
def test_paged_attention_other_head_dims(head_dim):
    batch = PagedBatch(**MIXED, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16)
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


@pytest.mark.parametrize("offsets_64", [False, True], ids=["offsets32", "offsets64"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_paged_attention_long_prompts(monkeypatch, offsets_64, num_heads, num_kv_heads):
    """Contexts long enough that most key tiles are seen whole by every row of a program (the loop
    without masks) beside the diagonal's and the last tile's (with them): a prompt of several
    query tiles, a chunk after a prefix, a decode row; with 32- and 64-bit cache offsets."""
    from kiln.ops.triton import attention

    if offsets_64:
        monkeypatch.setattr(attention, "MAX_INT32_OFFSET", 0)
    batch = PagedBatch(query_lens=[130, 70, 1], seq_lens=[130, 400, 300], num_heads=num_heads,
                       num_kv_heads=num_kv_heads, head_dim=64, block_size=16)
    assert attention.needs_64bit_offsets(batch.kv_cache[0]) == offsets_64
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


def test_attention_cache_offsets_widen_past_int32():
    from kiln.ops.triton.attention import needs_64bit_offsets

    # [2, blocks, 16 slots, 8 heads, 128]: a block is 2**14 elements of each half
    assert not needs_64bit_offsets(torch.empty(2, 2**17 - 1, 16, 8, 128, device="meta")[0])
    assert needs_64bit_offsets(torch.empty(2, 2**17, 16, 8, 128, device="meta")[0])


@pytest.mark.parametrize("kv_splits", [2, 4, 16])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
def test_paged_attention_split_kv(shape, kv_splits, poisoned_empty):
    """The last split of each tile to finish merges the partials; it leaves the counters at zero.
    Splits past a context's last key tile store nothing (the partials start as NaN here), and a
    context of one key tile takes no merge."""
    from kiln.ops.triton import attention

    batch = PagedBatch(**shape, num_heads=12, num_kv_heads=4, head_dim=64, block_size=16)
    for _ in range(2):  # the second launch finds the counters the first left
        assert_attention_matches(batch, batch.kernel_output(kv_splits=kv_splits), batch.reference_output())
        assert not attention._merge_counters(batch.query.device).any()


@pytest.mark.parametrize("kv_splits", [1, 4])
@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
def test_paged_attention_sliding_window(shape, window, kv_splits):
    """Each query sees its last `window` positions only (itself included), split or not."""
    batch = PagedBatch(**shape, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    expected = batch.reference_output(window=window)
    assert not torch.allclose(expected[:batch.num_actual_tokens], batch.reference_output()[:batch.num_actual_tokens])
    assert_attention_matches(batch, batch.kernel_output(window=window, kv_splits=kv_splits), expected)


@pytest.mark.parametrize("kv_splits", [1, 4])
@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
def test_paged_attention_softcap(shape, kv_splits):
    """Gemma 2's soft-capped scores (head dim 256), with its sliding window and without. The
    scores are scaled up so that the cap bites: uncapped attention must differ."""
    batch = PagedBatch(**shape, num_heads=4, num_kv_heads=2, head_dim=256, block_size=16)
    batch.scale = 0.5
    for window in (0, 7):
        expected = batch.reference_output(window=window, softcap=5.0)
        n = batch.num_actual_tokens
        assert not torch.allclose(expected[:n], batch.reference_output(window=window)[:n], atol=1e-3)
        assert_attention_matches(batch, batch.kernel_output(window=window, softcap=5.0, kv_splits=kv_splits), expected)


def test_paged_attention_long_decode_splits_automatically():
    batch = PagedBatch(query_lens=[1, 1], seq_lens=[700, 1030], num_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=32, dtype=torch.float16)
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


def test_paged_attention_skips_empty_padding_sequences():
    # CUDA-graph padding may add sequences with no queries and no context.
    batch = PagedBatch(query_lens=[3, 0, 1, 0], seq_lens=[40, 0, 20, 0], num_heads=4, num_kv_heads=2,
                       head_dim=64, block_size=16)
    assert_attention_matches(batch, batch.kernel_output(), batch.reference_output())


@pytest.mark.parametrize("kv_splits", [None, 4])
def test_paged_attention_decode_with_padding_sequences(kv_splits):
    # One query token at most per sequence: the launch maps tile i to sequence i (no search).
    batch = PagedBatch(query_lens=[1, 0, 1, 0, 1], seq_lens=[40, 0, 161, 0, 1], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16)
    assert batch.meta.max_query_len == 1
    assert_attention_matches(batch, batch.kernel_output(kv_splits=kv_splits), batch.reference_output())


@pytest.mark.parametrize("kv_splits", [1, 4])
def test_paged_attention_decode_with_heads_first_grid(kv_splits):
    # The grid ordered (kv heads, tiles, splits): same programs, another launch order; the split
    # merge's counters and partials are indexed by tile and kv head alike.
    batch = PagedBatch(query_lens=[1, 0, 1, 1], seq_lens=[40, 0, 300, 1], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16)
    tiles = AttentionTiles(block_m=16, block_n=32, num_warps=2, num_stages=2, heads_first=True)
    assert_attention_matches(batch, batch.kernel_output(tiles=tiles, kv_splits=kv_splits), batch.reference_output())


def test_prefill_tiles_run_heads_first_longest_tiles_first_and_fall_back_past_the_grid_limit(monkeypatch):
    """A prefill or mixed launch puts a sequence's kv heads side by side and takes its query tiles
    last first; past CUDA's limit on a grid's second dimension the chosen tiles go tiles first
    instead, and tiles the caller picked are refused with the way out."""
    from kiln.ops.triton import attention

    assert choose_tiles(64, 4, 128).heads_first and choose_tiles(64, 2, 256).heads_first
    batch = PagedBatch(**MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    expected = batch.reference_output()
    assert_attention_matches(batch, batch.kernel_output(), expected)
    monkeypatch.setattr(attention, "MAX_GRID_TILES", 2)
    assert_attention_matches(batch, batch.kernel_output(), expected)
    with pytest.raises(ValueError, match="heads_first=False"):
        batch.kernel_output(tiles=choose_tiles(64, 4, 64))


def test_long_prompts_take_128_row_tiles():
    # From 1536 query tokens on, prefill takes 128-row tiles (32 tokens of a 4-head group here) of 8
    # warps under a register cap, over prompts that end mid-tile and beside decode rows.
    tiles = choose_tiles(1536, 4, 64)
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.heads_first, tiles.max_registers) == (
        128, 64, 8, True, 128)
    assert choose_tiles(1024, 4, 128).block_m == 64 and choose_tiles(2048, 256, 128).block_m == 256
    assert choose_tiles(1024, 4, 128).max_registers is None
    assert choose_tiles(2048, 4, 128, element_size=4).block_m == 64  # fp32's tiles would not fit shared memory
    batch = PagedBatch(**MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    assert_attention_matches(batch, batch.kernel_output(tiles=tiles), batch.reference_output())


def test_paged_attention_decode_tiles_of_a_large_batch():
    # What a decode batch that fills the GPU gets (64-key tiles, 3 stages, a sequence's kv heads
    # side by side), on contexts that are not tile multiples.
    tiles = choose_tiles(1, 4, 128, programs=64 * 8, device=torch.device(DEVICE))
    assert (tiles.block_n, tiles.num_stages, tiles.heads_first) == (64, 3, True)
    assert choose_tiles(1, 4, 128, programs=8, device=torch.device(DEVICE)).block_n == 128
    batch = PagedBatch(query_lens=[1] * 5, seq_lens=[160, 1, 65, 129, 300], num_heads=8, num_kv_heads=2,
                       head_dim=128, block_size=16, dtype=torch.float16)
    assert_attention_matches(batch, batch.kernel_output(tiles=tiles), batch.reference_output())
    # The largest batches' 32-key tiles of 2 warps.
    largest = choose_tiles(1, 4, 128, programs=256 * 8, device=torch.device(DEVICE))
    assert (largest.block_n, largest.num_warps) == (32, 2)
    assert_attention_matches(batch, batch.kernel_output(tiles=largest), batch.reference_output())


def test_paged_attention_decode_of_wide_heads_splits_short_contexts():
    # Gemma 2's 256-wide heads: 32-key tiles pipelined 2 deep, 8 warps while the batch is small,
    # and contexts split once they hold two such tiles (Llama's heads need 256 keys for that).
    device = torch.device(DEVICE)
    assert choose_tiles(1, 2, 256, programs=8, device=device) == AttentionTiles(16, 32, 8, 2)
    assert choose_tiles(1, 2, 256, programs=64 * 8, device=device) == AttentionTiles(16, 32, 4, 2)
    batch = PagedBatch(query_lens=[1] * 3, seq_lens=[160, 1, 45], num_heads=4, num_kv_heads=2,
                       head_dim=256, block_size=16, dtype=torch.float16)
    assert choose_kv_splits(batch.meta, 2, device, head_dim=256) == 4
    assert choose_kv_splits(batch.meta, 2, device, head_dim=128) == 1
    expected = batch.reference_output(window=100, softcap=5.0)
    assert_attention_matches(batch, batch.kernel_output(window=100, softcap=5.0), expected)


@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_then_attention_on_qkv_views(block_size):
    batch = PagedBatch(**MIXED, num_heads=9, num_kv_heads=3, head_dim=64, block_size=block_size)
    assert not batch.key.is_contiguous() and not batch.query.is_contiguous()
    kernel_cache, reference_cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    write_kv(batch.key, batch.value, kernel_cache, batch.meta.slot_mapping)
    write_kv_reference(batch.key, batch.value, reference_cache, batch.meta.slot_mapping)
    assert torch.equal(kernel_cache, reference_cache)
    out = batch.kernel_output(kernel_cache)
    assert_attention_matches(batch, out, batch.reference_output(reference_cache))


def test_attention_rejects_unsupported_inputs():
    batch = PagedBatch(**DECODE, num_heads=4, num_kv_heads=4, head_dim=64, block_size=16)
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(batch.query[:, :3], batch.kv_cache, out[:, :3], batch.meta, batch.scale)
    with pytest.raises(ValueError, match="power of two"):
        paged_attention(batch.query, batch.kv_cache, out, batch.meta, batch.scale, kv_splits=3)
    with pytest.raises(ValueError, match="cache"):
        write_kv(batch.key.half(), batch.value.half(), batch.kv_cache, batch.meta.slot_mapping)


# ---------------------------------------------------------------------------- GPU compilation, without a GPU


def test_gumbel_argmax_scaled_as_read_draws_what_the_scaled_rows_draw():
    """With a temperature the kernel divides as it reads, rounding as torch divides: the same
    draws as from the scaled rows written out (a threshold landing exactly on a scaled value)."""
    from kiln.ops.triton import argmax

    logits = randn(6, 5000) * 4
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.3, 2.0, 0.05], device=DEVICE)
    scaled = logits / temperature.unsqueeze(-1)
    threshold = scaled.topk(40, dim=-1).values[:, -1]
    seeds = torch.arange(6, device=DEVICE) * 977
    assert torch.equal(argmax.gumbel_argmax(logits, threshold, seeds, temperature),
                       argmax.gumbel_argmax(scaled, threshold, seeds))


def test_kept_mass_sums_the_kept_softmax_mass_of_the_scaled_rows():
    """Top-p's normaliser in one read: exp(x / T - top) over the scaled logits at or above the
    threshold, against torch's passes; one chunk and several (with a ragged last), a threshold
    keeping all (-inf), one exactly on a value, and a row of -inf (NaN, as torch gives)."""
    from kiln.ops.triton.kept_mass import kept_mass

    for width in (300, 2 * 4096 + 5):
        x = randn(5, width) * 3
        x[4] = float("-inf")
        temperature = torch.tensor([[0.5], [1.0], [1.7], [0.8], [1.0]], device=DEVICE)
        s = x / temperature
        top = s.amax(dim=-1, keepdim=True)
        tau = torch.stack([torch.tensor(float("-inf"), device=DEVICE), s[1].topk(7).values[-1], top[2, 0] - 2,
                           s[3, width - 1], torch.tensor(float("-inf"), device=DEVICE)]).unsqueeze(-1)
        want = (s - top).exp().masked_fill(s < tau, 0).sum(dim=-1, keepdim=True)
        got = kept_mass(x, temperature, top, tau)
        torch.testing.assert_close(got[:4], want[:4], rtol=1e-6, atol=0)
        assert got[4].isnan().all() and want[4].isnan().all()


def test_kernels_compile_for_sm90():
    """Compile each kernel to a cubin for sm_90 (H100/H200) in a process not in interpret mode."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, os.path.abspath(__file__), "compile-sm90"], env=env, cwd=root,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def _compile_all_for_sm90() -> None:
    import re
    import tempfile
    from pathlib import Path

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kiln.ops.triton import gemv
    from kiln.ops.triton.kernels import activation, attention, moe, norm, rotary
    from kiln.ops.triton.kernels import argmax as argmax_kernels
    from kiln.ops.triton.kernels import gemv as gemv_kernels
    from kiln.ops.triton.kernels import kept_mass as kept_mass_kernels

    def build(kernel, args: dict, constants: dict, num_warps=4, num_stages=3, pdl=(0, 1), max_registers=None):
        # Each with programmatic dependent launch off and on (kiln.ops.triton.dependent_launch):
        # on, the kernel must wait for its predecessor (griddepcontrol.wait), off it must not.
        for mode in pdl:
            if mode is not None:  # None: a kernel kiln never launches dependently
                constants = dict(constants, PDL=mode)
            # Pointers and strides are marked 16-divisible, as the launcher marks real ones.
            signature, attrs = {}, {}
            for index, name in enumerate(kernel.arg_names):
                if name in constants:
                    signature[name] = "constexpr"
                    continue
                signature[name] = args[name]
                if args[name].startswith("*") or "stride" in name:
                    attrs[(index,)] = [["tt.divisibility", 16]]
            compiled = compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": bool(mode),
                                        **({"maxnreg": max_registers} if max_registers else {})})
            assert ("griddepcontrol.wait" in compiled.asm["ptx"]) == bool(mode), (kernel.__name__, constants)
            print("compiled", kernel.__name__, constants)
        return compiled

    def registers(compiled) -> int:
        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        with tempfile.TemporaryDirectory() as folder:
            cubin = Path(folder) / "kernel.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                                   capture_output=True, text=True, check=True).stdout
        return int(re.search(r"REG:(\d+)", usage).group(1))

    bf16, f32, i32 = "*bf16", "fp32", "i32"
    build(norm.rms_norm_kernel, dict(x_ptr=bf16, weight_ptr=bf16, out_ptr=bf16, x_row_stride=i32,
                                      out_row_stride=i32, hidden_size=i32, eps=f32),
          dict(BLOCK=4096, UNIT_OFFSET=False), 16)
    for unit_offset in (False, True):
        build(norm.fused_add_rms_norm_kernel,
              dict(x_ptr=bf16, residual_ptr=bf16, weight_ptr=bf16, out_ptr=bf16, new_residual_ptr=bf16,
                   x_row_stride=i32, residual_row_stride=i32, out_row_stride=i32, hidden_size=i32, eps=f32),
              dict(BLOCK=4096, UNIT_OFFSET=unit_offset), 16)
    for gumbel, scaled in ((False, False), (True, False), (True, True)):
        build(argmax_kernels.argmax_kernel,
              dict(x_ptr="*fp32", out_ptr="*i64", part_value_ptr="*fp32", part_index_ptr="*i32", counter_ptr="*i32",
                   width=i32, x_row_stride=i32, threshold_ptr="*fp32", seed_ptr="*i64", temperature_ptr="*fp32"),
              dict(BLOCK=4096, CHUNKS=32, GUMBEL=gumbel, SCALED=scaled), 8)
    build(kept_mass_kernels.kept_mass_kernel,
          dict(x_ptr="*fp32", temperature_ptr="*fp32", top_ptr="*fp32", threshold_ptr="*fp32", part_ptr="*fp32",
               width=i32, x_row_stride=i32, chunks=i32), dict(BLOCK=4096), 8, pdl=(None,))
    for gelu_tanh in (False, True):
        build(activation.gated_activation_kernel, dict(x_ptr=bf16, out_ptr=bf16, x_row_stride=i32,
                                                       out_row_stride=i32, width=i32),
              dict(BLOCK=1024, GELU_TANH=gelu_tanh))
    for write_kv in (False, True):
        build(rotary.rotary_kernel,
              dict(positions_ptr="*i64", q_ptr=bf16, k_ptr=bf16, cache_ptr="*fp32", q_out_ptr=bf16, k_out_ptr=bf16,
                   q_token_stride=i32, k_token_stride=i32, cache_row_stride=i32, num_q_heads=i32, num_kv_heads=i32,
                   v_ptr=bf16, key_cache_ptr=bf16, value_cache_ptr=bf16, slot_mapping_ptr="*i64",
                   v_token_stride=i32, cache_block_stride=i32, cache_slot_stride=i32, cache_head_stride=i32,
                   block_size=i32, num_slots=i32),
              dict(HEAD_DIM=128, ROTARY_DIM=128, BLOCK_DIM=128, BLOCK_Q_HEADS=32, BLOCK_KV_HEADS=8, WRITE_KV=write_kv))
    build(attention.write_kv_kernel,
          dict(key_ptr=bf16, value_ptr=bf16, key_cache_ptr=bf16, value_cache_ptr=bf16, slot_mapping_ptr="*i64",
               key_token_stride=i32, key_head_stride=i32, value_token_stride=i32, value_head_stride=i32,
               cache_block_stride=i32, cache_slot_stride=i32, cache_head_stride=i32, num_kv_heads=i32,
               block_size=i32),
          dict(HEAD_DIM=128, BLOCK_HEADS=8, BLOCK_DIM=128))
    attention_args = dict(
        key_cache_ptr=bf16, value_cache_ptr=bf16, block_tables_ptr="*i32", seq_lens_ptr="*i32",
        query_start_loc_ptr="*i32", partial_acc_ptr="*fp32", partial_max_ptr="*fp32", partial_sum_ptr="*fp32",
        counter_ptr="*i32", num_seqs=i32, scale_log2=f32, query_token_stride=i32, query_head_stride=i32,
        out_token_stride=i32, out_head_stride=i32, block_table_stride=i32, cache_block_stride=i32, cache_slot_stride=i32,
        cache_head_stride=i32, window=i32, softcap_log2=f32,
    )
    # Decode split and not (the tiles of small and large batches), prefill, fp32; windowed decode and
    # prefill; Gemma 2's (head dim 256, windowed or not, soft-capped) decode and prefill.
    for dtype, group, head_dim, block_m, block_n, splits, one_query, stages, window, softcap in [
            ("bf16", 4, 128, 16, 128, 8, True, 3, False, False), ("bf16", 4, 128, 16, 64, 1, True, 2, False, False),
            ("bf16", 3, 64, 64, 64, 1, False, 3, False, False), ("fp32", 1, 128, 64, 64, 1, False, 3, False, False),
            ("bf16", 4, 128, 16, 128, 8, True, 3, True, False), ("bf16", 4, 128, 64, 64, 1, False, 3, True, False),
            ("bf16", 2, 256, 16, 32, 4, True, 3, True, True), ("bf16", 2, 256, 64, 32, 1, False, 3, False, True)]:
        pointer = "*" + dtype
        build(attention.paged_attention_kernel,
              dict(attention_args, query_ptr=pointer, key_cache_ptr=pointer, value_cache_ptr=pointer, out_ptr=pointer),
              dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_DIM=head_dim,
                   BLOCK_SIZE=16, KV_SPLITS=splits, DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
                   ONE_QUERY=one_query, HAS_WINDOW=window, HAS_SOFTCAP=softcap,
                   HEADS_FIRST=one_query and head_dim == 128, OFFSETS_64=dtype == "fp32"),
              4, stages)
    # The long-prompt tile as choose_tiles gives it: its register cap reaches ptxas (8 warps at <= 128
    # registers: two blocks a SM; uncapped, ptxas takes 186 and an SM holds one).
    tiles = choose_tiles(2048, 4, 128)
    compiled = build(attention.paged_attention_kernel, dict(attention_args, query_ptr=bf16, out_ptr=bf16),
                     dict(GROUP=4, HEAD_DIM=128, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_DIM=128,
                          BLOCK_SIZE=16, KV_SPLITS=1, DOT_PRECISION="tf32", ONE_QUERY=False, HAS_WINDOW=False,
                          HAS_SOFTCAP=False, HEADS_FIRST=tiles.heads_first, OFFSETS_64=False),
                     tiles.num_warps, tiles.num_stages, pdl=(0,), max_registers=tiles.max_registers)
    assert tiles.max_registers and registers(compiled) <= tiles.max_registers, registers(compiled)
    # The MoE grouped GEMM: both launches (gate/up of the routed rows, weighted down), decode and prefill blocks.
    moe_args = dict(a_ptr=bf16, b_ptr=bf16, c_ptr=bf16, weight_ptr="*fp32", sorted_pairs_ptr="*i32",
                    block_expert_ptr="*i32", num_pairs=i32, N=i32, K=i32, a_row_stride=i32, b_expert_stride=i32,
                    b_row_stride=i32, c_row_stride=i32)
    for top_k_div, weighted, block_m in ((8, False, 16), (1, True, 16), (2, False, 64), (1, True, 64)):
        build(moe.moe_gemm_kernel, moe_args, dict(TOP_K_DIV=top_k_div, WEIGHTED=weighted, BLOCK_M=block_m,
                                                  BLOCK_N=64, BLOCK_K=64, DOT_PRECISION="tf32"),
              pdl=(None,))
    # Every GEMV config the autotuner may pick at Llama-3-8B shapes, at every padded row count.
    gemv_args = dict(x_ptr=bf16, w_ptr=bf16, out_ptr=bf16, ws_ptr="*fp32", counter_ptr="*i32", M=i32, N=i32,
                     K=i32, x_row_stride=i32, w_row_stride=i32, out_row_stride=i32)
    # (Without dependent launch; each kernel's first config at each row count with its first chunk
    # loaded before the wait too.)
    for rows in (1, 2, 4):
        for i, config in enumerate(c for c in gemv.FMA_CONFIGS if gemv.config_fits(c, rows, 4096, 4096, 132, fma=True)):
            build(gemv_kernels.gemv_fma_kernel, gemv_args, dict(BLOCK_M=rows, EVEN_K=True, ACTIVATION="",
                                                                **config.kwargs),
                  config.num_warps, config.num_stages, pdl=(0, 2) if i == 0 else (0,))
    for rows in (16, 32, 64):
        for i, config in enumerate(c for c in gemv.DOT_CONFIGS if gemv.config_fits(c, rows, 4096, 4096, 132, fma=False)):
            build(gemv_kernels.gemv_dot_kernel, gemv_args, dict(BLOCK_M=rows, EVEN_K=True, DOT_PRECISION="tf32",
                                                                **config.kwargs),
                  config.num_warps, config.num_stages, pdl=(0, 2) if i == 0 else (0,))
    # The down projection's gated loads (act(gate) * up), on the config kiln's H200 table picks for it.
    for act in gemv.ACTIVATIONS:
        build(gemv_kernels.gemv_fma_kernel, gemv_args, dict(BLOCK_M=1, EVEN_K=True, ACTIVATION=act,
                                                     **gemv.FMA_CONFIGS[0].kwargs), 4, 3, pdl=(0, 1, 2))
    fp32_args = dict(gemv_args, x_ptr="*fp32", w_ptr="*fp32", out_ptr="*fp32")
    build(gemv_kernels.gemv_fma_kernel, fp32_args, dict(BLOCK_M=2, EVEN_K=False, ACTIVATION="",
                                                 **gemv.FMA_CONFIGS[0].kwargs), pdl=(0, 2))
    build(gemv_kernels.gemv_dot_kernel, fp32_args, dict(BLOCK_M=16, EVEN_K=False, DOT_PRECISION="ieee",
                                                 **gemv.DOT_CONFIGS[4].kwargs), pdl=(0, 2))


if __name__ == "__main__" and sys.argv[1:] == ["compile-sm90"]:
    _compile_all_for_sm90()
