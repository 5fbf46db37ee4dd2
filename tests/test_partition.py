"""Inductor graph-partition mode: no FX split; the whole captured graph goes to Inductor,
which partitions it at the split ops itself. Through the engine (paged KV cache, mixed
prefill and decode batches), greedy tokens equal the eager engine's."""

import torch

from kiln import LLM, SamplingParams

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


def test_the_cuda_graph_hook_over_partitions_exists():
    # What the CUDA-graph layer will use to wrap each partition (docs/compile-passes.md).
    import torch._inductor.utils

    assert callable(torch._inductor.utils.set_customized_partition_wrappers)
    assert "custom_should_partition_ops" in torch._inductor.config._config
