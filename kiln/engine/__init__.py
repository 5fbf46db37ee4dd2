from kiln.engine.llm import LLM
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.engine.logprobs import Logprob
from kiln.engine.sampling_params import RequestOutputKind, SamplingParams
from kiln.engine.structured_output import GuidedDecodingParams, StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "LLMEngine", "Logprob", "RequestMetrics",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
