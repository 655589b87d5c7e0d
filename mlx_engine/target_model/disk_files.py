"""The prefix cache's files on disk: one safetensors file an entry, written so that no reader ever sees half
of one, checked on every read.

Why safetensors: the format MLX and every model loader read, a JSON header with string metadata beside raw
little-endian tensors, no code execution on load (pickle would), and a file any safetensors tool (the
`safetensors` package, MLX's mx.load) can open to see what is cached. Its layout is written and read here
directly rather than through the package: the writer thread streams each array from its own memory (the
buffer protocol: no MLX call, no copy) and a reader maps the file (np.frombuffer over the mapping), where the
package's save and load each made a copy of every array (a load ran at ~1 GB/s against dd's ~3 here).

    KIND-KEY-CRC.safetensors     KIND "b" (a block), "t" (a tail), "bc" / "tc" (one that holds a recurrent
                                 checkpoint at its end), KEY the entry's content key, CRC the zlib.crc32 of
                                 the whole file, hex

Written to a temporary name in the same folder, flushed and fsynced, then renamed over the final name
(atomic on POSIX): a kill -9 at any point leaves either no file or a whole one. Read back whole, its CRC
compared with the one in its name: a torn, truncated or altered file fails and is dropped, never served.
Two servers writing one key each rename a whole file of their own (the same entries, to the float rounding
of their prefill's chunking: a CRC of its own, so another name), so neither can tear the other's; the index
keeps one and removes the other; a file another server deleted is a miss. Folders are 0700 and files 0600:
a prompt's keys and values are the prompt's content.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
KINDS = ("b", "bc", "t", "tc")
STALE_TMP = 3600.0  # seconds after which a temporary file is a crashed writer's (removed at start)


class CorruptEntry(ValueError):
    """A file that fails its check (torn, truncated, altered or not ours)."""


def entry_name(kind: str, key: str, crc: int) -> str:
    return f"{kind}-{key}-{crc:08x}{SUFFIX}"


def parse_name(name: str) -> tuple[str, str, int] | None:
    """(kind, key, crc) of an entry's file name, or None for any other file."""
    if not name.endswith(SUFFIX) or name.startswith(TMP_PREFIX):
        return None
    parts = name[: -len(SUFFIX)].split("-")
    if len(parts) != 3 or parts[0] not in KINDS:
        return None
    try:
        return parts[0], parts[1], int(parts[2], 16)
    except ValueError:
        return None


def private_dir(path: Path) -> Path:
    """`path` made (parents too) and kept to its owner alone (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_atomic(folder: Path, kind: str, key: str, arrays: dict, metadata: dict[str, str]) -> tuple[Path, int]:
    """Entry (kind, key) in `folder`, its arrays (anything with the buffer protocol, C-contiguous: MLX arrays are
    read in place, no copy) and metadata in safetensors' layout: a temporary file, fsynced, renamed.
    -> (its final path, its bytes)."""
    header: dict = {"__metadata__": metadata}
    views, offset = [], 0
    for name in sorted(arrays):
        view = memoryview(arrays[name])
        if not view.c_contiguous:
            raise ValueError(f"{name}: not C-contiguous")
        header[name] = {"dtype": CODES[np.dtype(view.format)], "shape": list(view.shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        views.append(view.cast("B"))
        offset += view.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # (the data 8-byte aligned, as safetensors writes it)
    prefix = struct.pack("<Q", len(head)) + head
    crc = zlib.crc32(prefix)
    for v in views:
        crc = zlib.crc32(v, crc)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=folder)  # (mkstemp: 0600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(prefix)
            for v in views:
                f.write(v)
            f.flush()
            os.fsync(f.fileno())
        final = folder / entry_name(kind, key, crc)
        os.replace(tmp, final)
        return final, len(prefix) + offset
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
          "BOOL": np.bool_}
CODES = {np.dtype(t): code for code, t in DTYPES.items()}


def read_checked(path: Path, crc: int) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The entry's arrays and metadata, after its CRC matched (CorruptEntry otherwise). The file is mapped, not
    read into a copy: its arrays are views of the page cache (np.frombuffer over the mapping), so a load costs
    the CRC's pass and the one copy its caller makes of each array (safetensors' own loader copies each
    array first: measured here, a load ran at ~1 GB/s against dd's ~3 from the page cache)."""
    import mmap

    try:
        with open(path, "rb") as f:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except ValueError:  # an empty file cannot be mapped
        raise CorruptEntry(f"{path.name}: empty") from None
    if hasattr(data, "madvise"):  # the whole file read ahead, while the CRC walks it
        data.madvise(mmap.MADV_WILLNEED)
    if zlib.crc32(data) != crc:
        raise CorruptEntry(f"{path.name}: checksum mismatch ({len(data)} bytes)")
    try:
        (n,) = struct.unpack("<Q", data[:8])
        head = json.loads(data[8 : 8 + n])
        base = 8 + n
        arrays = {}
        for name, info in head.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            dtype = np.dtype(DTYPES[info["dtype"]])
            arrays[name] = np.frombuffer(data, dtype, (end - start) // dtype.itemsize, base + start).reshape(info["shape"])
        return arrays, head.get("__metadata__", {})
    except Exception as e:  # a file whose CRC matches but is no safetensors file of ours
        raise CorruptEntry(f"{path.name}: {type(e).__name__}: {e}") from None


def header(data: bytes) -> dict[str, str]:
    """The safetensors metadata of a file's first bytes."""
    if len(data) < 8:
        raise CorruptEntry("shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise CorruptEntry("header past the end")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {})


def read_header(path: Path) -> dict[str, str]:
    """An entry's metadata, read from its first bytes only (the index at start)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptEntry(f"{path.name}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        return header(head + f.read(n))


def sweep_temporaries(folder: Path) -> None:
    """Remove temporary files a crashed writer left (older than STALE_TMP: a live writer's are younger)."""
    now = time.time()
    for p in folder.glob(TMP_PREFIX + "*"):
        try:
            if now - p.stat().st_mtime > STALE_TMP:
                p.unlink()
        except OSError:
            pass
