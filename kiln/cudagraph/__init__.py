"""CUDA graphs over kiln's forward: one entry point for the engine, ForwardCudagraphs.

    ladder        the bucket ladder and the padding table
    dispatcher    the per-phase plans and the graph chosen for each step
    step_buffers  the static input and metadata buffers every step is packed into
    pool          the shared memory pool, capture and replay
    piecewise     a graph per compiled piece and bucket (through CompiledModel.wrap_pieces)
    breakable     the eager forward's stream capture, cut at each attention call
    forward       ForwardCudagraphs: capture at start-up, then the graph (or none) of each step

The compile package does not know CUDA graphs exist: piecewise graphs reach its pieces
through the wrapper hook it offers.
"""

from kiln.cudagraph.dispatcher import CudagraphChoice, CudagraphDispatcher
from kiln.cudagraph.forward import ForwardCudagraphs
from kiln.cudagraph.step_buffers import PackedStep, StepBuffers

__all__ = ["CudagraphChoice", "CudagraphDispatcher", "ForwardCudagraphs", "PackedStep", "StepBuffers"]
