"""The mixture-of-experts MLP layer (Mixtral, Qwen3-MoE): a replicated router and every expert's
gated MLP, run by kiln::fused_moe.

Under tensor parallelism each rank holds every expert's slice of the intermediate features (the
dense MLP's split, per expert), and the partial outputs are summed with one all-reduce. The
router is replicated: every rank routes every token alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.distributed import tp_state
from kiln.distributed.collectives import all_reduce
from kiln.models.config import ModelArchConfig
from kiln.models.parallel_layers import per_rank
from kiln.ops.custom_op import call
from kiln.ops.moe import fused_moe

# Checkpoint names of an expert's projections -> (kiln parameter, part): part 0/1 are the gate and
# up halves of w13, w2 has one part. Mixtral calls them w1, w3, w2; Qwen3-MoE as the dense MLP.
EXPERT_PROJECTIONS = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0),
                      "gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        tp = tp_state()
        self.tp = tp
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.inter = cfg.moe_intermediate_size
        self.shard = per_rank(self.inter, "moe_intermediate_size", tp.size)
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.w13 = nn.Parameter(torch.empty(cfg.num_experts, 2 * self.shard, cfg.hidden_size))
        self.w2 = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, self.shard))
        self.reduce = tp.size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = call(fused_moe, x, F.linear(x, self.gate.weight), self.w13, self.w2, self.top_k, self.renormalize)
        return all_reduce(y, self.tp.group_name) if self.reduce else y

    def parts(self, param: str) -> int:
        """How many checkpoint tensors fill `param` (load_weights counts them)."""
        return self.num_experts * (2 if param == "w13" else 1)

    def load_expert(self, expert: int, projection: str, full: torch.Tensor) -> tuple[str, int]:
        """Keep this rank's slice of one expert's checkpoint projection; returns (param, part index)."""
        param, half = EXPERT_PROJECTIONS[projection]
        expected = (self.inter, self.w13.shape[2]) if param == "w13" else (self.w2.shape[1], self.inter)
        if tuple(full.shape) != expected:
            raise ValueError(f"expert {expert} {projection}: checkpoint shape {tuple(full.shape)}, expected {expected}")
        start = self.tp.rank * self.shard
        if param == "w13":
            self.w13.data[expert].narrow(0, half * self.shard, self.shard).copy_(full.narrow(0, start, self.shard))
            return param, 2 * expert + half
        self.w2.data[expert].copy_(full.narrow(1, start, self.shard))
        return param, expert
