"""Safetensors files at the byte level: the header (names, dtypes, shapes, byte ranges) without reading a
tensor, and a copy of chosen tensors into a new file byte for byte (F8_E4M3, BF16, ... kept as stored).

Used to take an MTP head out of a checkpoint's shards (a few GB out of hundreds) without loading, casting
or re-encoding anything: what lands in the cache is exactly what the model's makers published.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CHUNK = 1 << 24  # bytes copied at a time


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file (the message names it)."""


def read_header(path) -> tuple[dict, dict, int]:
    """(tensors {name: {dtype, shape, data_offsets}}, metadata, byte offset of the data) of a safetensors file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise SafetensorsError(f"{path} is not a readable safetensors file (its header is cut off)")
            header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if isinstance(e, SafetensorsError):
            raise
        raise SafetensorsError(f"{path} is not a readable safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path} is not a readable safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    return header, meta, 8 + n


def tensor_nbytes(info: dict) -> int:
    a, b = info["data_offsets"]
    return int(b) - int(a)


def copy_tensors(sources: list[tuple[Path, list[str]]], dst, metadata: dict | None = None) -> dict:
    """Write the named tensors of each source file into `dst` (one new safetensors file), bytes unchanged.

    Returns {name: header entry} of what was written. The file is written to `dst.part` and renamed, so an
    interrupted copy never leaves a file that looks complete."""
    dst = Path(dst)
    plan, header, off = [], {}, 0
    for path, names in sources:
        tensors, _, start = read_header(path)
        for name in sorted(names):
            if name in header:
                raise SafetensorsError(f"tensor {name} is in more than one file")
            if name not in tensors:
                raise SafetensorsError(f"{path} holds no tensor {name}")
            info = tensors[name]
            n = tensor_nbytes(info)
            header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [off, off + n]}
            plan.append((path, start + int(info["data_offsets"][0]), n))
            off += n
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    tmp = dst.with_name(dst.name + ".part")
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as out:
            out.write(len(raw).to_bytes(8, "little"))
            out.write(raw)
            handles: dict = {}
            try:
                for path, pos, n in plan:
                    src = handles.get(path) or handles.setdefault(path, open(path, "rb"))
                    src.seek(pos)
                    while n:
                        chunk = src.read(min(n, CHUNK))
                        if not chunk:
                            raise SafetensorsError(f"{path} is truncated (an incomplete download?)")
                        out.write(chunk)
                        n -= len(chunk)
            finally:
                for h in handles.values():
                    h.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    header.pop("__metadata__", None)
    return header
