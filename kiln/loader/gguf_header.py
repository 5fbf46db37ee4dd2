"""A GGUF file's metadata and tensor index, read in one pass over the header.

The gguf package's reader builds a numpy view for every part of every value: 1.6 s for
the embedded SmolLM2, nearly all of it in the tokenizer's 98,000 strings, before a single
weight is read. Here strings are sliced straight out of the mapped file (~0.1 s). Tensor
data stays a view of the mapping, laid out as the gguf package lays it out, so its
dequantizers read it unchanged.

Layout (GGUF v2/v3, little-endian): magic "GGUF", version u32, tensor count u64, key-value
count u64; each key-value pair is a string key, a u32 type and the value; then per tensor
its name, n_dims u32, dims u64 (fastest first), type u32 and data offset u64; tensor data
starts at the next multiple of general.alignment (32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.loader.ggml_types import ggml_type

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
_FLOAT_DATA = {0: np.float32, 1: np.float16}  # GGML F32, F16: typed arrays, not bytes


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order: the fastest-varying dim first
    tensor_type: int  # a GGML type id (kiln.loader.ggml_types)
    data: np.ndarray  # typed [dims reversed] for F32/F16, else uint8 [rows, bytes per row]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row: string() inlined, as a tokenizer's vocabulary and merges are
        ~100,000 of them (the embedded SmolLM2's header 0.068 -> 0.044 s on this CPU)."""
        buf, pos, out = self.buf, self.pos, []
        length, append = _U64.unpack_from, out.append
        for _ in range(count):
            n = length(buf, pos)[0]
            pos += 8
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
                self.pos += count * dtype.itemsize
                return values.tolist()
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {kind} at byte {self.pos}; the file is "
                         f"corrupt or newer than this reader")


def read_gguf(path: str | Path) -> tuple[dict, list[GGUFTensor]]:
    """(metadata by key, tensors in file order) of the GGUF file at `path`."""
    path = Path(path)
    mapped = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(mapped), path)
    if bytes(cursor.buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cursor.pos = 4
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
    fields = {}
    for _ in range(num_fields):
        key = cursor.string()
        fields[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
    alignment = fields.get("general.alignment", 32)
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        try:
            _, block, type_bytes = ggml_type(kind)
        except (KeyError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has GGML type {kind}, which neither kiln nor the gguf "
                             f"package knows; the file is corrupt or newer than both") from None
        count = int(np.prod(dims))
        nbytes = count // block * type_bytes
        raw = mapped[start + offset:start + offset + nbytes]
        if kind in _FLOAT_DATA:
            data = raw.view(_FLOAT_DATA[kind]).reshape(tuple(reversed(dims)))
        else:
            data = raw.reshape(count // dims[0], dims[0] // block * type_bytes)
        tensors.append(GGUFTensor(name, dims, kind, data))
    return fields, tensors
