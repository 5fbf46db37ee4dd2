"""kiln: an LLM inference engine whose torch.compile pipeline is the product."""

__version__ = "0.1.0"

from kiln import logs  # noqa: E402

logs.configure()

from kiln.compile.gc_pause import collector_paused  # noqa: E402

with collector_paused():  # torch and the engine: ~200k long-lived objects, next to no garbage
    from kiln.engine import (LLM, CompletionOutput, GuidedDecodingParams, RequestOutput,  # noqa: E402
                             RequestOutputKind, SamplingParams, StructuredOutputsParams)

__all__ = ["LLM", "CompletionOutput", "GuidedDecodingParams", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "StructuredOutputsParams"]
