"""Model classes by architecture name, and building one without touching memory twice."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kiln.models.config import ModelArchConfig
from kiln.models.gemma2 import Gemma2ForCausalLM
from kiln.models.llama import LlamaForCausalLM
from kiln.models.parallel_layers import ShardedLayer
from kiln.ops import enabled_custom_ops

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    # Llama's layers; its sliding window is an argument of the attention op (ModelArchConfig.sliding_window).
    "MistralForCausalLM": LlamaForCausalLM,
    # Llama's layers with the config's qkv_bias (Qwen2) or per-head q/k norms (Qwen3), set by
    # ModelArchConfig.from_hf from the architecture.
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    # Llama's layers with a mixture of experts for the MLP (ModelArchConfig.num_experts).
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; kiln runs "
                         f"{', '.join(sorted(MODEL_REGISTRY))}") from None


def build_model(cfg: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                custom_ops: frozenset[str],
                weights: Iterable[tuple[str, torch.Tensor]] | None) -> nn.Module:
    """Build on the meta device, give it storage on `device` in `dtype`, then fill it.

    `weights` None means random weights (benchmarks): normal(0, 0.02), norms at 1.
    """
    cls = model_class(cfg.architecture)
    with torch.device("meta"), enabled_custom_ops(custom_ops):
        model = cls(cfg)
    # to_empty's empty_like of a meta tensor runs torch's Python reference, whose first call
    # imports sympy and the symbolic-shapes module (0.2 s of an eager start on a CPU core); a
    # plain factory call gives the same storage.
    model = model.to(dtype)._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    model.tie_weights()
    with torch.no_grad():
        if weights is None:
            _init_random(model)
        else:
            model.load_weights(weights)
        for module in model.modules():
            if hasattr(module, "init_buffers"):
                module.init_buffers(device)
    return model.eval().requires_grad_(False)


def _init_random(model: nn.Module) -> None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Seeded on the device too: every build of a preset must get the same weights, or two
    # engines (eager beside compiled) cannot be compared.
    device_gen = {}
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        if name.endswith(".bias"):
            p.zero_()
        elif p.dim() == 1:
            p.fill_(1.0)
        elif p.is_cuda:
            # Fill on the device: an 8B model drawn on the host would take minutes.
            if p.device not in device_gen:
                device_gen[p.device] = torch.Generator(device=p.device).manual_seed(0)
            # Whole, then this rank's shard, as on the host; a shard that is the whole (one rank)
            # is drawn in place: the same values without a second 8B-model's worth of allocations.
            if isinstance(owner, ShardedLayer) and tuple(p.shape) != tuple(owner.full_weight_shape):
                full = torch.empty(owner.full_weight_shape, dtype=p.dtype, device=p.device)
                owner.load_weight(full.normal_(0.0, 0.02, generator=device_gen[p.device]))
            else:
                p.normal_(0.0, 0.02, generator=device_gen[p.device])
        elif isinstance(owner, ShardedLayer):
            # Draw the whole tensor and keep this rank's shard: every tensor-parallel size
            # then runs the same model, so their outputs can be compared.
            owner.load_weight(torch.randn(owner.full_weight_shape, generator=gen) * 0.02)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
