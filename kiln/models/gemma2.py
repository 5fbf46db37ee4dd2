"""Gemma 2: Llama's attention and weights layout, with what Gemma changes around them.

- The MLP's gate is GELU (tanh form), not SiLU.
- Every norm stores w - 1 and scales by 1 + w in fp32 (RMSNorm's unit_offset), and each
  sublayer's output is normed again before it joins the residual stream (post-norms).
- Embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype as HF does.
- Attention scores are scaled by query_pre_attn_scalar and soft-capped, and layers alternate
  between a sliding window and the whole context (config.layer_types): both are arguments of
  kiln's attention op, so the two layer kinds differ only in a constant and are traced once
  each. The final logits are soft-capped too (LlamaForCausalLM.compute_logits).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.compile import compile_dynamic, repeated_layer
from kiln.models.config import ModelArchConfig
from kiln.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel
from kiln.ops import RMSNorm, RotaryEmbedding


@repeated_layer
class Gemma2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, f"model.layers.{index}.self_attn.attn", cfg.window_of(index))
        self.mlp = LlamaMLP(cfg)  # GELU-tanh-gated: cfg.hidden_act
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True))

    def forward(self, positions, hidden, residual):
        # As in Llama the residual stream travels beside the hidden state; the post-norms have no
        # add before them, the pre-norms fuse the add of the sublayer before.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2Model(LlamaModel):
    layer_class = Gemma2DecoderLayer
    norm_unit_offset = True

    def __init__(self, cfg: ModelArchConfig):
        super().__init__(cfg)
        self.embed_scale = cfg.hidden_size**0.5

    def init_buffers(self, device: torch.device) -> None:
        # HF multiplies by sqrt(hidden_size) rounded to the weights' dtype (59.75, not 59.87, in bf16).
        self.embed_scale = torch.tensor(self.embed_scale, dtype=self.embed_tokens.weight.dtype).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


@compile_dynamic(dynamic_arg_dims={"input_ids": 0, "positions": 0})
class Gemma2ForCausalLM(LlamaForCausalLM):
    """Llama's head, weight loading and tensor-parallel checks over Gemma 2's model."""

    model_class = Gemma2Model
