"""The offline API speaks vLLM's shapes: its quickstart runs unchanged but for the import and
the model, outputs carry vLLM's fields, SamplingParams takes vLLM's names, and kiln logs its
start-up and compile lines by default."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln import SamplingParams
from kiln.logs import StandInHandler

HERE = Path(__file__).resolve().parent

# vLLM's quickstart (docs: "Offline Batched Inference"), but for the import and the model name.
QUICKSTART = '''
from kiln import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)

llm = LLM(model="smollm2")

outputs = llm.generate(prompts, sampling_params)

for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
'''


def _python(code: str, env=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_vllm_s_quickstart_runs_unchanged_but_for_the_import_and_the_model():
    run = _python(QUICKSTART)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert [line.split(", Generated text:")[0] for line in lines] == [
        "Prompt: 'Hello, my name is'", "Prompt: 'The president of the United States is'",
        "Prompt: 'The capital of France is'", "Prompt: 'The future of AI is'"]
    assert all(line.split("Generated text: ")[1] not in ("''", '""') for line in lines)
    # No logging configured: kiln's own handler printed the start-up.
    assert "kiln INFO ready after" in run.stderr


def test_request_outputs_have_vllm_s_fields(llm):
    params = SamplingParams(max_tokens=5, temperature=0, stop_token_ids=[])
    outs = llm.generate(["The capital of France is", "Once upon a time"], params, use_tqdm=False)
    for out in outs:
        (completion,) = out.outputs
        assert out.finished and completion.index == 0 and len(completion.token_ids) == 5
        assert completion.finish_reason == "length" and completion.stop_reason is None
        assert out.text == completion.text and out.token_ids == completion.token_ids  # shorthands of outputs[0]
        assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt)
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
        assert m.time_in_queue >= 0


def test_stop_reason_names_the_stop_string_or_token(llm):
    greedy = SamplingParams(max_tokens=8, temperature=0)
    ids = llm.generate("The capital of France is", greedy, use_tqdm=False)[0].outputs[0].token_ids
    by_token = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0,
                                                                    stop_token_ids=[ids[2]]), use_tqdm=False)[0]
    assert by_token.outputs[0].finish_reason == "stop" and by_token.outputs[0].stop_reason == ids[2]
    word = llm.get_tokenizer().decode(ids[1:3]).strip()
    by_text = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0, stop=[word]),
                           use_tqdm=False)[0]
    assert by_text.outputs[0].stop_reason == word and word not in by_text.outputs[0].text


def test_sampling_params_take_vllm_s_names_and_refuse_what_kiln_does_not_do():
    p = SamplingParams(n=1, presence_penalty=0.0, logprobs=None, top_k=0, stop="x", max_tokens=None)
    assert p.top_k_or_none is None and p.stop == ["x"] and p.max_tokens is None
    assert SamplingParams(top_k=-1).top_k_or_none is None and SamplingParams(top_k=5).top_k_or_none == 5
    with pytest.raises(ValueError, match=r"logits_processors=\[<built-in function abs>\] is not supported by kiln "
                                         r"yet .leave it at None.; kiln honours n, max_tokens, temperature"):
        SamplingParams(logits_processors=[abs])
    with pytest.raises(TypeError, match="unexpected keyword argument 'temprature'"):
        SamplingParams(temprature=0.5)


def test_max_tokens_none_runs_to_the_end_of_the_context():
    from kiln import LLM

    tiny = LLM("tiny-llama", device="cpu", max_model_len=40, num_kv_blocks=16)
    out = tiny.generate([1, 2, 3], SamplingParams(max_tokens=None, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40


def test_compile_lines_are_logged_by_default_on_cold_and_warm_starts(tmp_path):
    code = '''
        from kiln import LLM
        LLM("tiny-llama", device="cpu", max_num_batched_tokens=32, compilation_config={"mode": 3})
    '''
    env = {"KILN_CACHE_ROOT": str(tmp_path / "root"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cold = _python(code, env)
    assert cold.returncode == 0, cold.stderr
    assert "kiln.compile INFO torch.compile took" in cold.stderr and "Dynamo bytecode transform time" in cold.stderr
    warm = _python(code, env)
    assert warm.returncode == 0, warm.stderr
    assert "torch.compile took" in warm.stderr and "(a warm start from the compile cache)" in warm.stderr
    assert "Dynamo bytecode transform time" not in warm.stderr
    quiet = _python(code, {**env, "KILN_CONFIGURE_LOGGING": "0"})
    assert quiet.returncode == 0 and "torch.compile took" not in quiet.stderr


def test_the_stand_in_handler_is_quiet_once_the_application_configures_logging(monkeypatch):
    written = []
    monkeypatch.setattr("tqdm.tqdm.write", staticmethod(lambda msg, file=None: written.append(msg)))
    record = logging.LogRecord("kiln", logging.INFO, __file__, 1, "hello", None, None)
    root = logging.getLogger()
    handler = StandInHandler()
    monkeypatch.setattr(root, "handlers", [])
    handler.emit(record)
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])
    handler.emit(record)
    assert written == ["hello"]


def test_llm_takes_vllm_s_compilation_config_name(tmp_path):
    from kiln import LLM

    with pytest.raises(ValueError, match="both compilation_config and compilation"):
        LLM("tiny-llama", device="cpu", compilation_config=0, compilation={"mode": 0})
    llm = LLM("tiny-llama", device="cpu", compilation_config=0, num_kv_blocks=64)
    assert llm.engine.config.compilation.mode == 0
    # Offline, prompts are cut by tokens only (a server's CPU default also cuts them by time)...
    assert llm.engine.config.step_time_budget is None
    assert llm.engine.scheduler.max_step_seconds is None
    # ... unless asked for.
    timed = LLM("tiny-llama", device="cpu", compilation_config=0, num_kv_blocks=64, max_step_seconds=0.5)
    assert timed.engine.scheduler.max_step_seconds == 0.5


def test_generate_takes_vllm_s_prompt_dicts_and_refuses_other_shapes(llm):
    import torch

    params = SamplingParams(max_tokens=4, temperature=0)
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    plain = [o.outputs[0].token_ids for o in llm.generate([text, ids, list(torch.tensor(ids))], params, use_tqdm=False)]
    assert plain[0] == plain[1] == plain[2]  # torch integers are token ids too
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == plain[:2]
    assert dicts[0].prompt == text and dicts[1].prompt is None and dicts[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == plain[0]
    for bad, message in (({"prompt": text, "prompt_token_ids": ids}, "either 'prompt'"),
                         ({"text": text}, r"got keys \['text'\]"),
                         ({"prompt_token_ids": ids[:2] + ["a"]}, "must be integers, got str 'a'"),
                         (ids[:2] + [2.5], "must be integers, got float 2.5"),
                         ({"prompt": text, "multi_modal_data": {"image": None}}, "text models only")):
        with pytest.raises(ValueError, match=message):
            llm.generate([text, bad], params, use_tqdm=False)
        assert not llm.engine.has_unfinished()  # the good prompt before it was taken back


def test_output_kind_final_only_gives_one_output_and_generate_asks_for_it(llm):
    from kiln import RequestOutputKind

    with pytest.raises(ValueError, match="output_kind=<RequestOutputKind.DELTA: 1> is not supported by kiln; give "
                                         "RequestOutputKind.CUMULATIVE"):
        SamplingParams(output_kind=RequestOutputKind.DELTA)
    engine = llm.engine
    seen = {}
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY):
        request_id = engine.add_request("Once upon a time", SamplingParams(max_tokens=6, temperature=0,
                                                                           ignore_eos=True, output_kind=kind))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == request_id]
        seen[kind] = outs
    cumulative, final = seen[RequestOutputKind.CUMULATIVE], seen[RequestOutputKind.FINAL_ONLY]
    assert len(cumulative) == 6 and [len(o.outputs[0].token_ids) for o in cumulative] == [1, 2, 3, 4, 5, 6]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    # generate reads only the last output, so it asks for that alone, on its own copy of the params.
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids == \
        final[0].outputs[0].token_ids
    assert params.output_kind is RequestOutputKind.CUMULATIVE
