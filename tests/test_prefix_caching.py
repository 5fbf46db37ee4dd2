"""Automatic prefix caching: full KV blocks keyed by a chained hash of their tokens, shared
between sequences with reference counts, kept after a request ends in an LRU pool that is
evicted only when blocks are needed. Tokens are those of the engine without it; a shared
block is never freed under a live sequence; no block leaks."""

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.block_manager import BlockManager
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=256)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = tokens(40, seed=0)  # ten full blocks of 4
PROMPTS = [SYSTEM + tokens(n, seed=n) for n in (5, 9, 17)]


def seq(ids: list[int], name: str = "s") -> Sequence:
    return Sequence(name, None, ids, SamplingParams(max_tokens=4), None)


def computed(bm: BlockManager, s: Sequence, n: int) -> None:
    """As a step would: allocate for n more tokens and count them computed."""
    bm.allocate(s, n)
    s.num_computed_tokens += n


def test_a_prompt_shares_the_cached_blocks_of_its_prefix_and_computes_the_rest():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    first = seq(SYSTEM + [1, 2, 3])
    bm.share(first, bm.cached_prefix(first))
    computed(bm, first, first.num_tokens)
    bm.cache_full_blocks(first)
    second = seq(SYSTEM + [7, 8])
    hit = bm.cached_prefix(second)
    assert hit == first.block_table[:10]  # the 40 shared tokens; the last blocks differ
    assert bm.can_allocate(second, 2, hit)
    bm.share(second, hit)
    assert second.num_computed_tokens == 40 and all(bm.ref_counts[b] == 2 for b in hit)
    assert (bm.stats.queries, bm.stats.hits) == (first.num_tokens + second.num_tokens, 40)


def test_the_last_token_is_always_computed_and_a_differing_block_ends_the_hit():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    first = seq(SYSTEM)
    computed(bm, first, 40)
    bm.cache_full_blocks(first)
    # The same 40 tokens: 9 blocks shared, the tenth computed again for the last token's logits.
    assert len(bm.cached_prefix(seq(SYSTEM))) == 9
    changed = SYSTEM[:17] + [SYSTEM[17] + 1] + SYSTEM[18:]
    assert len(bm.cached_prefix(seq(changed))) == 4  # block 4 holds token 17: it and all after differ


def test_a_hash_collision_costs_a_recompute_not_wrong_tokens():
    bm = BlockManager(32, 4, enable_prefix_caching=True)
    first = seq(SYSTEM)
    computed(bm, first, 40)
    bm.cache_full_blocks(first)
    other = [t + 1 for t in SYSTEM]
    key = hash((None, tuple(other[:4])))
    bm.cached[key] = first.block_table[0]  # as if the other prompt's first block hashed the same
    assert bm.cached_prefix(seq(other)) == []


def test_freed_blocks_stay_cached_until_needed_and_go_least_recently_used_first():
    bm = BlockManager(12, 4, enable_prefix_caching=True)
    a, b = seq(tokens(16, 1), "a"), seq(tokens(16, 2), "b")
    for s in (a, b):
        computed(bm, s, 16)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 12 and len(bm.evictable) == 8
    # Fresh blocks go first; then the least recently freed cached ones (a's, its tail first).
    c = seq(tokens(24, 3), "c")
    computed(bm, c, 24)
    assert len(bm.evictable) == 6 and len(bm.cached_prefix(seq(tokens(16, 1)))) == 2
    assert len(bm.cached_prefix(seq(tokens(16, 2)))) == 3  # b's blocks untouched (its last block is recomputed)


def test_preemption_never_frees_a_block_another_sequence_shares():
    bm = BlockManager(24, 4, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = seq(SYSTEM + [1], "a"), seq(SYSTEM + [2], "b")
    sched.add(a)
    sched.schedule()
    a.num_computed_tokens = a.num_tokens
    sched.add(b)
    sched.schedule()
    shared = b.block_table[:10]
    assert shared == a.block_table[:10]
    sched._preempt(a)
    assert all(bm.ref_counts[block] == 1 for block in shared)
    assert not set(shared) & (set(bm.free_blocks) | set(bm.evictable))


def engine_outputs(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference():
    """The tokens without prefix caching: each prompt alone, then all together."""
    plain = LLM("tiny-llama", enable_prefix_caching=False, **ENGINE)
    assert plain.engine.scheduler.block_manager.stats.queries == 0
    return [engine_outputs(plain, [p])[0] for p in PROMPTS], engine_outputs(plain, PROMPTS)


def test_engine_tokens_equal_the_engine_without_it(reference):
    alone, together = reference
    llm = LLM("tiny-llama", **ENGINE)
    bm = llm.engine.scheduler.block_manager
    assert [engine_outputs(llm, [p])[0] for p in PROMPTS] == alone
    # The second and third prompt found the system prompt's ten blocks.
    assert (bm.stats.hits, bm.stats.queries) == (80, sum(map(len, PROMPTS)))
    assert engine_outputs(llm, PROMPTS) == together
    assert bm.stats.hits > 80 + 3 * 40  # the second round found whole prompts (and earlier outputs)
    assert bm.num_free_blocks == ENGINE["num_kv_blocks"] and sum(bm.ref_counts) == 0


def test_async_scheduling_with_preemption_and_shared_prefixes(reference):
    # A cache too small for all three at once: sequences are preempted and come back on their
    # own cached blocks, beside others that share the system prompt.
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0.8, seed=3),
              SamplingParams(max_tokens=3, temperature=0)]
    small = dict(ENGINE, num_kv_blocks=24, max_model_len=96, max_num_batched_tokens=16)
    want = [o.token_ids for o in LLM("tiny-llama", enable_prefix_caching=False, **small).generate(PROMPTS, params)]
    for async_scheduling in (False, True):
        llm = LLM("tiny-llama", async_scheduling=async_scheduling, **small)
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want, async_scheduling
        engine = llm.engine
        assert engine.scheduler.num_preemptions > 0 and engine.scheduler.block_manager.stats.hits > 0
        assert engine.scheduler.block_manager.num_free_blocks == small["num_kv_blocks"]
        assert sum(engine.scheduler.block_manager.ref_counts) == 0


def test_an_abort_leaves_the_blocks_a_live_sequence_shares(reference):
    alone, _ = reference
    llm = LLM("tiny-llama", **ENGINE)
    engine = llm.engine
    engine_outputs(llm, [PROMPTS[0]])  # caches the system prompt
    engine.add_request(PROMPTS[1], GREEDY, "kept")
    engine.add_request(PROMPTS[2], GREEDY, "aborted")
    engine.step()
    kept, aborted = engine.seqs["kept"], engine.seqs["aborted"]
    assert kept.block_table[:10] == aborted.block_table[:10]
    engine.abort_request("aborted")
    while engine.has_unfinished():
        engine.step()
    assert kept.token_ids[kept.num_prompt_tokens:] == alone[1]
    assert engine.scheduler.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def test_a_512_token_shared_prefix_is_computed_once():
    engine_args = dict(device="cpu", dtype="float32", num_kv_blocks=256, max_model_len=1024)
    prefix = tokens(512, seed=11)
    prompts = [prefix + tokens(20, seed=12), prefix + tokens(9, seed=13)]
    plain = LLM("tiny-llama", enable_prefix_caching=False, **engine_args)
    want = [engine_outputs(plain, [p])[0] for p in prompts]
    llm = LLM("tiny-llama", **engine_args)
    bm = llm.engine.scheduler.block_manager
    assert engine_outputs(llm, [prompts[0]]) == [want[0]]
    computed = []
    runner = llm.engine.runner
    launch = runner.launch

    def counting(batch):
        computed.extend(batch.num_new_tokens)
        return launch(batch)

    runner.launch = counting
    assert engine_outputs(llm, [prompts[1]]) == [want[1]]
    # Its first step computed only the tail: the 512 tokens (32 blocks of 16) came from the cache.
    assert bm.stats.hits == 512 and computed[0] == len(prompts[1]) - 512


def test_64_requests_over_4_prefixes_with_random_aborts_leak_no_block():
    llm = LLM("tiny-llama", device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=128,
              max_num_seqs=16, max_num_batched_tokens=64)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    gen = torch.Generator().manual_seed(0)
    prefixes = [tokens(24, seed=100 + i) for i in range(4)]
    for i in range(64):
        tail = torch.randint(3, 500, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen).tolist()
        engine.add_request(prefixes[i % 4] + tail, SamplingParams(max_tokens=int(torch.randint(1, 16, (1,),
                                                                                                generator=gen))),
                           f"r{i}")
    live, aborted = [f"r{i}" for i in range(64)], 0
    while engine.has_unfinished():
        engine.step()
        if torch.rand(1, generator=gen).item() < 0.3:
            running = [r for r in live if r in engine.requests]
            if running:
                engine.abort_request(running[int(torch.randint(len(running), (1,), generator=gen))])
                aborted += 1
    assert aborted > 5 and bm.stats.hits > 0 and engine.scheduler.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks and sum(bm.ref_counts) == 0
    assert not engine.requests and not engine.seqs
