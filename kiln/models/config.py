"""The architecture of a decoder model, read from a checkpoint or a named preset."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k
    sliding_window: int = 0  # Mistral: each token attends to its last this many positions; 0: all
    # Per layer "sliding_attention" or "full_attention" (Gemma 2 alternates); empty: every layer
    # slides when sliding_window is set (Mistral).
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate: "silu", or "gelu_pytorch_tanh" (Gemma)
    query_pre_attn_scalar: float | None = None  # Gemma 2: scores scaled by its -1/2 power, not head_dim's
    attn_logit_softcapping: float = 0.0  # Gemma 2: scores capped to c * tanh(s / c); 0: none
    final_logit_softcapping: float = 0.0  # Gemma 2: logits capped alike; 0: none
    # Mixture of experts (Mixtral, Qwen3-MoE): every layer's MLP is num_experts experts of
    # moe_intermediate_size features, num_experts_per_tok of them per token; 0: a dense MLP.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # divide the chosen experts' probabilities by their sum

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.num_layers}")
        unknown = set(self.layer_types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer_types holds {sorted(unknown)}; kiln knows sliding_attention and full_attention")

    def window_of(self, layer: int) -> int:
        """The sliding window layer `layer` attends over (0: its whole context)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelArchConfig":
        """From a transformers config.json dict. A setting that changes what the model computes
        and that kiln does not implement is refused here, naming it: never approximated."""
        _refuse_unimplemented(hf)
        archs = hf.get("architectures") or [hf.get("model_type", "?")]
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        gemma2 = archs[0] == "Gemma2ForCausalLM"
        experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
        return cls(
            architecture=archs[0],
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(hf),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos,
            qkv_bias=archs[0] == "Qwen2ForCausalLM",
            qk_norm=archs[0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_sliding_window(hf) or 0,
            layer_types=tuple(hf.get("layer_types") or _gemma2_layer_types(hf["num_hidden_layers"])) if gemma2 else (),
            hidden_act=_activation(hf),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma2 else None,
            attn_logit_softcapping=(hf.get("attn_logit_softcapping") or 0.0) if gemma2 else 0.0,
            final_logit_softcapping=(hf.get("final_logit_softcapping") or 0.0) if gemma2 else 0.0,
            num_experts=experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=(hf.get("moe_intermediate_size") or hf["intermediate_size"]) if experts else 0,
            # Mixtral always renormalises; Qwen3-MoE as its config says.
            norm_topk_prob=hf.get("norm_topk_prob", True) if archs[0] == "Qwen3MoeForCausalLM" else True,
        )

    def to_hf(self) -> dict:
        """A transformers-style config.json dict (for saving checkpoints kiln can reload)."""
        out = {
            "architectures": [self.architecture], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act, "attention_bias": False, "mlp_bias": False,
        }
        if self.architecture == "Gemma2ForCausalLM":
            out.update(model_type="gemma2", hidden_activation=self.hidden_act, sliding_window=self.sliding_window,
                       layer_types=list(self.layer_types), query_pre_attn_scalar=self.query_pre_attn_scalar,
                       attn_logit_softcapping=self.attn_logit_softcapping or None,
                       final_logit_softcapping=self.final_logit_softcapping or None)
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


def _gemma2_layer_types(num_layers: int) -> list[str]:
    # transformers' default for Gemma 2 configs without layer_types: even layers slide.
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _activation(hf: dict) -> str:
    # Gemma configs name it hidden_activation (hidden_act is Gemma 1's legacy key).
    return hf.get("hidden_activation") or hf.get("hidden_act") or "silu"


def _sliding_window(hf: dict) -> int | None:
    """The window every layer attends over, if the config sets one shorter than the context."""
    window = hf.get("sliding_window")
    if window is None or not hf.get("use_sliding_window", True) or window >= hf.get("max_position_embeddings", 4096):
        return None
    return window


def _refuse_unimplemented(hf: dict) -> None:
    """config.json settings that change the model's output and that kiln's layers do not have."""
    problems = []
    arch = (hf.get("architectures") or [hf.get("model_type", "?")])[0]
    window = _sliding_window(hf)
    if window is not None and arch not in ("MistralForCausalLM", "LlamaForCausalLM", "Gemma2ForCausalLM",
                                           "MixtralForCausalLM"):
        # Qwen2's window applies from layer max_window_layers on: a per-layer window kiln lacks.
        problems.append(f"sliding_window={window} with use_sliding_window (kiln has Mistral's window, the same "
                        f"in every layer; {arch}'s depends on the layer)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true (kiln's projections have no bias)")
    act, wanted = _activation(hf), "gelu_pytorch_tanh" if arch == "Gemma2ForCausalLM" else "silu"
    if act != wanted:
        problems.append(f"hidden_act={act!r} (kiln's {arch} MLP is {wanted}-gated)")
    if arch == "Qwen3MoeForCausalLM" and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        problems.append(f"mlp_only_layers={hf.get('mlp_only_layers')} / decoder_sparse_step="
                        f"{hf.get('decoder_sparse_step')} (kiln's Qwen3-MoE has experts in every layer)")
    if hf.get("shared_expert_intermediate_size"):
        problems.append("shared experts (kiln's MoE layer has routed experts only)")
    if hf.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention=true (kiln's attention is causal)")
    if problems:
        name = (hf.get("architectures") or [hf.get("model_type", "this model")])[0]
        raise ValueError(f"{name}: kiln cannot run this checkpoint exactly, so it refuses it: "
                         f"{'; '.join(problems)}")


def _rope_scaling(hf: dict) -> dict | None:
    # transformers 5 moved rope settings into "rope_parameters"; older files use "rope_scaling".
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return None if kind == "default" else scaling
