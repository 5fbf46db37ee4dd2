"""The offline API: LLM(model).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine, RequestOutput
from kiln.engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, sp in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, sp))
        except ValueError:
            for request_id in ids:  # a bad prompt leaves nothing half-queued
                self.engine.abort_request(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes, if any (they also stop at exit)."""
        self.engine.shutdown()

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Like generate, with each conversation rendered by the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], sampling_params)
