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

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelArchConfig":
        """From a transformers config.json dict. A setting that changes what the model computes
        and that kiln does not implement is refused here, naming it: never approximated."""
        _refuse_unimplemented(hf)
        archs = hf.get("architectures") or [hf.get("model_type", "?")]
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
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
            qk_norm=archs[0] == "Qwen3ForCausalLM",
            sliding_window=_sliding_window(hf) or 0,
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
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return out


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
    if window is not None and arch not in ("MistralForCausalLM", "LlamaForCausalLM"):
        # Qwen2's window applies from layer max_window_layers on: a per-layer window kiln lacks.
        problems.append(f"sliding_window={window} with use_sliding_window (kiln has Mistral's window, the same "
                        f"in every layer; {arch}'s depends on the layer)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            problems.append(f"{flag}=true (kiln's projections have no bias)")
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        problems.append(f"hidden_act={act!r} (kiln's MLP is SiLU-gated)")
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
