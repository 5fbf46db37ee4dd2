"""Scheduler and block manager on their own, with no model."""

from kiln.engine.block_manager import BlockManager
from kiln.engine.sampling_params import SamplingParams
from kiln.engine.scheduler import Scheduler
from kiln.engine.sequence import Sequence, SequenceStatus


def _seq(name, n):
    return Sequence(name, None, list(range(1, n + 1)), SamplingParams(max_tokens=100), None)


def _run(batch):
    """Pretend the forward ran: count the tokens computed, and sample a token where caught up."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_new_prefill_joins_running_decodes():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    a = _seq("a", 10)
    sched.add(a)
    _run(sched.schedule())
    b = _seq("b", 6)
    sched.add(b)
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_new_tokens == [1, 6]


def test_prefill_is_chunked_by_the_token_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a, b = _seq("a", 20), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    sizes = []
    for _ in range(4):
        batch = sched.schedule()
        sizes.append([(s.seq_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens)])
        assert batch.num_tokens <= 8
        _run(batch)
    assert sizes[0] == [("a", 8)]
    assert sizes[1] == [("a", 8)]
    assert sizes[2] == [("a", 4), ("b", 3)]
    assert sizes[3] == [("a", 1), ("b", 1)]


def test_preemption_frees_blocks_and_requeues_the_newest():
    bm = BlockManager(6, 4)  # 24 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seq("a", 12), _seq("b", 12)  # 3 blocks each: the cache is full after prefill
    sched.add(a)
    sched.add(b)
    _run(sched.schedule())
    assert bm.num_free_blocks == 0
    batch = sched.schedule()  # a needs a 4th block for its 13th token: b must go
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert sched.waiting[0] is b and sched.num_preemptions == 1


def test_max_num_seqs_bounds_the_running_set():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for name in "abc":
        sched.add(_seq(name, 2))
    batch = sched.schedule()
    assert [s.seq_id for s in batch.seqs] == ["a", "b"]
    sched.finish(batch.seqs[0], "stop")
    assert [s.seq_id for s in sched.schedule().seqs] == ["b", "c"]


def test_finish_returns_blocks():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = _seq("a", 9)
    sched.add(a)
    sched.schedule()
    assert bm.num_free_blocks == 5
    sched.finish(a, "abort")
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()


def test_a_time_budget_cuts_prefill_chunks_and_never_decodes():
    from kiln.engine.scheduler import FIRST_PREFILL_TOKENS, MIN_PREFILL_TOKENS

    sched = Scheduler(BlockManager(512, 4), max_num_seqs=16, max_num_batched_tokens=1024, max_step_seconds=1.0)
    decoders = [_seq(f"d{i}", 2) for i in range(8)]
    for d in decoders:
        sched.add(d)
    batch = sched.schedule()  # their prompts: 2 tokens each, too few to cost
    _run(batch)
    sched.observe(batch, 0.3)
    assert sched.seconds_per_token is None
    long = _seq("long", 1500)
    sched.add(long)
    batch = sched.schedule()  # no cost known yet: a first chunk of fixed size
    assert batch.num_new_tokens == [1] * 8 + [FIRST_PREFILL_TOKENS]
    _run(batch)
    sched.observe(batch, FIRST_PREFILL_TOKENS * 0.01)  # no fixed part known: all of it is the prefill's
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 8 + [100]  # 10 ms a token: 100 fit in the second
    _run(batch)
    sched.observe(batch, 100 * 0.1)  # much slower (the context grew): the cost moves half way
    assert abs(sched.seconds_per_token - 0.055) < 1e-9
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 8 + [18]
    _run(batch)
    sched.observe(batch.__class__(batch.seqs, [1] * 8 + [20]), 10.0)  # too few prefill tokens to cost: ignored
    sched.observe(batch.__class__(batch.seqs, [40] * 9), 360 * 10.0)  # absurdly slow: floor
    batch = sched.schedule()
    assert batch.num_new_tokens == [1] * 8 + [MIN_PREFILL_TOKENS]  # every decode still runs


def test_the_time_budget_puts_a_steps_fixed_part_on_no_token():
    from kiln.engine.scheduler import MIN_PREFILL_TOKENS

    # A GPU step: ~6 ms whatever it computes (the weights' read), +0.03 ms a prefill token. Its
    # seconds over all its tokens would cut chunks until the budget's step holds ~70 tokens.
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=32, max_num_batched_tokens=2048, max_step_seconds=0.012)
    for i in range(20):
        sched.add(_seq(f"d{i}", 1))
    _run(sched.schedule())
    decode_only = sched.schedule()
    assert decode_only.num_new_tokens == [1] * 20
    sched.observe(decode_only, 0.006)
    assert sched.fixed_seconds == 0.006
    sched.add(_seq("prompt", 4000))
    batch = sched.schedule()
    prefill = batch.num_new_tokens[-1]
    sched.observe(batch, 0.006 + 0.00003 * prefill)
    assert abs(sched.seconds_per_token - 0.00003) < 1e-12
    _run(batch)
    assert sched.schedule().num_new_tokens[-1] in (199, 200)  # (12 - 6) ms / 0.03 ms, rounded down
    # One step 20x too slow (a compile, a collection) shrinks the chunk below what is costed by
    # size alone; steps that took all they were allowed still correct it.
    sched.observe(batch, 0.006 + 20 * 0.00003 * prefill)
    chunks = []
    for _ in range(8):
        small = sched.schedule()
        chunks.append(small.num_new_tokens[-1])
        sched.observe(small, 0.006 + 0.00003 * small.num_new_tokens[-1])
        _run(small)
    assert chunks[0] < 32 and chunks[-1] >= 150, chunks
    # Decode-only steps slower than the budget: prefill still moves, by the least chunk.
    sched.observe(decode_only, 0.030)
    sched.observe(decode_only, 0.030)
    assert sched._prefill_tokens() == MIN_PREFILL_TOKENS


def test_without_a_time_budget_only_tokens_bound_a_chunk():
    sched = Scheduler(BlockManager(512, 4), max_num_seqs=4, max_num_batched_tokens=1024)
    sched.add(_seq("long", 1500))
    batch = sched.schedule()
    sched.observe(batch, 1000.0)
    assert batch.num_new_tokens == [1024] and sched.seconds_per_token is None


def test_a_budget_no_step_with_prefill_can_keep_is_reported_once(caplog):
    from kiln.engine.scheduler import MIN_PREFILL_TOKENS

    # A GPU's eager mixed step: ~17 ms whatever its chunk, against a 12 ms budget and 8 ms decodes.
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=32, max_num_batched_tokens=2048, max_step_seconds=0.012)
    for i in range(4):
        sched.add(_seq(f"d{i}", 1))
    _run(sched.schedule())
    decode_only = sched.schedule()
    sched.observe(decode_only, 0.008)
    sched.add(_seq("prompt", 4000))
    chunks = []
    with caplog.at_level("WARNING", logger="kiln"):
        for _ in range(12):
            batch = sched.schedule()
            chunks.append(batch.num_new_tokens[-1])
            sched.observe(batch, 0.017)
            _run(batch)
    assert chunks[-1] == MIN_PREFILL_TOKENS, chunks
    warnings = [r.getMessage() for r in caplog.records if "max_step_seconds" in r.getMessage()]
    assert len(warnings) == 1 and "0.012" in warnings[0] and "Raise --max-step-seconds" in warnings[0]
    assert sched.warned_budget_too_small and sched.steps_over_budget == 12  # every mixed step, not the decode one
