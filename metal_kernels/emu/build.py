"""The build cache: generated translation units compiled with g++ against metal_emu.h into shared
libraries, cached under the temp dir by a hash of the headers, the text and the flags (so concurrent
sessions and later runs reuse them), many instantiations bundled per unit and compiled in parallel,
and their launchers bound through ctypes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Protocol

from .codegen import KernelSource, Variant
from .dtypes import EmuError


class Buildable(Protocol):
    """What the build needs of a kernel (kernel.Buildable): its code, its instantiations, and where the
    bound launchers go."""

    name: str
    code: KernelSource
    os_threads: bool
    _loaded: dict

    def variant(self, inputs, output_dtypes, template=None) -> Variant: ...

    def _todo(self, variants: list[Variant]) -> list[Variant]: ...

EMU_DIR = Path(__file__).resolve().parent
HEADER = EMU_DIR / "metal_emu.h"
CXX = os.environ.get("METAL_EMU_CXX", "g++")
CXXFLAGS = ("-std=c++20", "-O1", "-pthread", "-fPIC", "-shared", "-ffp-contract=off", "-w")


def compiler_available() -> bool:
    return shutil.which(CXX) is not None


def _flags(os_threads: bool) -> list[str]:
    return [*CXXFLAGS, *(["-DMETAL_EMU_OS_THREADS=1"] if os_threads else [])]


_pch_lock = threading.Lock()


def _pch_dir(os_threads: bool) -> Path | None:
    """A directory holding metal_emu.h.gch (built once per header version and flag set), or None."""
    flags = [f for f in _flags(os_threads) if f != "-shared"]
    digest = hashlib.sha256(HEADER.read_bytes() + " ".join([CXX, *flags]).encode()).hexdigest()[:24]
    d = cache_dir() / f"pch_{digest}"
    gch = d / "metal_emu.h.gch"
    with _pch_lock:
        if gch.exists():
            return d
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"metal_emu.{os.getpid()}.{threading.get_ident()}.gch"
        r = subprocess.run(
            [CXX, *flags, "-x", "c++-header", str(HEADER), "-o", str(tmp)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        if r.returncode != 0:
            tmp.unlink(missing_ok=True)
            return None  # compile without it; errors will show in the real compile
        os.replace(tmp, gch)
        return d


class CompileJob:
    """One translation unit holding the instantiations of one or more kernels."""

    def __init__(self, items: list[tuple[Buildable, list[Variant]]], os_threads: bool):
        self.items = items
        self.os_threads = os_threads
        cuda = '#include "cuda_emu.h"\n' if any(k.code.dialect == "cuda" for k, _ in items) else ""
        self.tu = '#include "metal_emu.h"\n' + cuda + "".join(k.code.section(vs) for k, vs in items)
        self.names = ", ".join(k.name for k, _ in items)
        flags = _flags(os_threads)
        digest = hashlib.sha256()
        digest.update(HEADER.read_bytes())
        digest.update((EMU_DIR / "cuda_emu.h").read_bytes())
        digest.update(self.tu.encode())
        digest.update(" ".join([CXX, *flags]).encode())
        self.dir = cache_dir() / digest.hexdigest()[:24]
        self.lib = self.dir / "kernel.so"
        self.flags = flags
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.lib.exists():
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        # unique temp source and output so that concurrent sessions (test workers) never compile a half-written
        # source or load a half-written library
        unique = f"{os.getpid()}.{threading.get_ident()}"
        source = self.dir / f"kernel.{unique}.cpp"
        source.write_text(self.tu)
        os.replace(source, self.dir / "kernel.cpp")
        self.tmp = self.dir / f"kernel.{unique}.so"
        pch = _pch_dir(self.os_threads)
        includes = ([f"-I{pch}"] if pch else []) + [f"-I{EMU_DIR}"]
        cmd = [CXX, *self.flags, *includes, "-o", str(self.tmp), str(self.dir / "kernel.cpp")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(self) -> None:
        if self.proc is not None:
            out, _ = self.proc.communicate()
            if self.proc.returncode != 0:
                raise EmuError(
                    f"g++ failed for {self.names} ({self.dir / 'kernel.cpp'}):\n{out[-6000:]}"
                )
            os.replace(self.tmp, self.lib)
        lib = ctypes.CDLL(str(self.lib))
        for kernel, variants in self.items:
            self._bind(lib, kernel, variants)

    @staticmethod
    def _bind(lib, kernel: Buildable, variants: list[Variant]) -> None:
        for v in variants:
            fn = getattr(lib, v.symbol)
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.POINTER(ctypes.c_longlong),
                ctypes.POINTER(ctypes.c_longlong),
                ctypes.POINTER(ctypes.c_longlong),
                ctypes.c_int,
                ctypes.c_ulonglong,
                ctypes.c_char_p,
                ctypes.c_int,
            ]
            kernel._loaded[v.key] = (lib, v.symbol)


def cache_dir() -> Path:
    d = os.environ.get("METAL_EMU_CACHE")
    if d:
        return Path(d)
    return Path(tempfile.gettempdir()) / f"metal_emu_cache_{os.getuid()}"


def precompile(jobs: Iterable[tuple[Buildable, Iterable[dict]]], parallel: int | None = None) -> None:
    """Compile the instantiations of several kernels: bundled into at most `parallel` (default: the
    CPU count) translation units per thread model, balanced by instantiation count, compiled in
    parallel. Kernels with a `header` get a unit of their own (headers may clash)."""
    width = parallel or max(1, os.cpu_count() or 1)
    groups: dict[bool, list[tuple[Buildable, list[Variant]]]] = {}
    for kernel, calls in jobs:
        todo = kernel._todo([kernel.variant(c["inputs"], c["output_dtypes"], c.get("template")) for c in calls])
        if todo:
            groups.setdefault(kernel.os_threads, []).append((kernel, todo))
    pending: list[CompileJob] = []
    for os_threads, items in groups.items():
        solo = [it for it in items if it[0].code.header]
        rest = sorted((it for it in items if not it[0].code.header), key=lambda it: -len(it[1]))
        buckets: list[list] = [[] for _ in range(min(width, len(rest)))]
        loads = [0] * len(buckets)
        for it in rest:  # largest first into the lightest bucket
            i = loads.index(min(loads))
            buckets[i].append(it)
            loads[i] += 2 + len(it[1])
        for bucket in [[it] for it in solo] + [b for b in buckets if b]:
            pending.append(CompileJob(bucket, os_threads))
    running: list[CompileJob] = []
    for job in pending:
        job.start()
        running.append(job)
        if len(running) >= width:
            running.pop(0).finish()
    for job in running:
        job.finish()
