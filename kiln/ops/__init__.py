"""kiln's ops. Importing this registers every `torch.ops.kiln.*` op."""

from kiln.ops.activation import GeluTanhAndMul, SiluAndMul
from kiln.ops.attention import Attention
from kiln.ops.custom_op import enabled_custom_ops, known_ops, register_direct_kernels
from kiln.ops.linear import SkinnyLinear
from kiln.ops.moe import fused_moe
from kiln.ops.norm import RMSNorm
from kiln.ops.rotary import RotaryEmbedding

register_direct_kernels()  # after every op and kernel above is defined

__all__ = ["Attention", "GeluTanhAndMul", "RMSNorm", "RotaryEmbedding", "SiluAndMul", "SkinnyLinear", "enabled_custom_ops",
           "fused_moe", "known_ops"]
