"""The engine end to end on the embedded SmolLM2: batching, preemption, stops, aborts."""

import dataclasses

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.engine.detokenizer import IncrementalDetokenizer

PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
    "My favourite food is", "In 1969, astronauts", "Water boils at", "The quick brown fox",
    "To make a cup of tea,", "The largest planet in the solar system", "Machine learning is",
    "Dear diary, today", "The recipe calls for", "Photosynthesis converts", "A haiku about autumn:",
    "The stock market",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llm):
    return [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS]


def test_batched_equals_alone(llm, alone):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == alone


def test_batched_equals_alone_with_preemption_and_chunked_prefill(alone):
    # 24 blocks of 4 tokens cannot hold 16 sequences of ~30 tokens: some are preempted
    # and recomputed; an 8-token budget also cuts every prompt into prefill chunks.
    small = LLM("smollm2", device="cpu", dtype="float32", block_size=4, num_kv_blocks=24,
                max_model_len=96, max_num_batched_tokens=8)
    outs = small.generate(PROMPTS, GREEDY)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == alone
    assert small.engine.scheduler.block_manager.num_free_blocks == 24


def test_start_up_warm_up_request_touches_no_kv_block(llm, alone):
    """The warm-up a CUDA start runs before serving (a prefill with the KV cache in place, then a
    sample): it writes nothing into the cache, and later requests answer as before."""
    runner = llm.engine.runner
    before = {name: cache.clone() for name, cache in runner.kv_caches.items()}
    runner._warm_up_requests()
    # Bitwise (unused cache memory may hold NaNs, which torch.equal never calls equal).
    assert all(torch.equal(before[name].view(torch.int32), cache.view(torch.int32))
               for name, cache in runner.kv_caches.items())
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == alone[0]


def test_start_up_warm_up_request_has_a_real_steps_block_table_width(llm, monkeypatch):
    """Triton specialises a kernel on its integer arguments' divisibility by 16, the block
    table's row stride among them: a warm-up with a narrower table than a real step's warms
    another attention kernel, and the first request compiles its own (1.5 s on the H100)."""
    from kiln.engine import runner as runner_module

    runner, seen = llm.engine.runner, []
    real = runner_module.set_forward_context

    def recording(meta, kv_caches):
        seen.append(meta)
        return real(meta, kv_caches)

    monkeypatch.setattr(runner_module, "set_forward_context", recording)
    runner._warm_up_requests()
    (meta,) = seen
    assert meta.block_tables.stride(0) == runner.cudagraphs.buffers.block_tables.stride(0)
    assert meta.block_tables.shape[1] * runner.block_size >= meta.max_seq_len


def test_kv_cache_profile_attends_over_a_paged_cache_not_the_reference_and_writes_no_block(llm, monkeypatch):
    """The KV-cache profile's forward takes the attention a step takes (the paged path, over a
    one-block cache: on a GPU the Triton kernel, here the CPU's), not the Python reference, whose
    scores matrix no step holds; its prompts fit the model's length, and it writes no slot."""
    from kiln.engine import runner as runner_module
    from kiln.ops import attention as attention_module

    runner = llm.engine.runner
    monkeypatch.setattr(runner, "config", dataclasses.replace(runner.config, max_num_batched_tokens=300))
    monkeypatch.setattr(runner, "max_model_len", 128)
    gib = 2**30
    for name, value in [("empty_cache", None), ("reset_peak_memory_stats", None), ("synchronize", None),
                        ("max_memory_allocated", gib), ("memory_allocated", 0), ("memory_reserved", 10 * gib),
                        ("mem_get_info", (70 * gib, 80 * gib))]:
        monkeypatch.setattr(torch.cuda, name, lambda *a, value=value: value)
    seen, references = [], []
    real_context = runner_module.set_forward_context
    monkeypatch.setattr(runner_module, "set_forward_context",
                        lambda meta, caches: seen.append((meta, caches)) or real_context(meta, caches))
    real_reference = attention_module.causal_attention_reference
    monkeypatch.setattr(attention_module, "causal_attention_reference",
                        lambda *a: references.append(a) or real_reference(*a))
    blocks = runner._profile_gpu_blocks()
    assert blocks == int(80 * gib * runner.config.gpu_memory_utilization - gib) // runner.bytes_per_block
    assert not references
    meta, caches = seen[0]
    assert meta.seq_lens_cpu == [128, 128, 44] and meta.num_actual_tokens == 300
    assert bool((meta.slot_mapping == -1).all())
    assert {cache.shape[1] for cache in caches.values()} == {1}
    assert meta.block_tables.stride(0) == runner.cudagraphs.buffers.block_tables.stride(0)


def test_kernel_recording_runs_the_kv_profiles_prefill_right_after_the_probe(llm, monkeypatch):
    """A cold GPU start records kiln's kernels on a run of each kind before it compiles: the
    KV-cache profile's prefill (max_num_batched_tokens rows: on a GPU, attention's long-prompt
    tiles) comes right after the probe, so its kernels compile beside the others', not after the
    compile phase."""
    from kiln.engine import runner as runner_module

    runner = llm.engine.runner
    monkeypatch.setattr(runner, "config", dataclasses.replace(runner.config, max_num_batched_tokens=96))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    runs = []
    monkeypatch.setattr(runner.cudagraphs.dispatcher, "captures", lambda: ["largest", "smallest"])
    monkeypatch.setattr(runner.cudagraphs, "warm_up", lambda caches, todo, eager=False: runs.append(todo))
    real_context = runner_module.set_forward_context
    monkeypatch.setattr(runner_module, "set_forward_context",
                        lambda meta, caches: runs.append(meta and meta.num_actual_tokens) or real_context(meta, caches))

    class Missing:  # something missing after the probe: every run follows
        launches = {"a kernel": "its launch"}
        compiler = None

    submitted = []
    runner._record_kernels(Missing(), runner.model, runner._kv_caches(1), type("C", (), {"submit": submitted.append})(),
                           eager=True)
    assert runs[:2] == [["smallest"], 96] and runs[-1] == ["largest"], runs
    assert submitted == ["its launch"]


def test_gemv_warm_up_attends_over_the_paged_cache_and_writes_no_block(llm, alone, monkeypatch):
    """The GEMV warm-up's forwards of 16 to 64 rows take a prefill's attention (on a GPU the Triton
    kernel a request runs), not the Python reference, which cost a quarter second of that phase on
    an H100; only its one-row forward runs without metadata. None writes a slot."""
    from kiln.engine import runner as runner_module
    from kiln.ops import attention as attention_module

    runner = llm.engine.runner
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    seen, references = [], []
    real_context = runner_module.set_forward_context
    monkeypatch.setattr(runner_module, "set_forward_context",
                        lambda meta, caches: seen.append(meta) or real_context(meta, caches))
    real_reference = attention_module.causal_attention_reference
    monkeypatch.setattr(attention_module, "causal_attention_reference",
                        lambda *a: references.append(a[0].shape[0]) or real_reference(*a))
    before = {name: cache.clone() for name, cache in runner.kv_caches.items()}
    runner._warm_gemv()
    assert [None if meta is None else meta.num_actual_tokens for meta in seen] == [None, 16, 32, 64]
    assert references and set(references) == {1}
    assert all(torch.equal(before[name].view(torch.int32), cache.view(torch.int32))
               for name, cache in runner.kv_caches.items())
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == alone[0]


def test_a_gpu_start_shortens_the_gil_switch_interval_and_puts_it_back(monkeypatch):
    """While a CUDA runner starts (its threads beside the engine's) the switch interval is short,
    after it the interpreter's own again; a CPU start leaves it alone (measured no faster)."""
    import sys

    from kiln.engine import gil_handoff, llm_engine

    before, seen = sys.getswitchinterval(), []

    class Runner:
        def __init__(self, *args):
            seen.append(sys.getswitchinterval())
            raise RuntimeError("stop here")

    monkeypatch.setattr(llm_engine, "ModelRunner", Runner)
    with pytest.raises(RuntimeError, match="stop here"):
        LLM("smollm2", device="cpu", dtype="float32")
    with pytest.raises(RuntimeError, match="stop here"), gil_handoff.quick_gil_handoff("cuda"):
        Runner()
    assert seen == [before, pytest.approx(gil_handoff.START_UP_SWITCH_INTERVAL)]
    assert sys.getswitchinterval() == before
    # Two starts on two threads, the first ending before the second: the interval stays short
    # until the last ends, and is then the interpreter's again.
    first, second = gil_handoff.quick_gil_handoff("cuda"), gil_handoff.quick_gil_handoff("cuda")
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(gil_handoff.START_UP_SWITCH_INTERVAL)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == before


def test_stop_string_cuts_text(llm):
    free = llm.generate("The capital of France is", SamplingParams(max_tokens=16, temperature=0))[0]
    stop = free.text.strip().split()[1]  # a word the model is known to produce
    out = llm.generate("The capital of France is",
                       SamplingParams(max_tokens=16, temperature=0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)


def test_stop_token_id_and_max_tokens(llm):
    free = llm.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 8
    out = llm.generate("Once upon a time",
                       SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[free.token_ids[3]]))[0]
    assert out.token_ids == free.token_ids[:4] and out.finish_reason == "stop"


def test_chat_stops_at_end_of_turn(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0))[0]
    assert out.finish_reason == "stop" and "Paris" in out.text
    assert out.token_ids[-1] in llm.engine.eos_token_ids
    # vLLM's chat options: the assistant's turn continued where the conversation leaves it.
    going_on = llm.chat([{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "The capital of France is"}],
                        SamplingParams(max_tokens=3, temperature=0), add_generation_prompt=False,
                        continue_final_message=True)[0]
    assert going_on.text.startswith(" Paris")


def test_allowed_tokens_truncation_and_detokenizing_as_vllm(llm):
    """vLLM's allowed_token_ids (greedy and sampled rows in one batch), truncate_prompt_tokens (the
    prompt's last k ids), skip_special_tokens and detokenize."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(" yes no maybe")
    free = llm.generate("Is the sky blue? Answer:", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)[0]
    only = [i for i in ids if i not in free.outputs[0].token_ids[:1]]
    outs = llm.generate(["Is the sky blue? Answer:"] * 2,
                        [SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=only),
                         SamplingParams(max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=only)], use_tqdm=False)
    assert all(t in only for o in outs for t in o.outputs[0].token_ids)
    with pytest.raises(ValueError, match=r"allowed_token_ids must lie in \[0, 49152\)"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[49152]), use_tqdm=False)

    prompt = tokenizer.encode("Once upon a time there was a small village by the sea")
    cut = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, truncate_prompt_tokens=4), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-4:]
    assert cut.outputs[0].token_ids == llm.generate(prompt[-4:], SamplingParams(max_tokens=5, temperature=0),
                                                    use_tqdm=False)[0].outputs[0].token_ids

    chat = tokenizer.encode_chat([{"role": "user", "content": "Say hi."}])
    plain, special = (llm.generate(chat, SamplingParams(max_tokens=40, temperature=0, skip_special_tokens=skip),
                                   use_tqdm=False)[0].outputs[0] for skip in (True, False))
    # The end-of-turn token that stops it is not text either way (as in vLLM); a special token inside is.
    assert plain.token_ids == special.token_ids and plain.token_ids[-1] in llm.engine.eos_token_ids
    assert special.text == plain.text
    inside = tokenizer.encode("<|im_start|>assistant\nHi")
    for skip, text in ((True, "assistant\nHi"), (False, "<|im_start|>assistant\nHi")):
        detokenizer = IncrementalDetokenizer(tokenizer, [], False, skip_special_tokens=skip)
        for token in inside:
            detokenizer.add(token)
        assert detokenizer.text == text
    silent = llm.generate(chat, SamplingParams(max_tokens=40, temperature=0, detokenize=False), use_tqdm=False)[0]
    assert silent.outputs[0].token_ids == plain.token_ids and silent.outputs[0].text == ""


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    first = llm.generate("Once upon a time", params)[0].token_ids
    batched = llm.generate(["Once upon a time", "The stock market"], [params, SamplingParams(max_tokens=5)])
    assert batched[0].token_ids == first
    other = llm.generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0.9, seed=99))[0]
    assert other.token_ids != first


def test_abort_returns_every_block(llm):
    engine = llm.engine
    free_before = engine.scheduler.block_manager.num_free_blocks
    rid = engine.add_request("Tell me a long story about a dragon.",
                             SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.scheduler.block_manager.num_free_blocks < free_before
    engine.abort_request(rid)
    assert engine.scheduler.block_manager.num_free_blocks == free_before
    assert not engine.has_unfinished()


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_kernel_recording_run_through_the_first_layers_of_each_kind_calls_every_op_pattern(family):
    """A start records kiln's kernels on the eager model through only the first two layers of
    each kind (kiln.engine.runner): every call a layer's modules get in the full model (module
    within its kind of layer, argument shapes, absent arguments: what picks a kernel) must come
    in the shorter run too, and the layers come back after."""
    import dataclasses
    import re

    from kiln.compile.layer_stamping import layer_kinds
    from kiln.config import CUSTOM_OPS
    from kiln.engine.runner import _first_layers_of_each_kind
    from kiln.models import build_model
    from kiln.models.presets import PRESETS

    base = PRESETS["tiny-llama" if family == "llama" else "gemma-2-9b"]
    arch = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                layer_types=base.layer_types[:6]) if family == "gemma2" else {}
    cfg = dataclasses.replace(base, num_layers=6, **arch)
    model = build_model(cfg, torch.float32, torch.device("cpu"), frozenset(CUSTOM_OPS) - {"skinny_linear"}, None)
    kind_of = {path: k for k, paths in enumerate(layer_kinds(model)) for path in paths}
    names = {m: re.sub(r"model\.layers\.\d+", lambda p: f"kind {kind_of[p.group()]}", name)
             for name, m in model.named_modules()}

    def calls() -> tuple[set, torch.Tensor]:
        seen = set()

        def record(module, args):
            seen.add((names[module], tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)))

        hook = torch.nn.modules.module.register_module_forward_pre_hook(record)
        try:
            with torch.inference_mode():
                out = model(torch.arange(5) * 7 % 256, torch.arange(5))
        finally:
            hook.remove()
        return seen, out

    full, out = calls()
    with _first_layers_of_each_kind(model):
        assert len(list(model.model.layers)) == (2 if family == "llama" else 4)
        fewer, _ = calls()
    assert fewer == full
    assert [name for name, _ in model.named_modules() if name.count(".") == 2] == \
        [f"model.layers.{i}" for i in range(6)]
    torch.testing.assert_close(model(torch.arange(5) * 7 % 256, torch.arange(5)), out, rtol=0, atol=0)
    with _first_layers_of_each_kind(model, per_kind=1):  # the first layer alone: no call with a residual
        assert calls()[0] < full
