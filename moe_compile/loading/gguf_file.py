"""A GGUF file's header: its metadata and where each tensor's bytes are, read with plain file reads.

    header = read_header(path)
    header.fields["qwen3moe.expert_count"]        # -> 128
    for t in header.tensors: t.name, t.ggml_type, t.shape (numpy order), t.offset, t.nbytes

Layout (GGUF v2 / v3, little-endian): magic "GGUF", version u32, tensor count u64, metadata count
u64; each metadata entry a string key, a u32 value type and the value (arrays: element type u32,
count u64, elements); each tensor a string name, n_dims u32, dims u64 (innermost first), ggml type
u32 and offset u64 from the data section, which starts at the next multiple of
``general.alignment`` (32 by default).  Strings are a u64 length and UTF-8 bytes.

Why not ``gguf.GGUFReader``: it maps the whole file and builds a view of every tensor up front, so
a truncated file fails inside numpy without naming the tensor; here every tensor is checked
against the file's size and a bad one is named.
"""

from __future__ import annotations

import dataclasses
import os
import struct

# value type -> struct format of one element (8: string, 9: array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml type -> (name, elements a block, bytes a block): the types a model file holds
GGML_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
              7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
              12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
              20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136), 30: ("BF16", 1, 2)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: str  # GGML_TYPES' name
    shape: tuple[int, ...]  # numpy order: outermost first, the block dimension last
    offset: int  # absolute, in the file
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Header:
    path: str
    fields: dict
    tensors: tuple[TensorInfo, ...]


class _Stream:
    def __init__(self, f, path: str):
        self.f, self.path = f, path

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        raw = self.f.read(n)
        if len(raw) < n:
            raise ValueError(f"moe_compile.load: {self.path} ends inside its GGUF header (at byte {self.f.tell()})")
        return struct.unpack(fmt, raw)[0]

    def string(self) -> str:
        n = self.take("<Q")
        raw = self.f.read(n)
        if len(raw) < n:
            raise ValueError(f"moe_compile.load: {self.path} ends inside its GGUF header")
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == 8:
            return self.string()
        if kind == 9:
            inner, count = self.take("<I"), self.take("<Q")
            return [self.value(inner) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"moe_compile.load: {self.path}: metadata value type {kind} is not GGUF's")
        return self.take(_SCALARS[kind])


def read_header(path: str) -> Header:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        s = _Stream(f, path)
        if f.read(4) != b"GGUF":
            raise ValueError(f"moe_compile.load: {path} is not a GGUF file (no 'GGUF' magic)")
        version = s.take("<I")
        if version not in (2, 3):
            raise ValueError(f"moe_compile.load: {path} is GGUF version {version}; versions 2 and 3 are read")
        n_tensors, n_fields = s.take("<Q"), s.take("<Q")
        fields = {}
        for _ in range(n_fields):
            key = s.string()
            fields[key] = s.value(s.take("<I"))
        raw = [(s.string(), [s.take("<Q") for _ in range(s.take("<I"))], s.take("<I"), s.take("<Q"))
               for _ in range(n_tensors)]
        align = int(fields.get("general.alignment", 32))
        start = (f.tell() + align - 1) // align * align
    return Header(path, fields, tuple(_tensor(path, size, start, *r) for r in raw))


def _tensor(path: str, size: int, start: int, name: str, dims: list, kind: int, offset: int) -> TensorInfo:
    if kind not in GGML_TYPES:
        raise ValueError(f"moe_compile.load: {path}: tensor {name!r} has ggml type {kind}, which this loader does "
                         f"not know; requantize the file to q4_0 / q8_0 / f16")
    type_name, block, block_bytes = GGML_TYPES[kind]
    if dims[0] % block:
        raise ValueError(f"moe_compile.load: {path}: tensor {name!r} ({type_name}) has rows of {dims[0]}, not whole "
                         f"blocks of {block}")
    n = 1
    for d in dims:
        n *= d
    nbytes = n // block * block_bytes
    end = start + offset + nbytes
    if end > size:
        raise ValueError(f"moe_compile.load: {path} is truncated: tensor {name!r} ends at byte {end}, the file has "
                         f"{size}")
    return TensorInfo(name, type_name, tuple(reversed(dims)), start + offset, nbytes)
