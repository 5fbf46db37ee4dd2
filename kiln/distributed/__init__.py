"""Tensor parallelism: collective ops, the process groups behind them, and the launcher."""

from kiln.distributed import collectives  # noqa: F401  registers torch.ops.kiln.all_reduce & co.
from kiln.distributed.parallel_state import (
    TensorParallelState,
    building_for,
    destroy_tensor_parallel,
    init_tensor_parallel,
    tp_state,
)

__all__ = ["TensorParallelState", "building_for", "destroy_tensor_parallel", "init_tensor_parallel", "tp_state"]
