"""GGML's tensor types as GGUF files store them: type id -> (name, weights a block, bytes a block).

The gguf package holds the same table, but importing it (its vocabulary and metadata modules,
yaml) took ~0.12 s of every start from a GGUF file on the 2-core CPU, for a dozen constants;
a test keeps this table equal to the installed package's. A type missing here (one newer than
the table) is looked up in the package.
"""

from __future__ import annotations

GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}


def ggml_type(type_id: int) -> tuple[str, int, int]:
    """(name, weights a block, bytes a block) of a GGML tensor type; ValueError (or KeyError: a
    type without sizes) where neither this table nor the gguf package knows it."""
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    kind = GGMLQuantizationType(type_id)  # ValueError for an id the package does not know either
    return (kind.name, *GGML_QUANT_SIZES[kind])
