"""The Llama family (Llama 2, 3, 3.1, SmolLM2, and other checkpoints of the same shape).

Tokens of every sequence in a step are packed along one dim: input_ids and positions are
[num_tokens], hidden states [num_tokens, hidden]. Attention finds each token's sequence
in the forward context. There is no Python branch on a shape or a value anywhere in the
forward: the compile pipeline traces it once and drops the guards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.compile import compile_dynamic
from kiln.models.config import ModelArchConfig
from kiln.ops import Attention, RMSNorm, RotaryEmbedding, SiluAndMul


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, layer_name: str):
        super().__init__()
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.rotary_emb = rotary
        self.attn = Attention(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layer_name)

    def forward(self, positions, x):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, f"model.layers.{index}.self_attn.attn")
        self.mlp = LlamaMLP(cfg)
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
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.head_dim, cfg.max_position_embeddings,
                                 cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


@compile_dynamic(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (kiln parameter fragment, shard index) for fused weights
    FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden]; logits only where needed, below."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into this model's (possibly fused) parameters.

        The model must already have storage (built on meta, then `to_empty`). Every
        parameter must be written exactly once; a missing or unknown one is an error.
        """
        params = dict(self.named_parameters())
        written: set[tuple[str, int]] = set()
        for ckpt_name, tensor in weights:
            target, shard = ckpt_name, None
            for frag, (fused, index) in self.FUSED.items():
                if f".{frag}." in ckpt_name:
                    target, shard = ckpt_name.replace(f".{frag}.", f".{fused}."), index
                    break
            if target not in params:
                if "rotary_emb.inv_freq" in ckpt_name or (
                        ckpt_name == "lm_head.weight" and self.config.tie_word_embeddings):
                    continue
                raise KeyError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}")
            param = params[target].data
            if shard is not None:
                sizes = self._shard_sizes(target.split(".")[-2])
                param = param.narrow(0, sum(sizes[:shard]), sizes[shard])
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)} does not fit "
                                 f"{target} slice of shape {tuple(param.shape)}")
            param.copy_(tensor)
            written.add((target, shard or 0))
        fused_names = {fused for fused, _ in self.FUSED.values()}
        missing = []
        for name in params:
            fused = name.split(".")[-2]
            shards = len(self._shard_sizes(fused)) if fused in fused_names else 1
            missing += [f"{name}[{i}]" for i in range(shards) if (name, i) not in written]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
