"""The runner's in-graph sampling path (kiln.engine.sampling_graphs), reached on the CPU: the
decode steps' head is made to count as a graph's and the program runs uncaptured. Its tokens
against the eager sampler's with the same draw (Gumbel-max, the GPU's, interpreted here): the
GPU check of the captured graphs themselves is benchmarks/gpu_kernels.py's."""

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine import runner as runner_module
from kiln.engine.sampling_graphs import SamplingGraphs


def test_graph_path_tokens_equal_the_eager_samplers_and_unplain_batches_stay_eager(monkeypatch, gpu_draw):
    llm = LLM("tiny-llama", device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64, num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.sampling_graphs is None  # off by default, and the CPU has no graphs
    graphs = SamplingGraphs(4, runner.device)
    calls = []
    original = graphs.sample
    monkeypatch.setattr(graphs, "sample", lambda *a: calls.append(len(a[2])) or original(*a))
    monkeypatch.setattr(runner.cudagraphs, "head_in_graph", lambda choice: choice.phase == "decode")
    prompts = [[5 + i, 9, 17 + 3 * i, 40] for i in range(4)]
    plain = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.8, top_k=50, top_p=0.9, seed=1, ignore_eos=True),
             SamplingParams(max_tokens=9, temperature=1.2, min_p=0.05, seed=2, ignore_eos=True),
             SamplingParams(max_tokens=12, temperature=0.7, top_p=0.8, seed=3, ignore_eos=True, logprobs=2)]
    biased = plain[:3] + [SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True,
                                         logit_bias={7: 5.0})]
    eager = {}
    for params, in_graph in ((plain, True), (biased, False)):
        runs = []
        for use in (graphs, None):
            runner.sampling_graphs = use
            calls.clear()
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
            assert bool(calls) == (use is not None and in_graph)
        assert runs[0] == runs[1]
        assert [len(t) for t, _ in runs[0]] == [p.max_tokens for p in params]
        eager[in_graph] = runs[1]

    # A graph that cannot be captured (out of memory) leaves its steps to the eager sampler, which
    # then draws each seeded row's generator as it would have: the same tokens again.
    def out_of_memory(*args):
        captures.append(args)
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    captures = []
    monkeypatch.setattr(graphs, "pool", object())  # stands for the GPU's: the path that captures
    monkeypatch.setattr(graphs, "_capture", out_of_memory)
    runner.sampling_graphs = graphs
    outs = llm.generate(prompts, plain, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] == eager[True]
    assert graphs.failed and not graphs.graphs
    assert len(captures) == len(graphs.failed)  # each (bucket, cuts) tried once, not every step
    llm.shutdown()


def test_sample_in_graph_without_full_decode_graphs_is_refused_at_start(monkeypatch):
    with pytest.raises(ValueError, match="drop --sample-in-graph or decode in full graphs on a GPU"):
        LLM("tiny-llama", device="cpu", dtype="float32", num_kv_blocks=16, sample_in_graph=True)
    # Left at None it never refuses: where it cannot run it is off, whatever the default.
    monkeypatch.setattr(runner_module, "SAMPLE_IN_GRAPH_BY_DEFAULT", True)
    llm = LLM("tiny-llama", device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert llm.engine.runner.sampling_graphs is None
    llm.shutdown()
