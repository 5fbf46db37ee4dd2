"""kiln's CPU kernels (kiln/ops/cpu) against their references. Paged attention (the C++ kernel,
and torch's SDPA for prompt chunks and, unbuilt, decode batches) against the Python reference: one
call for a step's decode rows and prefill chunks, GQA, windows, soft-capping, fp32 and bf16; an
engine on it gives the reference's tokens; a start without a build runs the reference and builds
nothing. RMSNorm and residual add + RMSNorm against the native path; the KV-cache write against
the reference's."""

import logging

import pytest
import torch

from kiln.ops.attention import paged_attention_cpu, write_kv_cpu
from kiln.ops.attention_reference import paged_attention_reference, write_kv_reference
from kiln.ops.cpu import extension

from test_attention_reference import _metadata


@pytest.fixture(scope="module")
def built(cpu_kernels_dir, tmp_path_factory):
    """The kernel (the session's build, or one made here where that failed) loaded from its cache
    root, unloaded afterwards, so other test modules keep running the reference whatever their order."""
    root = cpu_kernels_dir.parent if cpu_kernels_dir is not None else tmp_path_factory.mktemp("cpu-kernel-root")
    mp = pytest.MonkeyPatch()
    mp.setenv("KILN_CACHE_ROOT", str(root))
    mp.setattr(extension, "_loaded", None)
    library = extension.build()
    yield library
    mp.undo()


def _case(seed, seq_lens, query_lens, hq, hkv, d, block_size, dtype):
    gen = torch.Generator().manual_seed(seed)
    meta = _metadata(seq_lens, query_lens, block_size, 160, gen)
    cache = torch.randn(2, 160, block_size, hkv, d, generator=gen).to(dtype)
    query = torch.randn(sum(query_lens), hq, d, generator=gen).to(dtype)
    return query, cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, softcap", [(0, 0.0), (7, 0.0), (0, 5.0), (5, 2.0)])
@pytest.mark.parametrize("hq, hkv, d, block_size", [(8, 2, 64, 16), (4, 4, 32, 4), (6, 1, 16, 8)])
def test_kernel_matches_the_reference(built, dtype, window, softcap, hq, hkv, d, block_size):
    # Prefill from scratch, decode rows, a chunk in mid-prompt, a context past one 32-key chunk
    # and not a multiple of the block size; 70 queries of one sequence take the matmul path (64-token
    # tiles over 256-key chunks: 300 tokens of context cross one).
    seq_lens, query_lens = [23, 1, 70, 41, 2, 300], [23, 1, 9, 1, 2, 70]
    query, cache, meta = _case(1, seq_lens, query_lens, hq, hkv, d, block_size, dtype)
    theirs = torch.full_like(query, float("nan"))
    paged_attention_reference(query, cache, theirs, meta, d**-0.5, window, softcap)
    ours = torch.full_like(query, float("nan"))
    paged_attention_cpu(query, cache, ours, meta, d**-0.5, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 10])
@pytest.mark.parametrize("kernel_built", [True, False])
@pytest.mark.parametrize("seq_lens, query_lens, decode_rows", [
    ([23, 1, 70, 41, 2, 300], [23, 1, 9, 1, 2, 70], None),  # 2 decode rows: the kernel's
    ([23, 1, 70, 41, 2, 300, 17, 33], [23, 1, 9, 1, 2, 70, 1, 1], 4)])
def test_sdpa_takes_prompt_chunks_and_decode_batches(built, dtype, window, kernel_built, seq_lens, query_lens,
                                                     decode_rows, monkeypatch):
    """Sequences with 64 or more queries in the step go to prefill_attention (window 10 leaves the
    first 221 keys of the 300-token context unread, 13 of them inside a block); without a built
    kernel, 4 or more decode rows whose longest context is long enough (here: 41 tokens, the floor
    lowered) together to decode_attention; the others to the kernel or, unbuilt, the reference:
    every row as the reference has it."""
    from kiln.ops import attention as attention_module
    from kiln.ops.cpu import sdpa_attention

    if not kernel_built:
        monkeypatch.setattr(attention_module, "cpu_kernel", lambda: None)
    else:
        decode_rows = None  # the threaded kernel is as quick: decode rows stay with it
    chunks, decodes = [], []
    prefill, decode = sdpa_attention.prefill_attention, sdpa_attention.decode_attention
    monkeypatch.setattr(sdpa_attention, "prefill_attention", lambda q, *a: chunks.append(q.shape[0]) or prefill(q, *a))
    monkeypatch.setattr(sdpa_attention, "decode_attention", lambda q, *a: decodes.append(q.shape[0]) or decode(q, *a))
    monkeypatch.setattr(sdpa_attention, "MIN_DECODE_CONTEXT", 32)  # contexts here are short
    query, cache, meta = _case(4, seq_lens, query_lens, 8, 2, 64, 16, dtype)
    theirs = torch.full_like(query, float("nan"))
    paged_attention_reference(query, cache, theirs, meta, 0.125, window, 0.0)
    ours = torch.full_like(query, float("nan"))
    paged_attention_cpu(query, cache, ours, meta, 0.125, window, 0.0)
    assert chunks == [70] and decodes == ([decode_rows] if decode_rows else [])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("query_scale", [1.0, 30.0, 1e4])
def test_kernel_softmax_holds_peaked_and_underflowing_scores(built, query_scale):
    """Scores hundreds to ~1e5 apart: most exponentials underflow to 0 (vector_exp.h's floor) and a
    row's weight sits on a key or two, in the SIMD tiles and the 64-query matmul tiles alike. Against
    an fp64 reference, the kernel's error stays within twice the fp32 reference's (at 30x the
    scores' rounding alone puts both ~2e-5 off)."""
    query, cache, meta = _case(4, [23, 1, 300, 41], [23, 1, 70, 1], 8, 2, 64, 16, torch.float32)
    query = query * query_scale
    exact = torch.empty_like(query, dtype=torch.float64)
    paged_attention_reference(query.double(), cache.double(), exact, meta, 64**-0.5, 0, 0.0)
    theirs = torch.full_like(query, float("nan"))
    paged_attention_reference(query, cache, theirs, meta, 64**-0.5, 0, 0.0)
    ours = torch.full_like(query, float("nan"))  # the kernel for every row (the engine sends 70 queries to SDPA)
    extension.kernel().paged_attention(query, cache, ours, meta.block_tables, meta.seq_lens_cpu,
                                       meta.query_start_loc_cpu, 64**-0.5, 0, 0.0)
    assert (ours.double() - exact).abs().max() <= 2 * (theirs.double() - exact).abs().max() + 1e-6


def test_padding_rows_past_the_last_sequence_are_left_alone(built):
    query, cache, meta = _case(2, [5, 1], [5, 1], 4, 2, 16, 4, torch.float32)
    padded = torch.cat([query, torch.zeros(2, 4, 16)])
    out = torch.full_like(padded, 7.0)
    paged_attention_cpu(padded, cache, out, meta, 0.25, 0, 0.0)
    assert torch.equal(out[6:], torch.full((2, 4, 16), 7.0))
    assert torch.isfinite(out[:6]).all()


def test_bad_input_is_refused_with_a_message(built):
    query, cache, meta = _case(3, [5], [5], 4, 2, 16, 4, torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="kv_cache and query must share a dtype"):
        extension.kernel().paged_attention(query, cache.double(), out, meta.block_tables, meta.seq_lens_cpu,
                                           meta.query_start_loc_cpu, 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="multiple of the cache's kv heads"):
        extension.kernel().paged_attention(torch.randn(5, 3, 16), cache, torch.empty(5, 3, 16), meta.block_tables,
                                           meta.seq_lens_cpu, meta.query_start_loc_cpu, 0.25, 0, 0.0)


def test_an_engine_on_the_kernel_gives_the_references_tokens(built, monkeypatch):
    from kiln import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    llm = LLM("smollm2", device="cpu", dtype="float32", block_size=16, num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=16)
    calls = []
    real = extension.kernel
    monkeypatch.setattr("kiln.ops.attention.cpu_kernel", lambda: calls.append(1) or real())
    ours = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls
    monkeypatch.setattr("kiln.ops.attention.cpu_kernel", lambda: None)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ours
    llm.shutdown()


def test_without_a_build_the_reference_runs_and_nothing_is_built(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path))
    monkeypatch.setattr(extension, "_loaded", None)
    monkeypatch.setattr(extension, "_said", False)
    monkeypatch.setattr(extension, "_absent", set())
    with caplog.at_level(logging.INFO, logger="kiln"):
        assert extension.kernel() is None and extension.kernel() is None
    assert sum("kiln prewarm --device cpu" in r.message for r in caplog.records) == 1
    assert not any(tmp_path.iterdir())


def test_the_build_dir_follows_the_cache_root_the_environment_names(tmp_path, monkeypatch):
    for name in ("a", "b", "a"):
        monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / name))
        assert extension.build_dir().parent.parent == tmp_path / name
    monkeypatch.delenv("KILN_CACHE_ROOT")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert extension.build_dir().is_relative_to(tmp_path / "home" / ".cache" / "kiln")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("shape", [(16, 576), (3, 5, 64), (0, 32), (300, 96)])
def test_rms_norm_kernels_match_the_native_path(built, dtype, unit_offset, shape):
    """The built kernels behind kiln::rms_norm and kiln::fused_add_rms_norm round where the native
    path does; only the sum of squares' order differs (fp32 to 1e-6; bf16 to a rounding step)."""
    from kiln.ops.norm import fused_add_rms_norm_native, rms_norm_native

    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x, residual = (torch.randn(*shape, generator=gen).mul(3).to(dtype) for _ in range(2))
    weight = torch.randn(shape[-1], generator=gen).to(dtype)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    ours = torch.ops.kiln.rms_norm(x, weight, 1e-6, unit_offset)
    assert torch.equal(ours, extension.kernel().rms_norm(x, weight, 1e-6, unit_offset))  # the op takes the kernel
    torch.testing.assert_close(ours, rms_norm_native(x, weight, 1e-6, unit_offset), **tol)
    out, new_residual = torch.ops.kiln.fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset)
    native_out, native_residual = fused_add_rms_norm_native(x, residual, weight, 1e-6, unit_offset)
    assert torch.equal(new_residual, native_residual)  # the sum is rounded as x + residual is
    assert torch.equal(out, extension.kernel().fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset)[0])
    torch.testing.assert_close(out, native_out, **tol)


def test_rms_norm_ops_fall_back_to_native_for_what_the_kernels_do_not_take(built):
    x = torch.randn(4, 64).to(torch.bfloat16)
    weight = torch.randn(64)  # fp32 weight under bf16 rows: the native path's promotion
    from kiln.ops.norm import rms_norm_native

    assert torch.equal(torch.ops.kiln.rms_norm(x, weight, 1e-6), rms_norm_native(x, weight, 1e-6))
    strided, ones = torch.randn(64, 4).t(), torch.ones(64)
    assert torch.equal(torch.ops.kiln.rms_norm(strided, ones, 1e-6), rms_norm_native(strided, ones, 1e-6))
    with pytest.raises(RuntimeError, match="weight and x must share a dtype"):
        extension.kernel().rms_norm(x, weight, 1e-6, False)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16 only"):
        extension.kernel().rms_norm(x.double(), weight.double(), 1e-6, False)


def test_rms_norm_kernel_rounds_bf16_as_torch_does_nan_included(built):
    """The kernel's own bf16 rounding (bit operations) against torch's, on sums of bf16 values over
    40 binades (ties to even among them), and NaN."""
    from kiln.ops.norm import fused_add_rms_norm_native

    gen = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(900, 64, generator=gen) * 2.0 ** torch.randint(-20, 20, (900, 64), generator=gen)
                   for _ in range(2))
    x, residual = x.to(torch.bfloat16), residual.to(torch.bfloat16)
    weight = torch.randn(64, generator=gen).to(torch.bfloat16)
    ours = extension.kernel().fused_add_rms_norm(x, residual, weight, 1e-6, False)
    assert torch.equal(ours[1], fused_add_rms_norm_native(x, residual, weight, 1e-6)[1])
    row = torch.randn(2, 64).to(torch.bfloat16)
    row[0, 3] = float("nan")
    out = extension.kernel().rms_norm(row, weight, 1e-6, False)
    assert out[0].isnan().all() and not out[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_kernel_matches_the_reference_padding_and_strided_rows_included(built, dtype):
    gen = torch.Generator().manual_seed(5)
    # keys and values as the fused qkv projection leaves them: views with strided rows
    qkv = torch.randn(600, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    key, value = qkv[:, 64:96].view(600, 2, 16), qkv[:, 96:].view(600, 2, 16)
    slots = torch.randperm(40 * 16, generator=gen)[:600]
    slots[[3, 250, 599]] = -1  # padding: left alone
    theirs, ours = torch.full((2, 40, 16, 2, 16), 7.0, dtype=dtype), torch.full((2, 40, 16, 2, 16), 7.0, dtype=dtype)
    write_kv_reference(key, value, theirs, slots)
    extension.kernel().write_kv(key.view(600, -1), value.view(600, -1), ours, slots)
    assert torch.equal(ours, theirs)
    assert ours.eq(7.0).sum() == 2 * (40 * 16 - 597) * 32


def test_kv_write_routes_to_the_kernel_and_refuses_bad_input(built, monkeypatch):
    cache = torch.zeros(2, 4, 4, 1, 8)
    calls = []
    real = extension.kernel
    monkeypatch.setattr("kiln.ops.attention.cpu_kernel", lambda: calls.append(1) or real())
    write_kv_cpu(torch.ones(2, 1, 8), torch.ones(2, 1, 8), cache, torch.tensor([1, 9]))
    assert calls and cache[:, 0, 1].eq(1).all() and cache[:, 2, 1].eq(1).all() and cache.sum() == 4 * 8
    write_kv_cpu(torch.ones(1, 1, 8, dtype=torch.float64), torch.ones(1, 1, 8, dtype=torch.float64), cache,
                 torch.tensor([2]))  # another dtype: the reference converts
    assert cache[:, 0, 2].eq(1).all()
    with pytest.raises(RuntimeError, match="slot 16 is past the cache's 16"):
        real().write_kv(torch.ones(1, 8), torch.ones(1, 8), cache, torch.tensor([16]))
    with pytest.raises(RuntimeError, match="must have the cache's dtype"):
        real().write_kv(torch.ones(1, 8).half(), torch.ones(1, 8).half(), cache, torch.tensor([0]))
    with pytest.raises(RuntimeError, match=r"must be \[tokens, 8\]"):
        real().write_kv(torch.ones(1, 4), torch.ones(1, 4), cache, torch.tensor([0]))
