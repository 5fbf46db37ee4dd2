"""The Llama family (Llama 2, 3, 3.1, SmolLM2, Mistral with its sliding window, and Qwen2 and
Qwen3: Llama's layers with q/k/v biases, or with per-head q/k norms; Mixtral and Qwen3-MoE:
the same layers with a mixture of experts for the MLP, kiln.models.moe).

Tokens of every sequence in a step are packed along one dim: input_ids and positions are
[num_tokens], hidden states [num_tokens, hidden]. Attention finds each token's sequence
in the forward context. There is no Python branch on a shape or a value anywhere in the
forward: the compile pipeline traces it once and drops the guards.

Under tensor parallelism (kiln.distributed) each rank builds the same classes with its
share of the heads and of the MLP's intermediate features: q/k/v and gate/up are
column-parallel, o_proj and down_proj row-parallel (their all-reduce is the only
communication in a layer), and the embedding and LM head split the vocabulary.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from kiln.compile import compile_dynamic, repeated_layer
from kiln.distributed import tp_state
from kiln.models.config import ModelArchConfig
from kiln.models.moe import EXPERT_PROJECTIONS, SparseMoE
from kiln.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedLayer,
    VocabParallelEmbedding,
    per_rank,
    store,
)
from kiln.ops import Attention, GeluTanhAndMul, RMSNorm, RotaryEmbedding, SiluAndMul
from kiln.ops.linear import fuses_activation


class LlamaMLP(nn.Module):
    """Gated MLP: SiLU, or Gemma's GELU-tanh; the activation may ride in the down projection's GEMV."""

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], what="intermediate_size")
        gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        activation = "gelu_tanh" if gelu else "silu"
        fused = fuses_activation(activation)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, what="intermediate_size",
                                           activation=activation if fused else None)
        self.act = None if fused else GeluTanhAndMul() if gelu else SiluAndMul()

    def forward(self, x):
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.act is None else self.act(h))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_name: str, window: int):
        super().__init__()
        size = tp_state().size
        num_heads = per_rank(cfg.num_heads, "num_heads", size)
        num_kv_heads = per_rank(cfg.num_kv_heads, "num_kv_heads", size)
        self.q_size, self.kv_size = num_heads * cfg.head_dim, num_kv_heads * cfg.head_dim
        q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_full, kv_full, kv_full], what="attention heads",
                                             bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(q_full, cfg.hidden_size, what="attention heads")
        self.head_dim = cfg.head_dim
        # Qwen3: an RMSNorm over each head of q and of k, before the rotation.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary_emb = rotary
        scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar else None
        self.attn = Attention(num_heads, num_kv_heads, cfg.head_dim, layer_name, window, scale,
                              cfg.attn_logit_softcapping)

    def forward(self, positions, x):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        if self.rotary_emb.uses_kernel:  # the rotary kernel rotates inside the KV write's launch
            return self.o_proj(self.attn(q, k, v, positions, self.rotary_emb.cos_sin_cache))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


@repeated_layer
class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, f"model.layers.{index}.self_attn.attn", cfg.window_of(index))
        self.mlp = SparseMoE(cfg) if cfg.num_experts else LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, residual):
        # The residual stream is carried beside the hidden state so that each add can
        # fuse with the norm after it.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    # A family with other layers or norms sets its own (Gemma 2).
    layer_class: type[nn.Module] = LlamaDecoderLayer
    norm_unit_offset = False

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.head_dim, cfg.max_position_embeddings,
                                 cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(self.layer_class(cfg, rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=self.norm_unit_offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


# A checkpoint tensor of one expert: (the MoE layer's path, expert index, projection name).
_EXPERT = re.compile(r"(.+)\.experts\.(\d+)\.(\w+)\.weight$")


@compile_dynamic(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (kiln parameter fragment, shard index) for fused weights
    FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    model_class: type[nn.Module] = LlamaModel  # a family with other layers sets its own (Gemma 2)

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        self.lm_head = ColumnParallelLinear(cfg.hidden_size, [cfg.vocab_size], gather_output=True,
                                            what="vocab_size")
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden]; logits only where needed, below."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """fp32 logits; with fp32=False, where those are only lm_head's output cast (no softcap),
        that output in the model's dtype: its `.float()` is the logits, its argmax theirs."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            return torch.tanh(logits.float() / cap) * cap
        return logits.float() if fp32 else logits

    @staticmethod
    def check_tensor_parallel(cfg: ModelArchConfig, size: int) -> None:
        """Fail before any process starts if `size` ranks cannot share this model evenly."""
        counts = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                  "intermediate_size": cfg.moe_intermediate_size or cfg.intermediate_size, "vocab_size": cfg.vocab_size}
        uneven = [f"{name}={n}" for name, n in counts.items() if n % size]
        if uneven:
            common = math.gcd(*counts.values())
            sizes = [d for d in range(1, common + 1) if common % d == 0]
            raise ValueError(f"tensor_parallel_size={size} does not divide {', '.join(uneven)} of this "
                             f"model; sizes that divide all of {', '.join(counts)}: "
                             f"{', '.join(map(str, sizes))}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into this model's (possibly fused) parameters;
        a sharded layer keeps its rank's slice of each.

        The model must already have storage (built on meta, then `to_empty`). Every
        parameter must be written exactly once; a missing or unknown one is an error.
        """
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        written: set[tuple[str, int]] = set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MLP
            expert = _EXPERT.match(name)
            if expert and expert[3] in EXPERT_PROJECTIONS and isinstance(modules.get(expert[1]), SparseMoE):
                try:
                    param, part = modules[expert[1]].load_expert(int(expert[2]), expert[3], tensor)
                except (ValueError, IndexError) as e:
                    raise ValueError(f"{ckpt_name}: {e}") from None
                written.add((f"{expert[1]}.{param}", part))
                continue
            target, shard = name, None
            for frag, (fused, index) in self.FUSED.items():
                if f".{frag}." in name:
                    target, shard = name.replace(f".{frag}.", f".{fused}."), index
                    break
            if target not in params:
                if "rotary_emb.inv_freq" in ckpt_name or (
                        ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings):
                    continue
                raise KeyError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}")
            owner = modules[target.rpartition(".")[0]]
            if isinstance(owner, ShardedLayer):
                try:
                    (owner.load_bias if target.endswith(".bias") else owner.load_weight)(tensor, shard)
                except ValueError as e:
                    raise ValueError(f"{ckpt_name} -> {target}: {e}") from None
            elif tuple(params[target].shape) != tuple(tensor.shape):
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                                 f"{target} of shape {tuple(params[target].shape)}")
            else:
                store(params[target], tensor)
            written.add((target, shard or 0))
        missing = []
        for name in params:
            owner = modules[name.rpartition(".")[0]]
            if isinstance(owner, SparseMoE):
                shards = owner.parts(name.rpartition(".")[2])
            else:
                shards = len(owner.output_sizes) if isinstance(owner, ColumnParallelLinear) else 1
            missing += [f"{name}[{i}]" for i in range(shards) if (name, i) not in written]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

