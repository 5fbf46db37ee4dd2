"""Every user-facing knob, one dataclass per concern; contradictions fail here, at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.ops.custom_op import resolve_custom_ops

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_gib: float = 1.0  # CPU: memory for the KV cache
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU kiln may fill, cache included
    num_kv_blocks: int | None = None  # overrides both budgets (tests, small-memory runs)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    custom_ops: list[str] = field(default_factory=list)  # e.g. ["none", "+rms_norm"]
    seed: int = 0

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA GPU; use device='cpu' or 'auto'")
        resolve_custom_ops(self.custom_ops, "none")  # a bad list fails now, not at build time

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]
