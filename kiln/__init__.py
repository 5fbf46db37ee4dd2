"""kiln: an LLM inference engine whose torch.compile pipeline is the product."""

__version__ = "0.1.0"

from kiln.engine import LLM, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
