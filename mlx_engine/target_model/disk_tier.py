"""The prefix tree's disk tier: what the RAM tree holds is also written to disk, behind the engine thread, and
a prompt the RAM tree misses is looked up there, so an agent's prefix is prefilled once per machine, not once
per process (a restart, a model switch, an eviction).

Entries are keyed by content, in blocks of BLOCK tokens chained from the fingerprint of what produced them
(target_model/fingerprint.py: the weights, the cache's form, the drafter):

    key(block 0) = H(fingerprint, tokens[0:B]),  key(block i) = H(key(block i-1), tokens[iB:(i+1)B])

so a block's key covers every token before it, and an updated model or another drafter never reads them. A
sequence's last, partial block is a TAIL keyed H(key of the block before it, "tail", its tokens). Every entry's
file names its parent's key and holds its own tokens (read at start), so the index knows each key's children:
reuse is exact to the token, not to a block (a prompt that parts from an entry inside it takes the entry's
shared positions, where the cache is positional; a hybrid takes whole entries ending at a checkpoint). An entry
holds its positions' layer entries (each positional layer's keys and values: a sliding window's too; MLA's
latents), the hidden rows a drafter reads, the drafter's own entries where the tree had them, and for a
hybrid the recurrent states after its last token where the tree holds a checkpoint there (a "bc" / "tc"
entry). A lookup takes the chain of blocks the prompt matches, then the longest tail under one of them
(or block) under one of them sharing the most tokens with it; a hybrid's stops at the deepest entry holding a
checkpoint.

Writes: `offer` (the engine thread, after the RAM tree stored a sequence) picks the entries not on disk yet,
cuts their arrays out of the tree (lazy slices, started on the device at once) and queues them; a writer
thread turns them into files (target_model/disk_files.py: atomic, checksummed, 0600) and keeps the folder
within its byte budget, least recently used first. The decode never waits for the disk. A write that fails
(a full disk, a folder that refuses writes) turns the writes off with one warning: the RAM tree serves on.
Loads run on the engine thread, timed (`load_seconds`), and the engine counts them as the prompt's prefill.
A restart rebuilds the index from the files (their names, and the parent key and tokens in each header).
"""

from __future__ import annotations

import hashlib
import struct
import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import host
from . import disk_files as files
from .prefix_cache import common_prefix

BLOCK = 256  # tokens a block entry holds
FORMAT = "1"


def _hash(parent: str, tokens: list[int], salt: bytes = b"") -> str:
    h = hashlib.sha256(parent.encode() + salt)
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))  # the tokens as little-endian int32
    return h.hexdigest()[:40]


def chain_keys(root: str, tokens: list[int], block: int = BLOCK) -> list[str]:
    """The keys of `tokens`' whole blocks: each covers its block's tokens and the key before it."""
    keys, parent = [], root
    for i in range(len(tokens) // block):
        parent = _hash(parent, tokens[i * block : (i + 1) * block])
        keys.append(parent)
    return keys


def tail_key(parent: str, tokens: list[int]) -> str:
    return _hash(parent, tokens, b"|tail")


@dataclass
class Entry:
    kind: str  # "b" / "bc" (a block), "t" / "tc" (a tail); "c": it holds a recurrent checkpoint
    key: str
    crc: int
    path: Path
    nbytes: int
    used: float  # the last use (its file's mtime): least recently used go first
    parent: str = ""  # the key of the block before it (or the fingerprint)
    tokens: list[int] = field(default_factory=list)  # its own tokens

    @property
    def checkpoint(self) -> bool:
        return self.kind.endswith("c")


@dataclass
class Piece:
    """One entry's share of a load: positions start..end (of the prompt), their per-layer states, hidden rows,
    and the drafter's states of the first `drafter_n` of them (none: 0)."""

    start: int
    end: int
    layers: list
    hidden: mx.array | None
    drafter: list | None
    drafter_n: int


@dataclass
class Loaded:
    """What a load restores: its pieces in token order (n positions in all), the recurrent checkpoint after the
    n (a hybrid's), and the seconds it took. An entry's arrays are kept as they were read, never joined: the
    prefix tree takes each as an edge of its own (one copy from the page cache in all)."""

    n: int
    pieces: list[Piece]
    checkpoint: list | None
    seconds: float

    @property
    def drafter_n(self) -> int:
        """Positions from the start whose drafter states the load holds."""
        n = 0
        for p in self.pieces:
            n += p.drafter_n
            if p.drafter_n < p.end - p.start:
                break
        return n


def _flatten(states: list, prefix: str, out: dict) -> list:
    """Per-layer states into named leaves of `out`; -> each layer's skeleton (leaf numbers in its nesting)."""
    skeletons = []
    for i, state in enumerate(states):
        count = [0]

        def walk(x, i=i, count=count):
            if isinstance(x, (tuple, list)):
                return [walk(y) for y in x]
            out[f"{prefix}{i}.{count[0]}"] = x
            count[0] += 1
            return count[0] - 1

        skeletons.append(walk(state))
    return skeletons


def _build(skeleton, leaves: list):
    if isinstance(skeleton, list):
        return tuple(_build(s, leaves) for s in skeleton)
    return leaves[skeleton]


class DiskTier:
    def __init__(self, folder: Path, fingerprint: str, budget_bytes: int, checkpoints: bool = False,
                 block: int = BLOCK, manifest: dict | None = None):
        """folder: the cache folder (this fingerprint's entries go in folder/fingerprint); budget_bytes: the
        most its files may hold; checkpoints: a hybrid's tree (usable entries hold a checkpoint)."""
        self.root_key = fingerprint
        self.budget = int(budget_bytes)
        self.checkpoints = checkpoints
        self.block = block
        self.lock = threading.Lock()
        self.blocks: dict[str, Entry] = {}  # a block's key -> it
        self.children: dict[str, list[Entry]] = {}  # a key -> the entries (blocks and tails) after it
        self.pending: set[str] = set()
        self.writable: str | None = None  # None: writes on; else why they stopped
        self.hits = self.hit_tokens = self.loads = self.written = self.dropped = self.evicted = 0
        self.load_seconds = 0.0
        self.bytes_read = self.bytes_written = 0
        self.folder = Path(folder) / fingerprint
        try:
            files.private_dir(self.folder)
            if manifest is not None:
                (self.folder / "manifest.json").write_text(json.dumps({**manifest, "format": FORMAT}))
            files.sweep_temporaries(self.folder)
        except OSError as e:
            self._stop_writes(e)
        self._index()
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._writer, name="prefix-disk", daemon=True)
        self.thread.start()

    # -- the index --------------------------------------------------------------------------------------
    def _index(self) -> None:
        """The entries on disk, from their names and headers; unreadable ones are dropped."""
        try:
            names = list(self.folder.iterdir())
        except OSError:
            return
        for path in names:
            parsed = files.parse_name(path.name)
            if parsed is None:
                continue
            kind, key, crc = parsed
            try:
                st = path.stat()
                entry = Entry(kind, key, crc, path, st.st_size, st.st_mtime)
                meta = files.read_header(path)
                entry.parent, entry.tokens = meta["parent"], json.loads(meta["tokens"])
            except (OSError, KeyError, ValueError):
                self._drop_file(path)
                continue
            self._add(entry)

    def _add(self, e: Entry) -> None:
        with self.lock:
            children = self.children.setdefault(e.parent, [])
            old = next((t for t in children if t.key == e.key), None)
            if old is not None:
                children.remove(old)
            children.append(e)
            if e.kind.startswith("b"):
                self.blocks[e.key] = e
        if old is not None and old.path != e.path:  # one key written twice (two servers; chunked otherwise: the
            try:  # same entries to float rounding): both whole, one kept
                old.path.unlink()
            except OSError:
                pass

    def _remove(self, e: Entry) -> None:
        with self.lock:
            if self.blocks.get(e.key) is e:
                del self.blocks[e.key]
            children = self.children.get(e.parent, [])
            if e in children:
                children.remove(e)

    def _drop_file(self, path: Path) -> None:
        self.dropped += 1
        try:
            path.unlink()
        except OSError:
            pass

    def entries(self) -> list[Entry]:
        with self.lock:
            return [e for es in self.children.values() for e in es]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries())

    # -- reading ---------------------------------------------------------------------------------------
    def _plan(self, tokens: list[int]) -> tuple[list[Entry], int]:
        """The entries a load of `tokens` would read and the positions it restores: the matched blocks, then
        the entry under one of them (a tail, or a block the prompt parts from) sharing the most tokens with
        the prompt (a positional cache uses its shared part; a hybrid only whole entries ending at a
        checkpoint)."""
        keys = chain_keys(self.root_key, tokens, self.block)
        chain = []
        with self.lock:
            for k in keys:
                e = self.blocks.get(k)
                if e is None:
                    break
                chain.append(e)
            best, best_n = [], 0
            parents = [self.root_key] + [e.key for e in chain]
            for j, parent in enumerate(parents):  # a block end, then the entries after it
                start = j * self.block
                if j and (not self.checkpoints or chain[j - 1].checkpoint) and start > best_n:
                    best, best_n = chain[:j], start
                for t in self.children.get(parent, []):
                    shared = common_prefix(t.tokens, tokens[start:])
                    whole = shared == len(t.tokens)
                    if start + shared > best_n and (whole or not self.checkpoints) and (whole or shared) and \
                            (not self.checkpoints or t.checkpoint):
                        best, best_n = chain[:j] + [t], start + shared
        return best, best_n

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a load would restore (nothing read)."""
        return self._plan(tokens)[1]

    def _count(self, e: Entry) -> int:
        return len(e.tokens)

    def load(self, tokens: list[int]) -> Loaded | None:
        """The longest prefix of `tokens` on disk, read and checked (a file that fails its check is dropped and
        the lookup planned again without it). None when nothing usable is there."""
        t0 = time.perf_counter()
        for _ in range(4):
            plan, n = self._plan(tokens)
            if not plan:
                return None
            parts, bad = [], None
            for e in plan:
                try:
                    arrays, meta = files.read_checked(e.path, e.crc)
                    if meta.get("key") != e.key:  # a whole file, but another entry's (or another cache's)
                        raise files.CorruptEntry(f"{e.path.name}: holds entry {meta.get('key')!r}")
                except (files.CorruptEntry, OSError) as err:
                    bad = (e, err)
                    break
                parts.append((arrays, meta))
                self.bytes_read += e.nbytes
            if bad is None:
                loaded = self._assemble(plan, parts, n, time.perf_counter() - t0)
                self.loads += 1
                self.hits += 1
                self.hit_tokens += loaded.n
                self.load_seconds += loaded.seconds
                now = time.time()
                for e in plan:
                    e.used = now
                    try:
                        os.utime(e.path, (now, now))
                    except OSError:
                        pass
                return loaded
            e, err = bad
            self._remove(e)
            if not isinstance(err, FileNotFoundError):  # (another server's eviction: just gone)
                print(f"warning: prefix cache: {err}: dropped, recomputed", file=sys.stderr)
                self._drop_file(e.path)
        return None

    def _assemble(self, plan: list[Entry], parts: list, n: int, seconds: float) -> Loaded:
        """Each entry's arrays as MLX arrays (one copy each from the mapped file), the last cut to the n
        positions the plan restores; the checkpoint when the last entry is taken whole."""
        pieces, start, leading = [], 0, True
        for e, (arrays, meta) in zip(plan, parts):
            skel = json.loads(meta["skeletons"])
            bf16 = set(json.loads(meta.get("bf16", "[]")))
            end = min(start + self._count(e), n)
            keep = end - start

            def leaf(name: str, axis: int, upto: int) -> mx.array:
                a = arrays[name]
                a = a[..., :upto, :] if axis == -2 else a[:upto]
                return _restore(np.ascontiguousarray(a), name in bf16)

            layers = [_build(sk, [leaf(f"p{i}.{j}", -2, keep) for j in range(_count_leaves(sk))])
                      for i, sk in enumerate(skel["p"])]
            hidden = leaf("h", 0, keep) if "h" in arrays else None
            drafter, covered = None, 0
            if leading and "d0.0" in arrays and skel.get("d"):
                covered = min(int(meta.get("drafter_n", self._count(e))), keep)
                drafter = [_build(sk, [leaf(f"d{i}.{j}", -2, covered) for j in range(_count_leaves(sk))])
                           for i, sk in enumerate(skel["d"])]
            leading = leading and covered == keep
            pieces.append(Piece(start, end, layers, hidden, drafter, covered))
            start = end
        checkpoint = None
        last, meta = parts[-1]
        if plan[-1].checkpoint and n == sum(self._count(e) for e in plan):
            bf16 = set(json.loads(meta.get("bf16", "[]")))
            cskel = json.loads(meta["skeletons"])["c"]
            checkpoint = [_build(sk, [_restore(np.ascontiguousarray(last[f"c{i}.{j}"]), f"c{i}.{j}" in bf16)
                                      for j in range(_count_leaves(sk))]) for i, sk in enumerate(cskel)]
        return Loaded(n, pieces, checkpoint, seconds)

    # -- writing ---------------------------------------------------------------------------------------
    def offer(self, tree, tokens: list[int]) -> int:
        """Queue the entries of `tokens` (held by the RAM tree `tree`) that are not on disk yet. Engine
        thread; the writing happens on the writer thread. -> entries queued."""
        if self.writable is not None:
            return 0
        keys = chain_keys(self.root_key, tokens, self.block)
        jobs = []
        parent = self.root_key
        for i, k in enumerate(keys):
            if k not in self.blocks and k not in self.pending:
                jobs.append(("b", k, parent, i * self.block, (i + 1) * self.block,
                             list(tokens[i * self.block : (i + 1) * self.block])))
            parent = k
        start = len(keys) * self.block
        if start < len(tokens):
            rest = list(tokens[start:])
            k = tail_key(parent, rest)
            if k not in self.pending and not any(t.key == k for t in self.children.get(parent, [])):
                jobs.append(("t", k, parent, start, len(tokens), rest))
        queued = 0
        for kind, key, parent, s, e, rest in jobs:
            arrays, meta = self._cut(tree, tokens, s, e)
            if arrays is None:
                continue
            if "c0.0" in arrays:
                kind += "c"
            meta.update(key=key, parent=parent, start=str(s), n=str(e - s), format=FORMAT, tokens=json.dumps(rest))
            host.start(*arrays.values())
            self.pending.add(key)
            self.queue.put((kind, key, parent, rest, arrays, meta))
            queued += 1
        return queued

    def _cut(self, tree, tokens: list[int], start: int, end: int):
        """The arrays of an entry for positions start..end of `tokens` (None: the tree no longer holds them)."""
        got = tree.span(tokens, start, end)
        if got is None:
            return None, {}
        layers, hidden, drafter, checkpoint = got
        arrays: dict = {}
        skel = {"p": _flatten(layers, "p", arrays)}
        if hidden is not None:
            arrays["h"] = hidden
        meta = {}
        if drafter is not None:  # the leading positions whose edges had the drafter's states
            skel["d"] = _flatten(drafter, "d", arrays)
            meta["drafter_n"] = str(_positions(drafter))
        if checkpoint is not None:
            skel["c"] = _flatten(checkpoint, "c", arrays)
        bf16 = [name for name, a in arrays.items() if a.dtype == mx.bfloat16]
        for name in bf16:  # numpy has no bfloat16: its bits travel as uint16
            arrays[name] = arrays[name].view(mx.uint16)
        for name, a in arrays.items():  # each made whole on the device now: the writer reads its memory as it is
            arrays[name] = mx.contiguous(a)
        return arrays, {**meta, "skeletons": json.dumps(skel), "bf16": json.dumps(bf16)}

    def _writer(self) -> None:
        try:  # the lowest priority (Linux threads are tasks): on a machine of few cores the decode goes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except OSError as e:
                self._stop_writes(e)
            except Exception as e:  # a bug: this entry is not written, the engine goes on
                print(f"warning: prefix cache: an entry was not written: {type(e).__name__}: {e}", file=sys.stderr)
            finally:
                if job is not None:
                    self.pending.discard(job[1])
                self.queue.task_done()

    def _write(self, kind: str, key: str, parent: str, rest, arrays: dict, meta: dict) -> None:
        if self.writable is not None:
            return
        path, nbytes = files.write_atomic(self.folder, kind, key, arrays, meta)
        self.written += 1
        self.bytes_written += nbytes
        self._add(Entry(kind, key, files.parse_name(path.name)[2], path, nbytes, time.time(), parent, rest))
        self._keep_budget()

    def _keep_budget(self) -> None:
        """Least recently used entries removed until the folder holds at most the budget."""
        entries = sorted(self.entries(), key=lambda e: e.used)
        total = sum(e.nbytes for e in entries)
        for e in entries:
            if total <= self.budget:
                break
            self._remove(e)
            try:
                e.path.unlink()
            except OSError:
                pass
            self.evicted += 1
            total -= e.nbytes

    def _stop_writes(self, e: BaseException) -> None:
        if self.writable is None:
            self.writable = f"{type(e).__name__}: {e}"
            print(f"warning: prefix cache folder {self.folder}: writes failed ({self.writable}); the prefix cache "
                  f"keeps to RAM from now on", file=sys.stderr)

    def flush(self, timeout: float = 120.0) -> None:
        """Wait until every queued entry is written (tests, shutdown), or the writer is gone, or `timeout`."""
        deadline = time.time() + timeout
        while self.queue.unfinished_tasks and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self.queue.put(None)
        self.thread.join(timeout=10)

    def status(self) -> dict:
        entries = self.entries()
        return {"folder": str(self.folder), "entries": len(entries), "bytes": sum(e.nbytes for e in entries),
                "budget_bytes": self.budget, "hits": self.hits, "hit_tokens": self.hit_tokens,
                "load_seconds": round(self.load_seconds, 3), "bytes_read": self.bytes_read,
                "written": self.written, "bytes_written": self.bytes_written, "writes": self.writable or "on",
                "dropped": self.dropped, "evicted": self.evicted}


def _positions(states: list) -> int:
    """Positions a list of per-layer states covers (the token axis -2 of their first leaf)."""
    first = states[0]
    while isinstance(first, (tuple, list)):
        first = first[0]
    return first.shape[-2]


def _count_leaves(skeleton) -> int:
    if isinstance(skeleton, list):
        return sum(_count_leaves(s) for s in skeleton)
    return 1


def _restore(a: np.ndarray, bf16: bool) -> mx.array:
    x = mx.array(a)
    return x.view(mx.bfloat16) if bf16 else x
