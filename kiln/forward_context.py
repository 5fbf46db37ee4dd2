"""Per-step state that opaque ops read instead of taking it as traced arguments.

Attention metadata and the KV-cache tensors change every step (new lengths, new block
tables). If they were traced Python values, the compiled graph would bake them in; so
the runner publishes them here before each forward and the attention ops look them up
by layer name at run time, inside their opaque implementations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """One mixed batch of prefill chunks and decode tokens, packed along the token dim.

    Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) and, after
    this step's KV write, a context of seq_lens[i] tokens laid out in the blocks of
    block_tables[i]; its queries are the last tokens of that context (causal).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, block * block_size + offset; -1 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int
    # Host copies, so CPU code paths never wait on the device.
    seq_lens_cpu: list[int] = field(default_factory=list)
    query_start_loc_cpu: list[int] = field(default_factory=list)
    # What the CPU attention derives from the step (which rows go where, masks) once, for every
    # layer to reuse: kiln.ops.attention.paged_attention_cpu.
    cpu_plans: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def warm_up_metadata(num_tokens: int, device: torch.device, length: int = 64) -> AttentionMetadata:
    """A step of `num_tokens` tokens as sequences of at most `length`, with no KV cache: for
    forwards whose values do not matter (compiling, capturing). Without metadata attention
    treats all tokens as one sequence, and 2048 of them cost 13 s on a CPU core."""
    starts = list(range(0, num_tokens, length)) + [num_tokens]
    lens = [b - a for a, b in zip(starts, starts[1:])]
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(lens), max_seq_len=max(lens), num_actual_tokens=num_tokens,
        seq_lens_cpu=lens, query_start_loc_cpu=starts)


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    kv_caches: dict[str, torch.Tensor]  # layer name -> [2, num_blocks, block_size, kv_heads, head_dim]


_context: ForwardContext | None = None


def get_forward_context() -> ForwardContext | None:
    return _context


@contextlib.contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, kv_caches: dict[str, torch.Tensor]):
    global _context
    previous, _context = _context, ForwardContext(attn_metadata, kv_caches)
    try:
        yield _context
    finally:
        _context = previous
