"""Rotary position embedding (rotate-half / NeoX layout), with Llama 3.1 and linear scaling."""

from __future__ import annotations

import math

import torch

from kiln.ops.custom_op import CustomOp, call, kernel, kiln_op


def rope_inv_freq(rotary_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        # llama.cpp's rope_freqs tensor (Llama 3.1 GGUF files): each frequency's own divisor,
        # which its converter computed from the llama3 settings.
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope frequency factors: {factors.numel()} given, the rotary dim needs {inv_freq.numel()}")
        return inv_freq / factors
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the
        # band between is blended smoothly.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported; kiln knows 'default', 'linear', 'llama3' and "
        f"'freq_factors' (GGUF's rope_freqs)"
    )


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float, scaling: dict | None,
                       device=None) -> torch.Tensor:
    """[max_position, rotary_dim]: cos in the first half of each row, sin in the second."""
    inv_freq = rope_inv_freq(rotary_dim, base, scaling).to(device)
    freqs = torch.outer(torch.arange(max_position, device=device, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, head_dim: int) -> torch.Tensor:
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    rotated = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if rotary_dim < head_dim:  # partial rotary: the rest passes through (no empty slice to trace)
        rotated.append(x[..., rotary_dim:])
    return torch.cat(rotated, dim=-1)


def rotary_native(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions).to(q.dtype).chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    num_tokens = positions.shape[0]
    q = _rotate(q.view(num_tokens, -1, head_dim), cos, sin, rotary_dim, head_dim)
    k = _rotate(k.view(num_tokens, -1, head_dim), cos, sin, rotary_dim, head_dim)
    return q.flatten(1), k.flatten(1)


@kiln_op("kiln::rotary_embedding", mutates_args=())
def rotary_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              cos_sin_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_native(positions, q, k, cos_sin_cache, head_dim)


@rotary_op.register_fake
def _(positions, q, k, cos_sin_cache, head_dim):
    # The op is where the positions meet the hidden states: say they have one token count,
    # or a capture gives positions a size symbol of its own (as the native path does not).
    torch._check(positions.shape[0] == q.shape[0])
    return torch.empty_like(q), torch.empty_like(k)


@kernel(rotary_op, "cuda")
def _(positions, q, k, cos_sin_cache, head_dim):
    from kiln.ops.triton.rotary import rotary_embedding

    return rotary_embedding(positions, q, k, cos_sin_cache, head_dim)


class RotaryEmbedding(CustomOp):
    """Rotates q and k ([tokens, heads * head_dim]) by their positions."""

    op_names = ("rotary_embedding",)

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.max_position, self.base, self.scaling = max_position, base, scaling
        with torch.device("cpu"):  # unknown scaling types fail at build time; on the meta device
            rope_inv_freq(rotary_dim, base, scaling)  # the division would import all of Dynamo
        self.register_buffer("cos_sin_cache", torch.empty(max_position, rotary_dim), persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        """Fill the cache on `device`: models are built on the meta device, without data."""
        self.cos_sin_cache = rope_cos_sin_cache(self.rotary_dim, self.max_position, self.base,
                                                self.scaling, device)

    def forward_native(self, positions, q, k):
        return rotary_native(positions, q, k, self.cos_sin_cache, self.head_dim)

    def forward_kernel(self, positions, q, k):
        return call(rotary_op, positions, q, k, self.cos_sin_cache, self.head_dim)
