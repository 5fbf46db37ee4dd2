"""GGUF checkpoints (llama.cpp's format): architecture, dequantized weights, tokenizer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from kiln.loader.ggml_types import ggml_type
from kiln.loader.gguf_header import read_gguf
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import ModelArchConfig

# GGUF tensor name -> HF name; {i} is the layer index. Each architecture adds its own below.
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_EXTRA_NAMES = {
    "qwen2": {f"blk.{{i}}.attn_{x}.bias": f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"},
    "qwen3": {"blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
              "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight"},
    # Gemma 2's ffn_norm is its pre-feed-forward norm; the post-norms have their own names.
    "gemma2": {"blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
               "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
               "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight"},
}
_MOE_NAMES = {"blk.{i}.ffn_gate_inp.weight": "model.layers.{i}.mlp.gate.weight"}
# Stacked experts [experts, out, in] -> each expert's HF projection.
_EXPERT_STACKS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_EXPERT_STACK = re.compile(r"blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.weight$")
_EXTRA_NAMES["qwen3moe"] = {**_EXTRA_NAMES["qwen3"], **_MOE_NAMES}
# llama.cpp architecture -> the HF architecture kiln builds ("llama" with experts is Mixtral).
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                           "gemma2": "Gemma2ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}


class GGUFCheckpoint:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fields, self.tensors = read_gguf(self.path)
        arch = self.fields.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{self.path}: GGUF architecture {arch!r} is not supported; kiln reads "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files (Llama 2/3, SmolLM2, Mistral, "
                             f"Mixtral, Qwen2/2.5, Qwen3, Qwen3-MoE, Gemma 2)")
        self.arch = arch

    def config(self) -> ModelArchConfig:
        f, a = self.fields, self.arch
        heads = f[f"{a}.attention.head_count"]
        hidden = f[f"{a}.embedding_length"]
        names = {t.name for t in self.tensors}
        eos = f.get("tokenizer.ggml.eos_token_id")
        experts = f.get(f"{a}.expert_count", 0)
        head_dim = f.get(f"{a}.attention.key_length") or f.get(f"{a}.rope.dimension_count") or hidden // heads
        architecture = "MixtralForCausalLM" if a == "llama" and experts else SUPPORTED_ARCHITECTURES[a]
        gemma2 = a == "gemma2"
        layers = f[f"{a}.block_count"]
        window = f.get(f"{a}.attention.sliding_window", 0) if gemma2 else 0
        return ModelArchConfig(
            architecture=architecture,
            vocab_size=f.get(f"{a}.vocab_size") or len(f["tokenizer.ggml.tokens"]),
            hidden_size=hidden,
            intermediate_size=f[f"{a}.feed_forward_length"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=f.get(f"{a}.attention.head_count_kv", heads),
            head_dim=head_dim,
            max_position_embeddings=f.get(f"{a}.context_length", 4096),
            rms_norm_eps=float(f.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(f.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            tie_word_embeddings="output.weight" not in names,
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(eos,) if eos is not None else (),
            qkv_bias=a == "qwen2",
            qk_norm=a in ("qwen3", "qwen3moe"),
            sliding_window=window,
            layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers))
            if gemma2 else (),
            hidden_act="gelu_pytorch_tanh" if gemma2 else "silu",
            # llama.cpp scales Gemma 2's scores by head_dim, but by hidden / heads for the 27B (46 layers),
            # as its query_pre_attn_scalar says; the GGUF file does not store it.
            query_pre_attn_scalar=(hidden // heads if layers == 46 else head_dim) if gemma2 else None,
            attn_logit_softcapping=float(f.get(f"{a}.attn_logit_softcapping", 0.0)) if gemma2 else 0.0,
            final_logit_softcapping=float(f.get(f"{a}.final_logit_softcapping", 0.0)) if gemma2 else 0.0,
            num_experts=experts,
            num_experts_per_tok=f.get(f"{a}.expert_used_count", 0) if experts else 0,
            moe_intermediate_size=f.get(f"{a}.expert_feed_forward_length", f[f"{a}.feed_forward_length"])
            if experts else 0,
            norm_topk_prob=bool(f.get(f"{a}.expert_weights_norm", True)),
        )

    def _rope_scaling(self) -> dict | None:
        """Llama 3.1's scaling arrives as a rope_freqs tensor (a divisor per frequency); linear
        scaling as metadata. Any other kind is refused: its positions would be wrong."""
        freqs = next((t for t in self.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:
            return {"rope_type": "freq_factors", "factors": tuple(np.asarray(freqs.data, dtype=np.float32).ravel().tolist())}
        kind = self.fields.get(f"{self.arch}.rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.fields[f"{self.arch}.rope.scaling.factor"])}
        raise ValueError(f"{self.path}: rope scaling {kind!r} is not supported (kiln reads linear scaling and "
                         f"rope_freqs factors from GGUF)")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_gguf_fields(self.fields, self.arch)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named fp32 tensors, dequantized one at a time to keep peak memory low."""
        cfg = self.config()
        names = {**_NAMES, **_EXTRA_NAMES.get(self.arch, {}), **(_MOE_NAMES if cfg.num_experts else {})}
        patterns = {}
        for i in range(cfg.num_layers):
            patterns.update({g.format(i=i): h.format(i=i) for g, h in names.items()})
        for t in self.tensors:
            stack = _EXPERT_STACK.match(t.name) if cfg.num_experts else None
            if t.name not in patterns and stack is None:
                if t.name == "rope_freqs.weight":  # read by config() as the rope scaling
                    continue
                raise ValueError(f"{self.path}: unexpected tensor {t.name!r}")
            w = dequantized(t.data, t.tensor_type)
            w = w.reshape([int(d) for d in reversed(t.shape)]) if w.ndim != len(t.shape) else w
            # llama.cpp's converter interleaves q/k rotary halves for the llama architecture only.
            if self.arch == "llama" and t.name.endswith("attn_q.weight"):
                w = _unpermute(w, cfg.num_heads)
            elif self.arch == "llama" and t.name.endswith("attn_k.weight"):
                w = _unpermute(w, cfg.num_kv_heads)
            elif self.arch == "gemma2" and t.name.endswith("norm.weight"):
                w = w - 1  # its converter stores Gemma's norms as 1 + w
            if stack is not None:
                layer, kind = stack.groups()
                for e in range(w.shape[0]):
                    expert = np.ascontiguousarray(w[e])
                    yield (f"model.layers.{layer}.mlp.experts.{e}.{_EXPERT_STACKS[kind]}.weight",
                           torch.from_numpy(expert if expert.flags.writeable else expert.copy()))
                continue
            w = np.ascontiguousarray(w)
            yield patterns[t.name], torch.from_numpy(w if w.flags.writeable else w.copy())


# Bytes per block of 32 weights: Q4_1 = fp16 scale, fp16 min, 16 bytes of 4-bit quants (element
# i in the low nibble of byte i, element i + 16 in its high nibble); Q8_0 = fp16 scale, 32 int8.
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


def dequantized(data: np.ndarray, type_id: int) -> np.ndarray:
    """A tensor's fp32 values. F32 and F16 as they are; Q4_1 and Q8_0 (the embedded SmolLM2's,
    and common in llama files) in torch: gguf's arithmetic in gguf's order, so the same bits,
    where gguf's loop over row groups took 2.1 s of the embedded model's 2.6 s load on this
    CPU. Other types go to the gguf package's dequantizer."""
    name = ggml_type(type_id)[0]
    if name in ("F32", "F16"):  # typed arrays already (gguf_header); F16 widens exactly
        return np.asarray(data, dtype=np.float32)
    if name not in _BLOCK_BYTES:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        return np.asarray(dequantize(data, GGMLQuantizationType(type_id)), dtype=np.float32)
    raw = torch.from_numpy(np.array(data, dtype=np.uint8).reshape(-1, _BLOCK_BYTES[name]))
    d = raw[:, :2].contiguous().view(torch.float16).float()
    # In place: every fresh tensor of this size costs its page faults, which were most of
    # the load on this CPU (q * d is d * q exactly, so the bits stay gguf's).
    if name == "Q8_0":
        values = raw[:, 2:].contiguous().view(torch.int8).float().mul_(d)
    else:
        m = raw[:, 2:4].contiguous().view(torch.float16).float()
        qs = raw[:, 4:]
        values = torch.cat([qs & 0x0F, qs >> 4], dim=1).float().mul_(d).add_(m)
    return values.reshape(-1).numpy()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each Q/K head for its
    # own rope; rotate-half rope needs them back as two contiguous halves.
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)

