"""Linear and embedding layers that hold one tensor-parallel rank's shard of their weight.

Megatron's split: a column-parallel linear keeps a slice of the output features (no
communication: the next layer consumes the slice), a row-parallel linear keeps the
matching slice of the input features and sums the partial outputs with kiln::all_reduce.
The embedding and the LM head split the vocabulary. Each layer reads the sharding from
kiln.distributed.tp_state() when it is built; with one rank it computes exactly what
nn.Linear / nn.Embedding compute, with the same parameter name (`weight`). The linear
layers' matmul is kiln::skinny_linear when that op is on in `custom_ops` (a Triton GEMV
for decode-sized batches on CUDA), F.linear otherwise; a row-parallel layer's all-reduce
follows the matmul either way.

Weights arrive whole (a checkpoint tensor, or a random full tensor) and each layer's
`load_weight` keeps its rank's slice, so every tensor-parallel size loads the same files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed import tp_state
from kiln.distributed.collectives import all_gather, all_reduce
from kiln.ops.custom_op import call
from kiln.ops.linear import act_and_mul_linear_op, linear_matmul


def per_rank(size: int, what: str, parts: int) -> int:
    """`size` split evenly over `parts` ranks; an error naming `what` if it does not divide."""
    if size % parts:
        raise ValueError(f"{what} ({size}) does not divide over tensor_parallel_size={parts}; "
                         f"choose a tensor_parallel_size that divides it")
    return size // parts


class ShardedLayer(nn.Module):
    """A layer whose `weight` is one rank's slice of a full tensor of `full_weight_shape`."""

    full_weight_shape: tuple[int, int]

    def load_weight(self, full: torch.Tensor, part: int | None = None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(ShardedLayer):
    """y = x W^T, each rank computing a slice of y's features.

    `output_sizes` lists the outputs fused into one matmul (q, k, v or gate, up). Each is
    split over the ranks on its own, so a rank holds its q heads next to its kv heads, and a
    checkpoint's separate q/k/v tensors load as parts 0, 1, 2. `gather_output` concatenates
    every rank's slice (the LM head, whose logits are sampled whole).
    """

    def __init__(self, input_size: int, output_sizes: list[int], gather_output: bool = False,
                 what: str = "output features", bias: bool = False):
        super().__init__()
        tp = tp_state()
        self.tp = tp
        self.output_sizes = list(output_sizes)
        self.shard_sizes = [per_rank(s, what, tp.size) for s in output_sizes]
        self.full_weight_shape = (sum(output_sizes), input_size)
        self.weight = nn.Parameter(torch.empty(sum(self.shard_sizes), input_size))
        # A bias (Qwen2's q/k/v) is split like the rows it adds to.
        self.bias = nn.Parameter(torch.empty(sum(self.shard_sizes))) if bias else None
        self.gather_output = gather_output and tp.size > 1
        self.matmul = linear_matmul()

    def load_weight(self, full: torch.Tensor, part: int | None = None) -> None:
        """Keep this rank's rows of `full`: the whole fused weight, or output `part` of it."""
        self._load(self.weight, full, part, self.full_weight_shape[1:])

    def load_bias(self, full: torch.Tensor, part: int | None = None) -> None:
        self._load(self.bias, full, part, ())

    def _load(self, param: nn.Parameter, full: torch.Tensor, part: int | None, row_shape: tuple) -> None:
        if part is None:
            _check_shape(full, (sum(self.output_sizes), *row_shape))
            parts = list(enumerate(full.split(self.output_sizes)))
        else:
            parts = [(part, full)]
        for i, source in parts:
            _check_shape(source, (self.output_sizes[i], *row_shape))
            rows = self.shard_sizes[i]
            mine = source.narrow(0, self.tp.rank * rows, rows)
            if len(self.output_sizes) == 1:
                store(param, mine)
            else:
                param.data.narrow(0, sum(self.shard_sizes[:i]), rows).copy_(mine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = call(self.matmul, x, self.weight)
        if self.bias is not None:
            y = y + self.bias
        if not self.gather_output:
            return y
        # all_gather stacks the ranks' [tokens, features / size] slices along dim 0;
        # interleave them back into [tokens, features] in rank order.
        return all_gather(y, self.tp.group_name).unflatten(0, (self.tp.size, -1)).movedim(0, 1).flatten(1)


class RowParallelLinear(ShardedLayer):
    """y = x W^T where x arrives as this rank's slice of the input features (a
    column-parallel layer's output); the partial products are summed over the ranks."""

    def __init__(self, input_size: int, output_size: int, what: str = "input features",
                 activation: str | None = None):
        super().__init__()
        tp = tp_state()
        self.tp = tp
        self.shard_cols = per_rank(input_size, what, tp.size)
        self.full_weight_shape = (output_size, input_size)
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_cols))
        self.reduce = tp.size > 1
        # activation ("silu", "gelu_tanh"): x is a gate_up output ([gate | up] of this rank's
        # columns) and the activation runs inside the matmul.
        self.activation = activation
        self.matmul = linear_matmul() if activation is None else act_and_mul_linear_op

    def load_weight(self, full: torch.Tensor, part: int | None = None) -> None:
        _check_shape(full, self.full_weight_shape)
        store(self.weight, full.narrow(1, self.tp.rank * self.shard_cols, self.shard_cols))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = call(self.matmul, x, self.weight) if self.activation is None else call(self.matmul, x, self.weight,
                                                                                  self.activation)
        return all_reduce(y, self.tp.group_name) if self.reduce else y


class VocabParallelEmbedding(ShardedLayer):
    """Token embeddings with the vocabulary split over the ranks: each rank looks up the
    ids in its range, zeros the rest, and the all-reduce fills every row."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = tp_state()
        self.tp = tp
        self.shard_vocab = per_rank(vocab_size, "vocab_size", tp.size)
        self.full_weight_shape = (vocab_size, hidden_size)
        self.weight = nn.Parameter(torch.empty(self.shard_vocab, hidden_size))
        if tp.size > 1:
            # A buffer, not a Python int: an int would be traced into the graph as a
            # constant, and every rank's compiled code would differ by it.
            self.register_buffer("vocab_start", torch.empty((), dtype=torch.long), persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        if self.tp.size > 1:
            self.vocab_start = torch.tensor(self.tp.rank * self.shard_vocab, dtype=torch.long, device=device)

    def load_weight(self, full: torch.Tensor, part: int | None = None) -> None:
        _check_shape(full, self.full_weight_shape)
        store(self.weight, full.narrow(0, self.tp.rank * self.shard_vocab, self.shard_vocab))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.shard_vocab)
        rows = F.embedding(torch.where(mine, local, 0), self.weight)
        return all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype), self.tp.group_name)


def store(param: torch.Tensor, source: torch.Tensor) -> None:
    """Write a checkpoint tensor into a parameter: by adopting it as the parameter's data when
    it is exactly that (the same shape, dtype and device, contiguous, owning just its own
    storage: a view would keep a larger buffer alive), else by a copy. Adopting skips the copy
    and the page faults of writing untouched memory, most of a CPU load."""
    if (source.shape == param.shape and source.dtype == param.dtype and source.device == param.device
            and source.is_contiguous() and source.storage_offset() == 0
            and source.untyped_storage().nbytes() == source.numel() * source.element_size()):
        param.data = source
    else:
        param.data.copy_(source)


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit the full weight shape "
                         f"{tuple(expected)}")
