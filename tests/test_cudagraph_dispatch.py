"""CUDA graph dispatch and padding, on the CPU (where the graph layer passes calls through).

The graphs themselves are checked on the GPU by benchmarks/cudagraphs.py (every mode
against eager); here: the bucket ladder, the padding table, which graph each batch goes
to, the settings' start-up errors, and that a padded step computes what an unpadded one
does (the engine's tokens with every step padded to a bucket equal the plain engine's).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig, compilation_config_from_dict, parse_compilation_args
from kiln.cudagraph.dispatcher import CudagraphDispatcher
from kiln.cudagraph.ladder import BucketTable, capture_ladder, mixed_batch_ladder
from kiln.cudagraph.pool import weak_view
from kiln.cudagraph.step_buffers import PackedStep, StepBuffers


def test_default_ladder():
    ladder = capture_ladder(512)
    assert ladder[:5] == [1, 2, 4, 8, 16]
    assert ladder[ladder.index(256) - 1] == 248 and ladder[ladder.index(256) + 1] == 272
    assert ladder[-1] == 512 and all(b - a == 16 for a, b in zip(ladder[ladder.index(256):], ladder[ladder.index(256) + 1:]))
    assert len(ladder) == 3 + 32 + 16
    assert capture_ladder(100)[-2:] == [96, 100]  # the max itself is always a bucket
    assert capture_ladder(1) == [1]


def test_mixed_batch_ladder_is_coarse_below_128_only():
    assert mixed_batch_ladder(128) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128]
    ladder = mixed_batch_ladder(512)
    fine = capture_ladder(512)
    assert ladder[ladder.index(128):] == fine[fine.index(128):]
    assert mixed_batch_ladder(100)[-2:] == [96, 100] and mixed_batch_ladder(1) == [1]
    # The mixed-batch phase takes it by default; the decode phase keeps the fine ladder; given
    # sizes are both phases'.
    d = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=64)
    assert d.prefill.buckets.sizes == mixed_batch_ladder(128) and d.decode.buckets.sizes == capture_ladder(64)
    assert d.choose(33, False).bucket == 48 and d.choose(33, True).bucket == 40
    given = dispatcher("FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1, 8, 24])
    assert given.prefill.buckets.sizes == given.decode.buckets.sizes == [1, 8, 24]


def test_bucket_table_pads_to_the_next_bucket():
    table = BucketTable([1, 2, 4, 8, 16])
    assert [table.bucket_for(n) for n in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8 + [None]
    assert table.bucket_for(0) is None


def dispatcher(mode: str, level: int = 2, max_num_seqs: int = 64, max_tokens: int = 2048, **extra):
    config = CompilationConfig.level(level, cudagraph_mode=mode, **extra)
    return CudagraphDispatcher.from_config(config, max_num_seqs, max_tokens, enabled=True)


@pytest.mark.parametrize("mode, decode, mixed", [
    ("NONE", "none", "none"),
    ("PIECEWISE", "piecewise", "piecewise"),
    ("FULL", "full", "full"),
    ("FULL_DECODE_ONLY", "full", "none"),
    ("FULL_AND_PIECEWISE", "full", "piecewise"),
])
def test_modes_pick_a_graph_per_phase(mode, decode, mixed):
    d = dispatcher(mode)
    got_decode, got_mixed = d.choose(5, uniform_decode=True), d.choose(5, uniform_decode=False)
    assert (got_decode.mode, got_mixed.mode) == (decode, mixed)
    assert got_decode.bucket == (8 if decode != "none" else None)
    assert got_mixed.padded(5) == (8 if mixed != "none" else 5)


def test_decode_above_its_largest_bucket_falls_back_to_prefill_graphs_then_none():
    d = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=64)  # decode buckets to 64, prefill to 128
    assert d.decode.buckets.max_size == 64 and d.prefill.buckets.max_size == 128
    assert (d.choose(64, True).phase, d.choose(64, True).mode) == ("decode", "full")
    assert (d.choose(65, True).phase, d.choose(65, True).mode, d.choose(65, True).bucket) == ("prefill", "piecewise", 80)
    assert (d.choose(129, True).mode, d.choose(129, True).bucket) == ("none", None)
    assert d.choose(129, False).compiler == "inductor"


def test_captures_go_largest_first_and_cover_every_bucket():
    d = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8)
    todo = [(p.name, n) for p, n in d.captures()]
    assert [n for _, n in todo] == sorted((n for _, n in todo), reverse=True)
    assert sorted(n for p, n in todo if p == "decode") == [1, 2, 4, 8]
    assert sorted(n for p, n in todo if p == "prefill") == [1, 2, 4, 8, 16]


def test_mixed_batch_graphs_wait_for_first_use_by_default():
    d = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8)
    assert (d.prefill.capture, d.decode.capture) == ("first_use", "start")
    assert [(p.name, n) for p, n in d.captures_at_start()] == [("decode", n) for n in (8, 4, 2, 1)]
    assert [(p.name, n) for p, n in d.deferred_captures()] == [("prefill", n) for n in (16, 8, 4, 2, 1)]
    assert "prefill piecewise (inductor, captured on first use, 5 buckets up to 16)" in d.describe()
    both = dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8, cudagraph_prefill={"capture": "start"})
    assert both.deferred_captures() == [] and both.captures_at_start() == both.captures()
    later = dispatcher("FULL", max_num_seqs=8, cudagraph_decode={"capture": "first_use"})
    assert later.captures_at_start() == [] and len(later.deferred_captures()) == 9


def test_explicit_sizes_max_and_per_phase_overrides():
    d = dispatcher("FULL_AND_PIECEWISE", cudagraph_capture_sizes=[1, 4, 32, 64], max_cudagraph_capture_size=32,
                   cudagraph_decode={"sizes": [1, 2, 3], "compiler": "eager"})
    assert d.prefill.buckets.sizes == [1, 4, 32]
    assert d.decode.buckets.sizes == [1, 2, 3] and d.decode.compiler == "eager"
    assert d.choose(3, True).bucket == 3 and d.choose(4, True).phase == "prefill"


def test_static_compile_decode_runs_eagerly_above_its_max():
    d = dispatcher("NONE", level=0, cudagraph_decode={"mode": "full", "static_compile": True, "static_max_batch": 8})
    assert d.decode.buckets.sizes == [1, 2, 4, 8]
    assert d.choose(8, True).mode == "full"
    above = d.choose(9, True)
    assert (above.mode, above.compiler) == ("none", "eager")


def test_cpu_dispatcher_passes_through():
    config = CompilationConfig.level(2)
    d = CudagraphDispatcher.from_config(config, 64, 2048, enabled=False)
    assert d.choose(3, True).mode == "none" and d.captures() == []
    assert "off" in d.describe()


@pytest.mark.parametrize("values, message", [
    ({"cudagraph_mode": "FULLISH"}, "cudagraph_mode must be one of"),
    ({"mode": 0, "cudagraph_mode": "PIECEWISE"}, "piecewise graphs replay the pieces"),
    ({"cudagraph_decode": {"mode": "piecewise", "compiler": "eager"}}, "use mode 'breakable'"),
    ({"cudagraph_decode": {"moed": "full"}}, "unknown key(s) moed"),
    ({"cudagraph_prefill": {"static_compile": True}}, "unknown key(s) static_compile"),
    ({"cudagraph_decode": {"mode": "breakable", "static_compile": True}}, "needs mode 'full'"),
    ({"mode": 0, "cudagraph_decode": {"compiler": "inductor"}}, "needs a compiled forward"),
    ({"cudagraph_capture_sizes": [8, 4]}, "strictly increasing"),
    ({"splitting_mode": "none", "cudagraph_mode": "PIECEWISE"}, "use cudagraph_mode FULL"),
    ({"max_cudagraph_capture_size": 0}, "positive integer"),
    ({"cudagraph_decode": {"max_batch": -1}}, "positive integer"),
    ({"cudagraph_prefill": {"capture": "later"}}, "capture must be one of start, first_use"),
])
def test_contradictions_fail_at_start_up(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compilation_config_from_dict(values)


def test_presets_and_cli():
    assert CompilationConfig.level(0).cudagraph_mode == "NONE"
    assert CompilationConfig.level(2).cudagraph_mode == "FULL_AND_PIECEWISE"
    assert CompilationConfig.level(2, mode=2).cudagraph_mode == "FULL"  # no split graph: whole graphs
    assert CompilationConfig.level(2, splitting_mode="none").cudagraph_mode == "FULL"
    # Inductor's partitions take the piecewise graphs that FX pieces take.
    assert CompilationConfig.level(2, splitting_mode="inductor_partition").cudagraph_mode == "FULL_AND_PIECEWISE"
    _, config = parse_compilation_args(["-O2", "-cc.cudagraph_mode=FULL_DECODE_ONLY",
                                        '-cc.cudagraph_decode={"max_batch": 16}'])
    assert config.cudagraph_mode == "FULL_DECODE_ONLY"
    assert config.phase_graphs("decode").max_batch == 16 and config.phase_graphs("prefill").mode == "none"


def test_step_buffers_pad_tokens_and_sequences():
    buffers = StepBuffers(max_tokens=16, max_seqs=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    step = PackedStep(input_ids=[5, 6, 7], positions=[0, 1, 9], slots=[32, 33, 57],
                      block_tables=[[2], [3, 1]], seq_lens=[2, 10], query_start_loc=[0, 2, 3])
    ids, pos, meta = buffers.load(step, num_tokens=8, num_seqs=4, max_query_len=8, max_seq_len=48)
    assert ids.tolist() == [5, 6, 7, 0, 0, 0, 0, 0] and pos.tolist() == [0, 1, 9, 0, 0, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [32, 33, 57, -1, -1, -1, -1, -1]  # padding writes no KV
    assert meta.query_start_loc.tolist() == [0, 2, 3, 3, 3]  # padded sequences own no tokens
    assert meta.seq_lens.tolist() == [2, 10, 0, 0]
    assert meta.block_tables[:2, :2].tolist() == [[2, 0], [3, 1]]
    assert (meta.max_query_len, meta.num_actual_tokens, meta.num_seqs) == (8, 3, 4)
    # The same bucket is the same memory every step: a graph finds its inputs where it left them.
    again = buffers.load(step, 8, 4, 8, 48)
    assert again[0].data_ptr() == ids.data_ptr() and again[2].seq_lens.data_ptr() == meta.seq_lens.data_ptr()
    # A smaller step after it, through the same host staging: the rows it does not fill are padding again.
    small = PackedStep(input_ids=[9], positions=[4], slots=[40], block_tables=[[6]], seq_lens=[5],
                       query_start_loc=[0, 1])
    ids, pos, meta = buffers.load(small, num_tokens=8, num_seqs=4, max_query_len=1, max_seq_len=48)
    assert ids.tolist() == [9] + [0] * 7 and meta.slot_mapping.tolist() == [40] + [-1] * 7
    assert meta.seq_lens.tolist() == [5, 0, 0, 0] and meta.query_start_loc.tolist() == [0, 1, 1, 1, 1]
    assert meta.block_tables[0, 0] == 6
    with pytest.raises(ValueError, match="does not fit"):
        buffers.load(step, num_tokens=32, num_seqs=4, max_query_len=1, max_seq_len=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging ring and its events need a GPU")
def test_step_buffers_staging_ring_waits_for_its_copies_on_cuda():
    # The stream is held up, so the host loads more steps than there are staging slots before any
    # copy has run: a slot written again too early would hand an older step the newer one's values.
    from kiln.cudagraph.step_buffers import STAGING_SLOTS

    buffers = StepBuffers(max_tokens=64, max_seqs=4, max_blocks_per_seq=8, device=torch.device("cuda"))
    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time ahead of the copies
    seen = []
    for i in range(2 * STAGING_SLOTS + 1):
        step = PackedStep(input_ids=[i] * 5, positions=[i] * 5, slots=[i] * 5, block_tables=[[i, i]],
                          seq_lens=[i + 5], query_start_loc=[0, 5])
        ids, pos, meta = buffers.load(step, num_tokens=8, num_seqs=2, max_query_len=5, max_seq_len=64)
        seen.append((ids.clone(), meta.block_tables[:1, :2].clone(), meta.seq_lens.clone()))
    torch.cuda.synchronize()
    for i, (ids, tables, seq_lens) in enumerate(seen):
        assert ids.tolist() == [i] * 5 + [0] * 3 and tables.tolist() == [[i, i]] and seq_lens.tolist() == [i + 5, 0]


def test_weak_view_aliases_without_owning():
    t = torch.arange(6.0).view(2, 3)[:, 1:]
    w = weak_view(t)
    assert w.data_ptr() == t.data_ptr() and w.shape == t.shape and w.stride() == t.stride()
    t.add_(1)
    assert torch.equal(w, t)


def test_padded_steps_give_the_same_tokens():
    """Every step padded to a full-graph bucket (tokens and sequences) through the CPU's
    pass-through graph layer: tokens equal the unpadded engine's, with chunked prefill."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(3, 40, (7,), generator=gen)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=24, num_kv_blocks=128, block_size=4, max_model_len=256)
    plain = [o.token_ids for o in LLM("tiny-llama", **kw).generate(prompts, params)]
    llm = LLM("tiny-llama", compilation=CompilationConfig.level(0, cudagraph_mode="FULL", max_cudagraph_capture_size=24), **kw)
    graphs = llm.engine.runner.cudagraphs
    graphs.dispatcher = CudagraphDispatcher.from_config(llm.engine.config.compilation_config, 4, 24, enabled=True)
    seen = []  # (real tokens, choice) per step
    pack = graphs.pack

    def recording_pack(step, uniform_decode):
        choice, inputs = pack(step, uniform_decode)
        seen.append((step.num_tokens, choice))
        return choice, inputs

    graphs.pack = recording_pack
    padded = [o.token_ids for o in llm.generate(prompts, params)]
    assert padded == plain
    assert {c.phase for _, c in seen} == {"prefill", "decode"} and all(c.mode == "full" for _, c in seen)
    assert any(c.bucket > n for n, c in seen), "no step was actually padded"


def test_decode_without_a_graph_reports_the_graphs_context_bound():
    """The GPU attention picks its split count (and so its rounding) from meta.max_seq_len; a
    full decode graph is captured with the model's bound, so a decode step that runs without a
    graph must report that bound too, or eager and graphed tokens part (Gemma 2 did on the H200)."""
    llm = LLM("tiny-llama", device="cpu", max_num_seqs=4, num_kv_blocks=64, block_size=4, max_model_len=96,
              compilation=CompilationConfig.level(0))
    graphs = llm.engine.runner.cudagraphs
    pack, seen = graphs.pack, []

    def recording_pack(step, uniform_decode):
        choice, inputs = pack(step, uniform_decode)
        seen.append((choice.mode, inputs[2].max_query_len, inputs[2].max_seq_len, max(step.seq_lens)))
        return choice, inputs

    graphs.pack = recording_pack
    llm.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    decodes = [bound for mode, query, bound, _ in seen if query == 1]
    prefills = [(bound, real) for mode, query, bound, real in seen if query > 1]
    assert {mode for mode, *_ in seen} == {"none"}
    assert decodes and set(decodes) == {96}
    assert prefills and all(bound == real for bound, real in prefills)


def _warmed_buckets(graphs) -> dict[str, list[int]]:
    """Per phase, the buckets whose capture capture_all would precede with a warm-up run."""
    warmed, out = set(), {"prefill": [], "decode": []}
    for phase, bucket in graphs.dispatcher.captures():
        if graphs._first_run(phase, bucket, warmed):
            out[phase.name].append(bucket)
    return out


def test_only_the_first_capture_of_each_compiled_shape_is_warmed_up(tiny_llama, compiled_tiny_llama, monkeypatch):
    from kiln.cudagraph.forward import ForwardCudagraphs

    def graphs(level: int):
        # Full graphs both phases: prefill buckets 1..64, decode 1..32, largest first.
        d = dispatcher("FULL", level=level, max_num_seqs=32, max_tokens=64)
        return ForwardCudagraphs(tiny_llama, compiled_tiny_llama, d,
                                 StepBuffers(64, 32, 4, torch.device("cpu")), max_model_len=64, max_num_seqs=32)

    # compiled_tiny_llama: ranges [1, 8] and [9, 64], sizes 4 and 16; each is its own code.
    assert _warmed_buckets(graphs(2)) == {"prefill": [64, 16, 8, 4], "decode": [32, 16, 8, 4]}
    assert _warmed_buckets(graphs(0)) == {"prefill": [64], "decode": [32]}  # the model's own forward
    # Code that may compile again for another count (stock torch.compile) is warmed at every bucket.
    monkeypatch.setattr(compiled_tiny_llama, "code_for", lambda n: None)
    every = graphs(2)
    assert _warmed_buckets(every) == {p.name: p.buckets.sizes[::-1] for p in (every.dispatcher.prefill,
                                                                              every.dispatcher.decode)}


def test_code_for_groups_counts_by_what_runs_them(compiled_tiny_llama, tiny_llama):
    from kiln.compile import compile_model
    from kiln.compile.config import CompilationConfig

    assert compiled_tiny_llama.code_for(5) == compiled_tiny_llama.code_for(8) != compiled_tiny_llama.code_for(4)
    assert compiled_tiny_llama.code_for(9) == compiled_tiny_llama.code_for(64)
    assert compile_model(tiny_llama, CompilationConfig(mode=0), 64).code_for(7) == "eager"
    assert compile_model(tiny_llama, CompilationConfig(mode=1), 64).code_for(7) is None


class _RecordingPool:
    """Stands in for CudagraphPool on the CPU: what ForwardCudagraphs' bookkeeping touches."""

    num_graphs, capture_s = 0, 0.0

    @contextlib.contextmanager
    def session(self, collect: bool = True):
        yield

    @contextlib.contextmanager
    def capturing(self):
        yield

    def memory_bytes(self) -> int:
        return 0


def _deferring_graphs(tiny_llama, compiled_tiny_llama, monkeypatch, fail: set = frozenset()):
    """ForwardCudagraphs over a FULL_AND_PIECEWISE dispatcher (decode buckets 1-8 at start,
    mixed-batch buckets 1-16 on first use) whose captures are recorded instead of made."""
    from kiln.cudagraph.forward import ForwardCudagraphs

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs = ForwardCudagraphs(tiny_llama, compiled_tiny_llama, dispatcher("FULL_AND_PIECEWISE", max_num_seqs=8),
                               StepBuffers(64, 8, 4, torch.device("cpu")), max_model_len=64, max_num_seqs=8)
    graphs.pool = _RecordingPool()
    made = []

    def capture(phase, bucket, kv_caches, warm_up):
        if (phase.name, bucket) in fail:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        made.append((phase.name, bucket))
        graphs.pool.num_graphs += 1
        graphs.graphs[(phase.name, bucket)] = "graph"

    monkeypatch.setattr(graphs, "_capture", capture)
    return graphs, made


def test_deferred_buckets_are_captured_on_first_use_and_when_idle(tiny_llama, compiled_tiny_llama, monkeypatch):
    graphs, made = _deferring_graphs(tiny_llama, compiled_tiny_llama, monkeypatch)
    graphs.capture_all({})
    assert made == [("decode", 8), ("decode", 4), ("decode", 2), ("decode", 1)]
    assert graphs.stats["deferred_buckets"] == 5 and len(graphs.deferred) == 5
    # A decode step's graph is there already; a mixed step of 3 tokens needs bucket 4, captured once.
    graphs.capture_for(8, uniform_decode=True)
    graphs.capture_for(3, uniform_decode=False)
    graphs.capture_for(4, uniform_decode=False)
    assert made[4:] == [("prefill", 4)]
    # Too many tokens for any bucket: nothing to capture.
    graphs.capture_for(40, uniform_decode=False)
    # An idle engine takes the rest, largest first, one a call.
    assert graphs.capture_next() and made[-1] == ("prefill", 16)
    while graphs.capture_next():
        pass
    assert made[5:] == [("prefill", 16), ("prefill", 8), ("prefill", 2), ("prefill", 1)]
    assert graphs.deferred == [] and graphs.stats["captured_after_start"] == 5
    assert graphs.stats["num_graphs"] == 9


def test_a_deferred_capture_that_fails_leaves_its_bucket_ungraphed(tiny_llama, compiled_tiny_llama, monkeypatch,
                                                                     caplog):
    graphs, made = _deferring_graphs(tiny_llama, compiled_tiny_llama, monkeypatch, fail={("prefill", 8)})
    graphs.capture_all({})
    with caplog.at_level("WARNING", logger="kiln"):
        graphs.capture_for(6, uniform_decode=False)
    assert "could not capture the prefill graph of bucket 8" in caplog.text
    assert ("prefill", 8) in graphs.failed and ("prefill", 8) not in graphs.graphs
    graphs.capture_for(6, uniform_decode=False)  # not tried again
    assert made[-1] == ("decode", 1) and ("prefill", 8) not in [b for b in made]
    # Its steps still run: the same forward, without a graph.
    choice = graphs.dispatcher.choose(6, uniform_decode=False)
    hidden, head = graphs.run(choice, torch.zeros(8, dtype=torch.long), torch.arange(8))
    assert hidden.shape[0] == 8 and head is None


class _ReplayingPool(_RecordingPool):
    """A CUDA graph's semantics on the CPU: a 'graph' keeps the function and the tensors it was
    captured with, and a replay runs the function on those same tensors and writes the result
    into the outputs the capture returned (a graph reads and writes fixed addresses)."""

    def capture(self, fn, *args):
        out = fn(*args)
        self.num_graphs += 1
        return _Replay(fn, args, out), out


class _Replay:
    def __init__(self, fn, args, out):
        self.fn, self.args, self.output = fn, args, out

    def replay(self, *args):
        fresh = self.fn(*self.args)
        for kept, new in zip(torch.utils._pytree.tree_leaves(self.output), torch.utils._pytree.tree_leaves(fresh)):
            kept.copy_(new)
        return self.output


def test_graphs_captured_on_first_use_and_when_idle_give_the_engines_tokens(monkeypatch):
    """The whole engine with graphs that replay as CUDA graphs do (fixed inputs and outputs),
    mixed-batch buckets left for first use: captures in the middle of a generate (async
    scheduling, a step in flight) and after it give the tokens of an engine without graphs."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (int(n),), generator=gen).tolist()
               for n in torch.randint(3, 30, (6,), generator=gen)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    kw = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=128, block_size=4,
              max_model_len=128, async_scheduling=True)  # on by default on GPUs only
    plain = [o.token_ids for o in LLM("tiny-llama", **kw).generate(prompts, params)]
    config = CompilationConfig.level(1, cudagraph_mode="FULL_AND_PIECEWISE", max_cudagraph_capture_size=16,
                                     cudagraph_prefill={"capture": "first_use"})
    llm = LLM("tiny-llama", compilation=config, **kw)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs = llm.engine.runner.cudagraphs
    graphs.dispatcher = CudagraphDispatcher.from_config(config, 4, 16, enabled=True)
    graphs.pool = graphs.piecewise.pool = _ReplayingPool()
    graphs.capture_all(llm.engine.runner.kv_caches)
    assert {phase for phase, _ in graphs.graphs} == {"decode"} and graphs.deferred
    assert llm.engine.async_scheduling
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
    used = graphs.stats["captured_after_start"]
    assert used > 0 and graphs.deferred, "no mixed step was captured on first use, or all were"
    while llm.engine.capture_deferred_graph():
        pass
    assert not graphs.deferred and graphs.stats["captured_after_start"] > used
    assert [o.token_ids for o in llm.generate(prompts, params)] == plain
