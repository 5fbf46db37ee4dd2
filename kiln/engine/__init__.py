from kiln.engine.llm import LLM
from kiln.engine.llm_engine import LLMEngine, RequestOutput
from kiln.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
