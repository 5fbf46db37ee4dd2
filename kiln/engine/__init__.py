from kiln.engine.llm import LLM
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestMetrics", "RequestOutput", "SamplingParams"]
