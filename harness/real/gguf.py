"""A minimal reader for GGUF files (the llama.cpp / ggml model format), enough to load LLaMA weights.

Owns parsing the header, the typed key-value metadata and the tensor directory, and dequantising
the block formats a small LLaMA checkpoint uses (F32, F16, BF16, Q8_0, Q4_0, Q4_1) to float32.
Layout follows the GGUF specification (ggml repository, ``docs/gguf.md``): little-endian header
``"GGUF"``, version, tensor count, metadata count; metadata values are typed (scalars, strings as
u64 length + UTF-8 bytes, arrays as element type + u64 count); each tensor entry lists its name,
dimensions (fastest-varying first), ggml type and offset into the data section, which starts at
the next multiple of ``general.alignment`` (default 32) after the directory.

Block formats (32 weights per block, ggml ``ggml-common.h``): Q8_0 = f16 scale d, 32 int8 q,
w = d*q; Q4_0 = f16 d, 16 bytes of nibbles, w = d*(q - 8); Q4_1 = f16 d, f16 min m, 16 bytes, w =
d*q + m. Byte j holds weight j in its low nibble and weight j + 16 in its high nibble.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
            12: "<d"}  # struct (and numpy) codes of the scalar metadata types
_STRING, _ARRAY = 8, 9
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30
_BLOCKS = {  # type -> (weights per block, numpy dtype of one block)
    GGML_Q8_0: (32, np.dtype([("d", "<f2"), ("q", "i1", 32)])),
    GGML_Q4_0: (32, np.dtype([("d", "<f2"), ("q", "u1", 16)])),
    GGML_Q4_1: (32, np.dtype([("d", "<f2"), ("m", "<f2"), ("q", "u1", 16)])),
}
_PLAIN = {GGML_F32: np.dtype("<f4"), GGML_F16: np.dtype("<f2"), GGML_BF16: np.dtype("<u2")}


class GGUFError(ValueError):
    """The file is not GGUF, is truncated, or holds a tensor type this reader cannot decode."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest first): GGUF dims reversed
    ggml_type: int
    offset: int  # absolute byte offset in the file


class _Cursor:
    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            v = self.take(_SCALARS[vtype])
            return bool(v) if vtype == 7 else v
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, n = self.take("<I"), self.take("<Q")
            if etype in _SCALARS and etype != 7:
                dt = np.dtype(_SCALARS[etype])
                arr = np.frombuffer(self.data, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self.value(etype) for _ in range(n)]
        raise GGUFError(f"unknown GGUF metadata type {vtype}")


class GGUFFile:
    """Metadata and tensors of one GGUF file, memory-mapped; tensors dequantise on access."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._mm))
        try:
            if bytes(self._mm[:4]) != b"GGUF":
                raise GGUFError(f"{self.path} is not a GGUF file (bad magic)")
            cur.pos = 4
            self.version = cur.take("<I")
            if self.version not in (2, 3):
                raise GGUFError(f"unsupported GGUF version {self.version}")
            n_tensors, n_kv = cur.take("<Q"), cur.take("<Q")
            self.metadata: dict[str, object] = {}
            for _ in range(n_kv):
                key = cur.string()
                self.metadata[key] = cur.value(cur.take("<I"))
            raw = []
            for _ in range(n_tensors):
                name = cur.string()
                dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
                raw.append((name, tuple(reversed(dims)), cur.take("<I"), cur.take("<Q")))
        except struct.error as exc:
            raise GGUFError(f"{self.path} is truncated: {exc}") from exc
        align = int(self.metadata.get("general.alignment", 32))
        base = (cur.pos + align - 1) // align * align
        self.tensors = {n: TensorInfo(n, s, t, base + o) for n, s, t, o in raw}

    def nbytes(self, name: str) -> int:
        """Bytes the named tensor's data takes in the file."""
        info = self.tensors[name]
        count = int(np.prod(info.shape))
        if info.ggml_type in _PLAIN:
            return count * _PLAIN[info.ggml_type].itemsize
        if info.ggml_type not in _BLOCKS:
            raise GGUFError(f"tensor {name}: ggml type {info.ggml_type} is not supported by this reader")
        per_block, dt = _BLOCKS[info.ggml_type]
        if count % per_block:
            raise GGUFError(f"tensor {name}: {count} weights are not whole blocks of {per_block}")
        return count // per_block * dt.itemsize

    def check(self) -> None:
        """Raise :class:`GGUFError` unless every tensor has a type this reader decodes and lies
        wholly inside the file (what :meth:`tensor` would find out one tensor at a time)."""
        size = len(self._mm)
        for name, info in self.tensors.items():
            end = info.offset + self.nbytes(name)
            if end > size:
                raise GGUFError(f"{self.path} is truncated: tensor {name} ends at byte {end}, the file has {size}")

    def tensor(self, name: str) -> torch.Tensor:
        """The named tensor as float32 (a copy, dequantised if stored in a block format)."""
        info = self.tensors[name]
        count = int(np.prod(info.shape))
        if info.ggml_type in _PLAIN:
            dt = _PLAIN[info.ggml_type]
            arr = np.frombuffer(self._mm, dtype=dt, count=count, offset=info.offset)
            if info.ggml_type == GGML_BF16:
                arr = (arr.astype(np.uint32) << 16).view(np.float32)
            return torch.from_numpy(arr.astype(np.float32)).reshape(info.shape)
        if info.ggml_type not in _BLOCKS:
            raise GGUFError(f"tensor {name}: ggml type {info.ggml_type} is not supported by this reader")
        per_block, dt = _BLOCKS[info.ggml_type]
        if count % per_block:
            raise GGUFError(f"tensor {name}: {count} weights are not whole blocks of {per_block}")
        blocks = np.frombuffer(self._mm, dtype=dt, count=count // per_block, offset=info.offset)
        d = blocks["d"].astype(np.float32)[:, None]
        if info.ggml_type == GGML_Q8_0:
            w = d * blocks["q"].astype(np.float32)
        else:
            q = blocks["q"]
            nibbles = np.concatenate([q & 0x0F, q >> 4], axis=1).astype(np.float32)
            if info.ggml_type == GGML_Q4_0:
                w = d * (nibbles - 8.0)
            else:
                w = d * nibbles + blocks["m"].astype(np.float32)[:, None]
        return torch.from_numpy(np.ascontiguousarray(w)).reshape(info.shape)


def gguf_bytes(metadata: dict, tensors: list[tuple[str, tuple[int, ...], int, bytes]]) -> bytes:
    """A minimal GGUF v3 file, the inverse of what :class:`GGUFFile` reads (for tests that need a
    checkpoint on disk): metadata values are str, int (u32), float (f32) or lists of str; tensors
    are (name, torch shape, ggml type, raw bytes), 32-byte aligned."""
    def string(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += string(key)
        if isinstance(value, str):
            out += struct.pack("<I", _STRING) + string(value)
        elif isinstance(value, float):
            out += struct.pack("<If", 6, value)
        elif isinstance(value, int):
            out += struct.pack("<II", 4, value)
        else:
            out += struct.pack("<IIQ", _ARRAY, _STRING, len(value)) + b"".join(string(v) for v in value)
    offset, blobs = 0, b""
    for name, shape, ggml_type, raw in tensors:
        out += string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
        out += struct.pack("<IQ", ggml_type, offset)
        pad = (-len(raw)) % 32
        blobs += raw + b"\0" * pad
        offset += len(raw) + pad
    out += b"\0" * ((-len(out)) % 32)
    return bytes(out) + blobs
