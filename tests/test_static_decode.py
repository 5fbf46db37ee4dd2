"""SGLang's static decode path (cudagraph_decode static_compile): the whole forward compiled by
Inductor for each decode bucket's exact size, decode batches padded to their bucket and
larger ones run eagerly. On the CPU the graphs pass through, but the padding and the
compile are the GPU's; the buckets are counted and kept in the compile cache."""

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compile.config import CompilationConfig

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
STATIC = CompilationConfig.level(0, cudagraph_decode={"mode": "full", "static_compile": True, "static_max_batch": 4})


def prompts(count: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(n),), generator=gen).tolist() for n in torch.randint(3, 30, (count,), generator=gen)]


def record_steps(llm: LLM) -> list[tuple[int, bool, object, int | None]]:
    """Per step from here on: (tokens, uniform decode, the choice, the token count the static
    forward ran with, if it ran)."""
    graphs = llm.engine.runner.cudagraphs
    forward, pack, steps = graphs.static_forward, graphs.pack, []

    def counted(ids, positions):
        steps[-1] = (*steps[-1][:3], len(ids))
        return forward(ids, positions)

    def recorded(step, uniform_decode):
        choice, inputs = pack(step, uniform_decode)
        steps.append((step.num_tokens, uniform_decode, choice, None))
        return choice, inputs

    graphs.static_forward, graphs.pack = counted, recorded
    return steps


@pytest.fixture
def own_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "kiln"))


def test_decode_takes_the_bucket_compile_up_to_its_max_and_eager_above(own_cache_root):
    eager = LLM("tiny-llama", **ENGINE)
    small, large = prompts(3, seed=1), prompts(6, seed=2)
    want = [[o.token_ids for o in eager.generate(p, GREEDY)] for p in (small, large)]

    llm = LLM("tiny-llama", compilation=STATIC, **ENGINE)
    static = llm.engine.runner.static_decode
    # Its own count: one Inductor compile per bucket (1, 2, 4) from one Dynamo capture.
    assert static.stats["inductor_compiles"] == 3 and static.stats["graphs_seen"] == 1
    assert sorted(static.backend.plan.sizes) == [1, 2, 4]
    steps = record_steps(llm)
    assert [o.token_ids for o in llm.generate(small, GREEDY)] == want[0]
    assert [o.token_ids for o in llm.generate(large, GREEDY)] == want[1]
    decodes = [(n, choice, ran) for n, uniform, choice, ran in steps if uniform]
    # Up to 4 sequences: the compile of their bucket (3 -> 4), padded; above: eager, unpadded.
    assert {n for n, _, _ in decodes} >= {3, 6}
    for n, choice, ran in decodes:
        bucket = next(b for b in (1, 2, 4, None) if b is None or b >= n)
        assert (choice.compiler, choice.bucket, ran) == (("static", bucket, bucket) if bucket else ("eager", None, None))
    # Prefill never takes the static forward.
    assert all(ran is None for _, uniform, _, ran in steps if not uniform)
    assert static.stats["compiles_after_capture"] == 0


def test_a_warm_start_loads_every_bucket_and_compiles_nothing(own_cache_root):
    cold = LLM("tiny-llama", compilation=STATIC, **ENGINE).engine.runner.static_decode.stats
    warm = LLM("tiny-llama", compilation=STATIC, **ENGINE).engine.runner.static_decode.stats
    assert cold["inductor_compiles"] == 3
    assert (warm["inductor_compiles"], warm["graphs_seen"], warm["pieces_loaded"]) == (0, 0, 3)
