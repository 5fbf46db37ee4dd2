"""The offline API, as vLLM's: LLM(model).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import math
from dataclasses import replace

from tqdm import tqdm

from kiln.compile.config import CompilationConfig
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import RequestOutput
from kiln.engine.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, *, compilation_config: int | dict | CompilationConfig | None = None,
                 **engine_args):
        """`model`: the embedded SmolLM2 (None), a .gguf file, an HF folder or a preset name.
        `compilation_config` is vLLM's name for `compilation`: an -O level (0-3), a dict of
        CompilationConfig fields over -O2, or a CompilationConfig. Other keywords are
        EngineConfig's; max_step_seconds defaults to none (inf) here."""
        # The CPU's step time budget keeps a server's streams moving beside a long prompt; offline
        # nothing streams, and there it cut a lone 8k-token fp32 prompt into ~33 chunks: 28.3 s
        # without it, 37.5 s with it (benchmarks/results/cpu_long_prompt_offline_ab.json). vLLM's
        # LLM class likewise batches by larger defaults than its server.
        engine_args.setdefault("max_step_seconds", math.inf)
        if compilation_config is not None:
            if engine_args.get("compilation") is not None:
                raise ValueError("LLM got both compilation_config and compilation; they are the same setting, "
                                 "pass one")
            if isinstance(compilation_config, int) and not isinstance(compilation_config, bool):
                compilation_config = CompilationConfig.level(compilation_config)
            engine_args["compilation"] = compilation_config
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts: str | dict | list[int] | list[str | dict | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order. A prompt is
        text, a list of token ids, or as vLLM's prompt dicts {"prompt": text} (TextPrompt) or
        {"prompt_token_ids": ids} (TokensPrompt). `use_tqdm`: a progress bar over the requests
        (on a terminal)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [_prompt(p) for p in prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        # Only each request's last output is read here: ask for that one alone (as vLLM's LLM does),
        # on copies, the caller's params untouched.
        final = {}
        for sp in params:
            if id(sp) not in final:
                sp_or_default = sp if sp is not None else SamplingParams()
                final[id(sp)] = replace(sp_or_default, output_kind=RequestOutputKind.FINAL_ONLY)
        params = [final[id(sp)] for sp in params]
        ids = []
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, sp))
        except ValueError:
            for request_id in ids:  # a bad prompt leaves nothing half-queued
                self.engine.abort_request(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        # disable=None: tqdm draws only on a terminal.
        with tqdm(total=len(ids), desc="Processed prompts", unit="prompt", disable=None if use_tqdm else True,
                  leave=False) as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update()
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        """Free the engine's device memory (weights, KV cache, CUDA graphs) now and stop its
        tensor-parallel worker processes, if any (they also stop at exit): another LLM can then be
        built in this process. This LLM generates no more."""
        self.engine.shutdown()

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Like generate, with each conversation rendered by the model's chat template (its options as
        vLLM's: see Tokenizer.apply_chat_template)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       template_kwargs=chat_template_kwargs)
        return self.generate([self.tokenizer.encode_chat(c, **options) for c in conversations], sampling_params,
                             use_tqdm)


def _prompt(prompt):
    """Text or token ids from one of generate's prompt shapes."""
    if not isinstance(prompt, dict):
        return prompt
    keys = set(prompt) - {"multi_modal_data", "mm_processor_kwargs"}
    if prompt.get("multi_modal_data") is not None:
        raise ValueError("multi_modal_data: kiln serves text models only; leave it out")
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    raise ValueError(f"a prompt dict holds either 'prompt' (text) or 'prompt_token_ids' (a list of ints), as "
                     f"vLLM's TextPrompt and TokensPrompt; got keys {sorted(prompt)}")
