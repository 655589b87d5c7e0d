"""The prefix tree's disk tier (issue 52): an agent's prefix prefilled once per machine. A new engine over the
same folder (a restart) restores from disk and its output equals a cold run, greedy and seeded, for every
cache kind (KV, quantized KV, a sliding window, MLA, a hybrid's recurrent checkpoints, a CacheList) and every
drafter kind whose state rides along (mtp, eagle3, dflash, a draft model, suffix+mtp): neither the target nor
the drafter is fed what was restored (counted). A weights change misses; a corrupted, truncated or foreign
file is dropped and recomputed; a crash between write and rename leaves nothing readable; the budget holds;
a folder that refuses writes serves from RAM; the files are the user's alone; a block's key covers its
parent's."""

from __future__ import annotations

import errno
import os
import stat

import numpy as np
import pytest

import tiny_models
from mlx_engine.core.batch_engine import BatchEngine
from mlx_engine.sampling import SamplingConfig
from mlx_engine.target_model import disk_files
from mlx_engine.target_model.disk_tier import BLOCK
from test_agent_prefill import FeedCounter, built, drain, engine_for, prompts  # noqa: F401 (fixture)
from test_batch_agent_models import drafter as kind_drafter, fed_counter, target as kind_target

CACHE_KINDS = ["llama", "qwen3_next", "gpt_oss", "deepseek_v3", "longcat_flash"]


def prompt_of(n: int, seed: int = 0, vocab: int = tiny_models.VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, n).tolist()


def served(engine, sid, prompt, n=10, **kw):
    out = {}
    engine.add(sid, prompt, n, **kw)
    stats = {}
    while engine.running():
        for o in engine.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
            if o.finished:
                stats[o.seq_id] = o.stats
    return out[sid], stats[sid]


def disk_engine(model, drafter, folder, **kw):
    return BatchEngine(model, drafter, num_draft=2, max_batch=4, prefix_cache_dir=str(folder), **kw)


def flush(engine):
    engine.prefix_cache.disk.flush()


@pytest.mark.cpu_exact
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", CACHE_KINDS)
def test_a_restart_restores_from_disk_and_equals_a_cold_run(family, sampled, tmp_path):
    model = kind_target(family)
    kw = {"sampling": SamplingConfig(temperature=0.9), "seed": 3} if sampled else {}
    first = prompt_of(600)  # two whole blocks and a tail
    before = disk_engine(model, kind_drafter(family), tmp_path)
    answer, _ = served(before, "a", first, **kw)
    flush(before)
    assert before.prefix_cache.disk.status()["entries"] >= 3
    nxt = first + answer + [5, 6, 7]
    after = disk_engine(model, kind_drafter(family), tmp_path)  # a restart: a new engine, an empty RAM tree
    fed = fed_counter(after)
    got, stats = served(after, "b", nxt, **kw)
    cold, _ = served(BatchEngine(model, kind_drafter(family), num_draft=2, prefix_cache_bytes=0), "b", nxt, **kw)
    assert got == cold
    disk = after.prefix_cache.disk.status()
    assert disk["hits"] == 1 and stats["reused_prompt_tokens"] == disk["hit_tokens"]
    assert stats["reused_prompt_tokens"] >= len(first) + len(answer) - 1  # the whole last turn
    assert fed["b"] == len(nxt) - stats["reused_prompt_tokens"]


@pytest.mark.parametrize("kind", ["mtp", "eagle3", "dflash", "draft", "suffix+mtp"])
def test_a_restart_refeeds_neither_the_target_nor_the_drafter(built, kind, monkeypatch, tmp_path):  # noqa: F811
    """The drafter's state rides in the disk entries: after a restart the next turn feeds the drafter only its
    new positions (counted), and the output is plain greedy's."""
    from test_batch_prefill import alone, assert_greedy_equal

    model, drafter, vocab = built(kind)
    turn1 = prompts(vocab)[0][:280]
    before = engine_for(model, drafter, prefix_cache_dir=str(tmp_path))
    out = {}
    before.add("t1", turn1, 16)
    drain(before, out)
    flush(before)
    turn2 = turn1 + out["t1"] + [7, 8, 9]
    _, fresh, _ = built(kind)
    after = engine_for(model, fresh, prefix_cache_dir=str(tmp_path))
    counter = FeedCounter(monkeypatch)
    after.add("t2", turn2, 16)
    for _ in range(100):  # until its drafter drafts
        for o in after.step():
            out.setdefault(o.seq_id, []).extend(o.tokens)
        s = next((s for s in after.seqs if s.id == "t2"), None)
        if s is not None and after._ready_to_draft(s):
            break
    assert counter.n <= len(turn2) - len(turn1) + 2, f"the drafter was fed {counter.n} positions"
    drain(after, out)
    assert s.reused >= len(turn1) + len(out["t1"]) - 1
    assert after.prefix_cache.disk.status()["hits"] == 1
    assert_greedy_equal(model, turn2, out["t2"], alone(model, turn2, 16))


def test_a_weights_change_misses(tmp_path):
    first = prompt_of(300)
    before = disk_engine(kind_target("llama"), None, tmp_path)
    served(before, "a", first)
    flush(before)
    other = tiny_models.build("llama", seed=1)[0]  # the same architecture and name, other weights
    other.update({"lm_head": {"weight": other.lm_head.weight * 1.001}})
    after = disk_engine(other, None, tmp_path)
    assert after.prefix_cache.disk.folder != before.prefix_cache.disk.folder
    _, stats = served(after, "b", first + [1, 2, 3])
    assert stats["reused_prompt_tokens"] == 0 and after.prefix_cache.disk.status()["hits"] == 0


def _files(engine):
    return sorted(p for p in engine.prefix_cache.disk.folder.iterdir() if disk_files.parse_name(p.name))


@pytest.mark.cpu_exact
@pytest.mark.parametrize("damage", ["flipped", "truncated", "foreign"])
def test_a_damaged_file_is_dropped_and_recomputed(damage, tmp_path):
    model = kind_target("llama")
    first = prompt_of(700)
    before = disk_engine(model, None, tmp_path)
    served(before, "a", first)
    flush(before)
    blocks = sorted((p for p in _files(before) if p.name.startswith("b-")),
                    key=lambda p: int(disk_files.read_header(p)["start"]))  # in token order
    victim = blocks[1]
    data = bytearray(victim.read_bytes())
    if damage == "flipped":  # one byte of a tensor, not of the header: silently wrong entries if served
        data[-100] ^= 0x40
        victim.write_bytes(bytes(data))
    elif damage == "truncated":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:  # another entry's file under this one's name (its CRC its own: it reads whole, yet is not this)
        kind, key, _ = disk_files.parse_name(victim.name)
        other = blocks[0]
        victim.unlink()
        copy = victim.with_name(disk_files.entry_name(kind, key, disk_files.parse_name(other.name)[2]))
        copy.write_bytes(other.read_bytes())
    nxt = first + [9, 9, 9]
    after = disk_engine(model, None, tmp_path)
    got, stats = served(after, "b", nxt)
    cold, _ = served(BatchEngine(model, None, prefix_cache_bytes=0), "b", nxt)
    assert got == cold
    assert after.prefix_cache.disk.status()["dropped"] == 1
    assert stats["reused_prompt_tokens"] == BLOCK  # the block before the bad one only


def test_a_crash_between_write_and_rename_leaves_nothing_readable(tmp_path, monkeypatch):
    model = kind_target("llama")
    engine = disk_engine(model, None, tmp_path)
    folder = engine.prefix_cache.disk.folder

    def crash(src, dst):  # the process dies after writing, before renaming (its temporary file: see below)
        raise RuntimeError("killed")

    monkeypatch.setattr(disk_files.os, "replace", crash)
    served(engine, "a", prompt_of(300))
    flush(engine)
    monkeypatch.undo()
    (folder / (disk_files.TMP_PREFIX + "left-by-a-kill")).write_bytes(b"\0" * 1000)  # a kill -9's leftover
    after = disk_engine(model, None, tmp_path)
    assert after.prefix_cache.disk.status()["entries"] == 0
    _, stats = served(after, "b", prompt_of(300) + [1])
    assert stats["reused_prompt_tokens"] == 0


def test_the_budget_holds_least_recently_used_first(tmp_path):
    model = kind_target("llama")
    probe = disk_engine(model, None, tmp_path / "probe")
    served(probe, "a", prompt_of(BLOCK))
    flush(probe)
    one = probe.prefix_cache.disk.status()["bytes"]
    engine = disk_engine(model, None, tmp_path, prefix_disk_bytes=int(3.5 * one))
    for i in range(6):
        served(engine, i, prompt_of(BLOCK + 1, seed=10 + i))
        flush(engine)
        assert engine.prefix_cache.disk.status()["bytes"] <= int(3.5 * one)
    assert engine.prefix_cache.disk.status()["evicted"] >= 3
    after = disk_engine(model, None, tmp_path, prefix_disk_bytes=int(3.5 * one))
    _, newest = served(after, "n", prompt_of(BLOCK + 1, seed=15)[:BLOCK] + [3, 3])
    _, oldest = served(after, "o", prompt_of(BLOCK + 1, seed=10)[:BLOCK] + [3, 3])
    assert newest["reused_prompt_tokens"] == BLOCK and oldest["reused_prompt_tokens"] == 0
    flush(after)


def test_a_folder_that_refuses_writes_serves_from_ram(tmp_path, monkeypatch, capsys):
    model = kind_target("llama")

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_files, "write_atomic", full)
    engine = disk_engine(model, None, tmp_path)
    first = prompt_of(300)
    served(engine, "a", first)
    flush(engine)
    got, stats = served(engine, "b", first + [4, 4])
    assert stats["reused_prompt_tokens"] >= 299  # from RAM
    status = engine.prefix_cache.disk.status()
    assert status["writes"].startswith("OSError") and status["entries"] == 0
    err = capsys.readouterr().err
    assert err.count(f"{engine.prefix_cache.disk.folder}: writes failed") == 1  # one warning, not one a request


def test_the_files_are_the_user_s_alone(tmp_path):
    engine = disk_engine(kind_target("llama"), None, tmp_path / "cache")
    served(engine, "a", prompt_of(300))
    flush(engine)
    folder = engine.prefix_cache.disk.folder
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in _files(engine))


@pytest.mark.cpu_exact
def test_a_block_s_key_covers_its_parent_s(tmp_path):
    """Two prompts whose second blocks are equal after different first blocks: a third prompt with the first's
    first block and the second's second block restores one block, not two (the second block's entries were
    computed after another first block)."""
    model = kind_target("llama")
    p, q, x, y = (prompt_of(BLOCK, seed=s) for s in (1, 2, 3, 4))
    engine = disk_engine(model, None, tmp_path)
    served(engine, "a", y + q + [1])  # q after y
    served(engine, "c", p + x + [1])  # p's block on disk
    flush(engine)
    after = disk_engine(model, None, tmp_path)
    got, stats = served(after, "b", p + q + [2, 2])
    assert stats["reused_prompt_tokens"] == BLOCK
    cold, _ = served(BatchEngine(model, None, prefix_cache_bytes=0), "b", p + q + [2, 2])
    assert got == cold


def test_two_engines_writing_one_folder_never_corrupt_it(tmp_path):
    model = kind_target("llama")
    first = prompt_of(700)
    a, b = disk_engine(model, None, tmp_path), disk_engine(model, None, tmp_path)
    for engine in (a, b):  # both store the same entries: the same keys, the same bytes
        engine.add("x", first, 6)
    while a.running() or b.running():
        a.step()
        b.step()
    flush(a)
    flush(b)
    after = disk_engine(model, None, tmp_path)
    got, stats = served(after, "y", first + [5])
    assert after.prefix_cache.disk.status()["dropped"] == 0 and stats["reused_prompt_tokens"] == len(first)


@pytest.mark.cpu_exact
def test_a_quantized_kv_cache_restores_from_disk(tmp_path):
    """kv_bits: the entries on disk are the quantized codes, scales and biases, restored as they were."""
    model = kind_target("qwen3", head_dim=32)
    kv = dict(kv_bits=8, kv_group_size=32)
    first = prompt_of(400)
    before = disk_engine(model, None, tmp_path, **kv)
    answer, _ = served(before, "a", first)
    flush(before)
    nxt = first + answer + [2]
    after = disk_engine(model, None, tmp_path, **kv)
    got, stats = served(after, "b", nxt)
    cold, _ = served(BatchEngine(model, None, num_draft=2, prefix_cache_bytes=0, **kv), "b", nxt)
    assert got == cold and stats["reused_prompt_tokens"] == len(first) + len(answer) - 1


def test_generate_with_a_prefix_cache_dir_starts_the_next_run_from_disk(tmp_path, capsys):
    """`generate --prefix-cache-dir DIR` (opt-in for a one-shot command): the next process with the same long
    prompt restores it (reused tokens in --json's stats) and prints the same tokens."""
    import json

    from mlx_engine.__main__ import main
    from model_dirs import save_tiny

    folder = save_tiny(tmp_path / "llama", "llama", seed=2)
    ids = ",".join(str(t) for t in prompt_of(300, vocab=300))
    argv = ["generate", "--model", str(folder), "--prompt-tokens", ids, "--max-tokens", "6", "--json",
            "--prefix-cache-dir", str(tmp_path / "cache")]
    runs = []
    for _ in range(2):
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0]["tokens"] == runs[1]["tokens"]
    assert runs[0]["stats"]["reused_tokens"] == 0 and runs[1]["stats"]["reused_tokens"] == 299
