"""kiln: an LLM inference engine whose torch.compile pipeline is the product."""

__version__ = "0.1.0"

from kiln import logs  # noqa: E402

logs.configure()

from kiln.engine import (LLM, CompletionOutput, GuidedDecodingParams, RequestOutput,  # noqa: E402
                         RequestOutputKind, SamplingParams, StructuredOutputsParams)

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams"]
