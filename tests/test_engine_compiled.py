"""The engine on the compiled forward (-O2): paged KV cache, continuous batching, same tokens."""

from kiln import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The quick brown fox", "Machine learning is"]


def test_compiled_engine_tokens_equal_eager_engine(llm):
    compiled = LLM("smollm2", device="cpu", dtype="float32", max_num_batched_tokens=256,
                   compilation={"mode": 3})
    runner = compiled.engine.runner
    assert runner.compiled.mode == 3 and runner.compiled.capture is not None
    stats_after_start = dict(runner.compiled.stats)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = [o.token_ids for o in compiled.generate(PROMPTS, params)]
    want = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    stats = runner.compiled.stats
    assert stats["graphs_seen"] == 1 and stats["compiles_after_capture"] == 0
    assert stats["inductor_compiles"] == stats_after_start["inductor_compiles"]
    timeline = compiled.engine.timeline.as_dict()["phases_s"]
    assert timeline["dynamo"] > 0 and timeline["inductor"] > 0


def test_a_compiled_engine_shut_down_frees_its_model():
    """Dynamo must not keep a shut-down engine's model (and its weights) alive, after a capture
    (its cache entry on the code) or a warm start (its process-wide backend table): a process
    that starts engine after engine would run out of memory."""
    import gc
    import weakref

    for _ in range(2):  # the second start is warm: the first kept the compile-cache entry
        engine = LLM("tiny-llama", device="cpu", dtype="float32", num_kv_blocks=80, compilation_config=2)
        engine.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))  # captured or loaded
        model = weakref.ref(engine.engine.runner.model)
        weight = weakref.ref(engine.engine.runner.model.model.layers[0].mlp.down_proj.weight)
        engine.shutdown()
        del engine
        gc.collect()
        assert model() is None and weight() is None
