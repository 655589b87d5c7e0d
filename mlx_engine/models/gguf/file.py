"""The GGUF container: header, metadata and tensor table, read without gguf.GGUFReader (~16 s for a
262k-token vocabulary); tensors stay views of one memory map."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, GGUFValueType as VT

GROUP_SIZE = 32  # the block of every GGUF legacy quant type (Q4_0, Q4_1, Q8_0)
_FLOAT_TYPES = {QT.F32: np.float32, QT.F16: np.float16}


@dataclass
class GGUFTensor:
    qtype: QT
    shape: tuple[int, ...]  # numpy order: (rows, ..., columns)
    raw: np.ndarray  # F32/F16: the values; other types: uint8 blocks, shape (rows, ..., bytes per row)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def arch(self) -> str | None:
        return self.metadata.get("general.architecture")

    def key(self, name: str, default: Any = None) -> Any:
        """Architecture-scoped metadata: key("block_count") reads "<arch>.block_count"."""
        return self.metadata.get(f"{self.arch}.{name}", default)


_SCALAR_FORMATS = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I", VT.INT32: "<i",
    VT.FLOAT32: "<f", VT.BOOL: "<?", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT64: "<d",
}  # fmt: skip


class _Cursor:
    def __init__(self, buf: np.ndarray):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        text = self.buf[self.pos : self.pos + n].tobytes().decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == VT.STRING:
            return self.string()
        if vtype != VT.ARRAY:
            return self.unpack(_SCALAR_FORMATS[vtype])
        etype, n = self.unpack("<I"), self.unpack("<Q")
        if etype in (VT.STRING, VT.ARRAY):
            return [self.value(etype) for _ in range(n)]
        dtype = np.dtype(_SCALAR_FORMATS[etype])
        values = self.buf[self.pos : self.pos + n * dtype.itemsize].view(dtype).copy()
        self.pos += n * dtype.itemsize
        return values


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor table; tensor data stay memory-mapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if buf[:4].tobytes() != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    cur = _Cursor(buf)
    cur.pos = 4
    try:
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (v1 and big-endian files are not supported)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
            qtype, offset = QT(cur.unpack("<I")), cur.unpack("<Q")
            infos.append((name, tuple(reversed(dims)), qtype, offset))
    except (struct.error, KeyError, IndexError) as e:
        raise ValueError(f"{path} is truncated or corrupt: its header is cut off or unreadable "
                         f"(the file has {buf.size} bytes)") from None
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    need = max((data_start + off + _nbytes(shape, qt) for _, shape, qt, off in infos), default=data_start)
    if need > buf.size:
        raise ValueError(f"{path} is truncated: its tensors need {need} bytes, the file has {buf.size} "
                         f"(an incomplete download or copy?)")
    tensors = {name: _tensor(buf, data_start + off, shape, qt) for name, shape, qt, off in infos}
    return GGUFFile(path, metadata, tensors)


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if qtype in _FLOAT_TYPES:
        return rows * shape[-1] * np.dtype(_FLOAT_TYPES[qtype]).itemsize
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return rows * (shape[-1] // block * block_bytes)


def _tensor(buf: np.ndarray, start: int, shape: tuple[int, ...], qtype: QT) -> GGUFTensor:
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if qtype in _FLOAT_TYPES:
        dtype = np.dtype(_FLOAT_TYPES[qtype])
        raw = buf[start : start + rows * shape[-1] * dtype.itemsize].view(dtype).reshape(shape)
    else:
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        row_bytes = shape[-1] // block * block_bytes
        raw = buf[start : start + rows * row_bytes].reshape(*shape[:-1], row_bytes)
    return GGUFTensor(qtype, shape, raw)
