"""Inductor graph-partition mode: no FX split; the whole captured graph goes to Inductor,
which partitions it at the split ops itself. Through the engine (paged KV cache, mixed
prefill and decode batches), greedy tokens equal the eager engine's; piecewise CUDA graphs
wrap each partition, with attention between them."""

import pytest
import torch

import kiln.ops.attention
from kiln import LLM, SamplingParams
from kiln.cudagraph.piecewise import CudagraphPiece
from kiln.forward_context import set_forward_context
from kiln.models.presets import PRESETS

PROMPTS = [[1, 5, 9, 33, 100, 7], [1, 200, 300], list(range(3, 40))]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_partition_mode_tokens_equal_eager():
    eager = LLM("tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=64)
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    llm = LLM("tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=64,
              compilation={"splitting_mode": "inductor_partition", "passes": ["fuse_add_rms_norm", "reinplace"]})
    compiled = llm.engine.runner.compiled
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    stats = compiled.stats
    # One piece, no opaque region between pieces: attention runs inside Inductor's code.
    assert (stats["pieces"], stats["opaque_regions"], stats["graphs_seen"]) == (1, 0, 1)
    assert stats["compiles_after_capture"] == 0
    assert compiled.describe().endswith("splitting inductor_partition, passes fuse_add_rms_norm, reinplace")
    settings = compiled.backend.inductor_config
    assert settings["graph_partition"] is True
    assert settings["custom_should_partition_ops"] == ["kiln::attention", "kiln::kv_cache_write",
                                                      "kiln::rotary_kv_cache_write"]


class RecordingPool:
    """Stands in for the CUDA-graph pool on the CPU: "captures" by running the function and
    remembering that it did (a real pool records the launches)."""

    def __init__(self):
        self.captured, self.inside = [], False

    def capture(self, fn, *args):
        self.inside = True
        try:
            out = fn(*args)
        finally:
            self.inside = False
        self.captured.append(fn)
        return RecordedGraph(out), out


class RecordedGraph:
    def __init__(self, out):
        self.out, self.replays = out, 0

    def replay(self, *args):
        self.replays += 1
        return self.out


@pytest.fixture
def partitions_on_the_cpu(monkeypatch, tmp_path):
    """Inductor partitions device code only; counting the CPU's kernels as device code makes it
    partition here. Its own caches: the partitioned code must not serve other tests."""
    import torch._inductor.scheduler

    monkeypatch.setattr(torch._inductor.scheduler.BaseSchedulerNode, "is_gpu", lambda self: True)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "kiln"))


def test_piecewise_graphs_wrap_each_inductor_partition(partitions_on_the_cpu, monkeypatch):
    eager = LLM("tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=64)
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    llm = LLM("tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=64,
              compilation={"splitting_mode": "inductor_partition", "cudagraph_mode": "PIECEWISE"})
    runner = llm.engine.runner
    compiled, graphs = runner.compiled, runner.cudagraphs
    partitions = compiled.backend.partitions
    layers = PRESETS["tiny-llama"].num_layers
    # One compiled shape (the range [1, 64]), cut at each layer's KV write and at its attention:
    # 2L + 1 partitions. Between the two ops sits a partition of no kernels (the KV write's result
    # passed on, attention's output allocated): Inductor keeps the op's output node out of the
    # op's own region. It is graphed too, so that allocation lives in graph memory.
    assert compiled.stats["partitions"] == len(partitions.slots) == 2 * layers + 1
    assert [slot.index for slot in partitions.slots] == list(range(2 * layers + 1))
    # Every partition runs through the CUDA-graph layer's wrapper; the one piece does not.
    assert all(isinstance(slot.run, CudagraphPiece) and slot.run.piece is slot.fn for slot in partitions.slots)
    assert compiled.piece_wrapper is None
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want

    # A capture of one bucket records each partition once, with attention outside every capture.
    pool = graphs.piecewise.pool = RecordingPool()
    attended = []
    real_attention = kiln.ops.attention.causal_attention_reference

    def attention(*args):
        attended.append(pool.inside)
        return real_attention(*args)

    monkeypatch.setattr(kiln.ops.attention, "causal_attention_reference", attention)
    ids = torch.tensor([1, 5, 9, 33, 100, 7, 8, 2])
    positions = torch.arange(8)
    with torch.inference_mode(), set_forward_context(None, {}):
        with graphs.piecewise.active(8, "capture"):
            captured = compiled(ids, positions)
        assert pool.captured == [slot.fn for slot in partitions.slots]
        assert attended == [False] * layers
        with graphs.piecewise.active(8, "replay"):
            replayed = compiled(ids, positions)
    assert [slot.run.by_bucket[8].replays for slot in partitions.slots] == [1] * (2 * layers + 1)
    assert torch.equal(captured, replayed)
    assert len(attended) == 2 * layers  # attention ran between the replayed partitions too


def test_without_the_cuda_graph_layer_partitions_run_directly(partitions_on_the_cpu):
    llm = LLM("tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=64,
              compilation={"splitting_mode": "inductor_partition", "cudagraph_mode": "FULL"})
    slots = llm.engine.runner.compiled.backend.partitions.slots
    assert slots and all(slot.run is slot.fn for slot in slots)


def test_inspect_shows_the_partitions_and_their_graphs(partitions_on_the_cpu):
    from kiln.compile.config import CompilationConfig
    from kiln.config import EngineConfig
    from kiln.tools.inspect_cmd import inspect_model, render

    compilation = CompilationConfig.level(2, splitting_mode="inductor_partition")
    config = EngineConfig(model="tiny-llama", device="cpu", dtype="float32", max_num_batched_tokens=32,
                          compilation=compilation)
    report = inspect_model(config)
    layers = PRESETS["tiny-llama"].num_layers
    assert report["partitions"] == {"artifacts": 1, "functions": 2 * layers + 1, "per_artifact": [2 * layers + 1]}
    text = render(report)
    assert (f"Inductor partitions: {2 * layers + 1} per compiled artifact (1 artifacts, {2 * layers + 1} functions)"
            in text)
    assert "piecewise CUDA graphs: one per partition and bucket" in text
