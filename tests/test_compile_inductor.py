"""Compiled with Inductor: outputs match eager, ranges and sizes dispatch, nothing recompiles.

Inductor compiles cost seconds each on CPU: the eager-strategy model is built once per
session (conftest.compiled_tiny_llama); the other tests here hit its FX-graph cache.
"""

import logging
import sys

import pytest
import torch

from kiln.compile import compile_model
from kiln.compile.config import CompilationConfig
from kiln.compile.shapes import TokenShape

# Two ranges ([1, 8], [9, 64]) and two exact sizes (4, 16), from the fixture's config.
TOKEN_COUNTS = (1, 3, 4, 8, 9, 16, 17, 40, 64)


def _inputs(n, seed=0):
    gen = torch.Generator().manual_seed(seed + n)
    return torch.randint(0, 512, (n,), generator=gen), torch.arange(n)


def _relative_error(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def test_logits_match_eager_across_ranges_and_sizes(compiled_tiny_llama, tiny_llama):
    plan = compiled_tiny_llama.backend.plan
    shapes = {plan.shape_for(n) for n in TOKEN_COUNTS}
    assert sum(not s.is_size for s in shapes) >= 2 and sum(s.is_size for s in shapes) >= 2
    compiles = compiled_tiny_llama.stats["inductor_compiles"]
    for n in TOKEN_COUNTS:
        ids, pos = _inputs(n)
        got = tiny_llama.compute_logits(compiled_tiny_llama(ids, pos))
        want = tiny_llama.compute_logits(tiny_llama(ids, pos))
        assert _relative_error(got, want) <= 1e-4, n
    stats = compiled_tiny_llama.stats
    assert stats["graphs_seen"] == 1  # no recompile after the first call
    assert stats["inductor_compiles"] == compiles and stats["compiles_after_capture"] == 0


def test_identical_pieces_compile_once_per_shape(compiled_tiny_llama):
    stats = compiled_tiny_llama.stats
    assert (stats["pieces"], stats["unique_pieces"], stats["opaque_regions"]) == (3, 3, 2)
    assert stats["inductor_compiles"] == 3 * 4  # unique pieces x (2 ranges + 2 sizes)


def test_dispatch_prefers_the_exact_size(compiled_tiny_llama):
    plan = compiled_tiny_llama.backend.plan
    assert plan.shape_for(4) == TokenShape(4, 4)
    assert plan.shape_for(5) == TokenShape(1, 8)
    assert plan.shape_for(16) == TokenShape(16, 16)
    assert plan.shape_for(64) == TokenShape(9, 64)
    pieces = compiled_tiny_llama.backend.pieces
    assert pieces.table(4) is not pieces.table(5) and pieces.table(5) is pieces.table(6)


def test_eager_strategy_never_compiles_while_serving(compiled_tiny_llama):
    pieces = compiled_tiny_llama.backend.pieces
    assert pieces.frozen
    with pytest.raises(RuntimeError, match="while serving"):
        pieces.compile(TokenShape(2, 2))


def test_lazy_strategy_specialises_a_size_on_first_use(tiny_llama, caplog, capsys, monkeypatch):
    # The progress bar is drawn on a terminal only (in a log it would glue lines together).
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    config = CompilationConfig(mode=3, strategy="lazy", compile_ranges=[8], compile_sizes=[4, 16])
    compiled = compile_model(tiny_llama, config, 64)
    with caplog.at_level(logging.INFO, logger="kiln.compile"):
        compiled(*_inputs(12))  # capture: compiles the range that holds 12 tokens only
        assert compiled.stats["inductor_compiles"] == 3
        compiled(*_inputs(16))
        assert compiled.stats["inductor_compiles"] == 6 and compiled.stats["compiles_after_capture"] == 3
        ids, pos = _inputs(16, seed=1)
        torch.testing.assert_close(compiled(ids, pos), tiny_llama(ids, pos), rtol=1e-4, atol=1e-4)
        assert compiled.stats["inductor_compiles"] == 6
    assert compiled.stats["cache_hits"] >= 3  # the same pieces were compiled by the fixture
    text = caplog.text
    assert "Dynamo bytecode transform time: " in text
    assert "Compiling a graph for range [9, 64] took " in text
    assert "Compiling a graph for size 16 took " in text
    assert "torch.compile took " in text
    assert "3 pieces (3 unique)" in text
    assert "compiling size 16" in capsys.readouterr().err  # the progress bar


@pytest.mark.parametrize("mode", [1, 2])
def test_whole_graph_modes_match_eager(tiny_llama, mode):
    compiled = compile_model(tiny_llama, CompilationConfig(mode=mode, backend="inductor"), 64)
    for n in (6, 1, 64):
        ids, pos = _inputs(n)
        got, want = compiled(ids, pos), tiny_llama(ids, pos)
        assert _relative_error(got, want) <= 1e-4, n
    assert (compiled.capture.direct is not None) == (mode == 2)


def _paged_step(model_fn, kv_caches, ids, start, block_size=4):
    """One step of one sequence whose tokens [start, start + len(ids)) go to blocks 0, 1, ..."""
    from kiln.forward_context import AttentionMetadata, set_forward_context

    n, total = len(ids), start + len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(start, total), block_tables=torch.arange(4, dtype=torch.int32)[None],
        seq_lens=torch.tensor([total], dtype=torch.int32), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        max_query_len=n, max_seq_len=total, num_actual_tokens=n, seq_lens_cpu=[total], query_start_loc_cpu=[0, n])
    with set_forward_context(meta, kv_caches):
        return model_fn(ids, torch.arange(start, total))


def test_opaque_attention_reads_the_forward_context_at_run_time(compiled_tiny_llama, tiny_llama):
    # Prefill 5 tokens, then decode 2: the compiled graph must not have baked in any cache state.
    def caches():
        return {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 4, 4, 2, 16) for i in range(2)}

    eager_kv, compiled_kv = caches(), caches()
    ids, _ = _inputs(7)
    for start, end in ((0, 5), (5, 6), (6, 7)):
        want = _paged_step(tiny_llama, eager_kv, ids[start:end], start)
        got = _paged_step(compiled_tiny_llama, compiled_kv, ids[start:end], start)
        assert _relative_error(got, want) <= 1e-4, (start, end)
    for name in eager_kv:
        torch.testing.assert_close(compiled_kv[name], eager_kv[name], rtol=1e-4, atol=1e-5)
