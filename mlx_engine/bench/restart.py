"""`python -m mlx_engine.bench.restart`: an agent's session across a server restart, with the prefix cache's disk
tier (target_model/disk_tier.py), per drafter.

Per drafter mode, in a fresh cache folder, each step through a BatchEngine (what `serve` runs):

  cold      the agent session (bench/agent_session.py, --length tokens) fed cold: its time to first token;
            its entries then written to disk (the writer's seconds, behind the engine thread)
  restart   a new engine over the same folder (an empty RAM tree: a server restarted) and the same prompt:
            its TTFT (the disk load included), the tokens restored, the answer compared with the cold one
  session2  a third engine (restarted again): a second session of the same agent (its system prompt, task
            and first file read, then another request): its TTFT and the tokens restored (the shared prefix)

Before the restart the entry files are dropped from the page cache (posix_fadvise), so its load reads the disk
as after a reboot. Then the disk: the loads' throughput (bytes read / load seconds) beside `dd`'s sequential
read of a 1 GiB file in the same folder (iflag=direct, and through the page cache), and a decoding stream's
step time while another request's entries are written, against the same steps with no disk tier.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..args import ArgumentParser, count, fail, interrupted
from ..drafters.registry import DrafterError, DrafterOptions, make_drafter
from ..models import ModelLoadError
from .agent_session import python_version, session
from .longctx import encode, load_for_modes
from .report import BenchInputError

SECOND_TASK = "Review the files read so far and list three functions that lack tests, with one line each on why."


def ttft(engine, sid, prompt: list[int], max_tokens: int) -> dict:
    """Feed `prompt` and decode to its end: {ttft_s, answer, reused}."""
    t0, first, answer, stats = time.perf_counter(), None, [], {}
    engine.add(sid, prompt, max_tokens)
    while engine.running():
        for o in engine.step():
            if o.seq_id != sid:
                continue
            if o.tokens and first is None:
                first = time.perf_counter() - t0
            answer += o.tokens
            if o.finished:
                stats = o.stats
    return {"prompt_tokens": len(prompt), "ttft_s": round(first, 3), "reused": stats.get("reused_prompt_tokens", 0),
            "answer": answer}


def engine_for(loaded, drafter, folder: Path | None, args):
    from ..core.batch_engine import BatchEngine

    kw = dict(prefix_cache_dir=str(folder), prefix_disk_bytes=args.disk_gb << 30) if folder is not None else {}
    return BatchEngine(loaded.model, drafter, prefix_cache_bytes=4 << 30, **kw)


def flush_seconds(engine) -> float:
    t = time.perf_counter()
    engine.prefix_cache.disk.flush(timeout=600)
    return round(time.perf_counter() - t, 3)


def dd_read(folder: Path, gib: int = 1) -> dict:
    """This disk's sequential read speed, GB/s: `dd` writes a file of `gib` GiB in `folder`, then reads it back
    past the page cache (iflag=direct: the disk itself) and through it."""
    path = folder / "dd-probe"
    subprocess.run(["dd", "if=/dev/urandom", f"of={path}", "bs=4M", f"count={256 * gib}", "conv=fsync"],
                   check=True, capture_output=True)
    out = {}
    try:
        for name, flags in (("direct", ["iflag=direct"]), ("page_cache", [])):
            t = time.perf_counter()
            subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M", *flags], check=True, capture_output=True)
            out[name] = round(gib * 2**30 / (time.perf_counter() - t) / 1e9, 3)
    finally:
        path.unlink(missing_ok=True)
    return out


def evict_from_page_cache(folder: Path) -> None:
    """The entry files dropped from the page cache (posix_fadvise DONTNEED on fsynced files): the next load
    reads them from the disk, as after a reboot."""
    for p in folder.rglob("*.safetensors"):
        with open(p, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def run_mode(loaded, mode: str, first: list[int], second: list[int], args, root: Path) -> dict:
    folder = root / mode.replace("+", "_")
    drafter = None if mode == "none" else make_drafter(mode, loaded, DrafterOptions())
    a = engine_for(loaded, drafter, folder, args)
    cold = ttft(a, "cold", first, args.max_tokens)
    cold["write_s"] = flush_seconds(a)
    disk_a = a.prefix_cache.disk.status()
    del a
    evict_from_page_cache(folder)  # a restart after a reboot: the entries come from the disk
    b = engine_for(loaded, drafter, folder, args)  # the restart
    again = ttft(b, "restart", first, args.max_tokens)
    disk_b = b.prefix_cache.disk.status()
    again["equal_to_cold"] = again.pop("answer") == cold.pop("answer")
    again["over_cold"] = round(again["ttft_s"] / cold["ttft_s"], 4)
    again["load_s"] = disk_b["load_seconds"]
    again["load_gb_s"] = round(disk_b["bytes_read"] / max(disk_b["load_seconds"], 1e-9) / 1e9, 3)
    flush_seconds(b)
    del b
    c = engine_for(loaded, drafter, folder, args)  # restarted again: another session of the same agent
    s2 = ttft(c, "session2", second, args.max_tokens)
    s2.pop("answer")
    flush_seconds(c)
    return {"mode": mode, "cold": cold, "restart": again, "session2": s2,
            "disk": {"entries": disk_a["entries"], "bytes": disk_a["bytes"], "bytes_read": disk_b["bytes_read"]},
            "dd_read_gb_s": dd_read(folder)}


def step_times_while_writing(loaded, args, root: Path) -> dict:
    """A stream's median step while a long request's entries are written, with and without the disk tier."""
    out = {}
    stream = encode(loaded.tokenizer, [{"role": "user", "content": "Write a long story about a lighthouse."}])
    long = encode(loaded.tokenizer, session(lambda m: len(encode(loaded.tokenizer, m)), args.write_length)["messages"])
    for name, folder in (("without", None), ("with", root / "writes")):
        engine = engine_for(loaded, None, folder, args)
        engine.add("stream", stream, 100000)
        engine.add("long", long, 2)
        while any(s.id == "long" for s in engine.seqs) or engine.prefills.queued:  # the long one in and out
            engine.step()
        times = []
        for _ in range(args.write_steps):  # the steps right after it left (its entries being written)
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        pending = engine.prefix_cache.disk.queue.unfinished_tasks if folder is not None else 0
        out[name] = {"median_step_s": round(statistics.median(times), 4), "writes_pending_after": pending}
        engine.cancel("stream")
        engine.step()
        if folder is not None:
            flush_seconds(engine)
    out["ratio"] = round(out["with"]["median_step_s"] / out["without"]["median_step_s"], 3)
    return out


def main(argv=None) -> int:
    p = ArgumentParser(prog="python -m mlx_engine.bench.restart", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: the embedded SmolLM2-135M-Instruct with its MTP head)")
    p.add_argument("--modes", default="none,mtp,suffix+mtp", help="drafters, comma-separated (none: plain)")
    p.add_argument("--length", type=count(256), default=8192, help="the agent session's prompt tokens (default 8192)")
    p.add_argument("--max-tokens", type=count(1), default=32, help="tokens decoded per turn (default 32)")
    p.add_argument("--disk-gb", type=count(1), default=16, help="the disk tier's budget in GiB (default 16)")
    p.add_argument("--write-length", type=count(256), default=2048, help="the write-stall part's long prompt")
    p.add_argument("--write-steps", type=count(4), default=24, help="stream steps timed while it is written")
    p.add_argument("--dir", help="cache folder (default: a temporary one, removed after)")
    p.add_argument("--out", help="write the results here as JSON")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        loaded = load_for_modes(args.model, modes, args.out)
    except (BenchInputError, ModelLoadError, DrafterError, ValueError) as e:
        return fail(str(e))
    tok = loaded.tokenizer
    count_tokens = lambda msgs: len(encode(tok, msgs))  # noqa: E731
    messages = session(count_tokens, args.length)["messages"]
    first = encode(tok, messages)
    # the same agent's next session: its system prompt, task and first file read (an agent's system prompt and
    # tool definitions), then another request
    second = encode(tok, messages[:5] + [{"role": "user", "content": SECOND_TASK}])
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mlx-engine-restart-"))
    results = {"model": str(loaded.path), "python_version": python_version(), "length": len(first),
               "second_length": len(second), "runs": []}
    try:
        for mode in modes:
            r = run_mode(loaded, mode, first, second, args, root)
            results["runs"].append(r)
            print(f"{mode:<11} cold TTFT {r['cold']['ttft_s']}s (written in {r['cold']['write_s']}s, "
                  f"{r['disk']['bytes'] / 2**20:.0f} MiB) | restart TTFT {r['restart']['ttft_s']}s "
                  f"({r['restart']['over_cold']}x cold, {r['restart']['reused']} tokens restored, equal "
                  f"{r['restart']['equal_to_cold']}, load {r['restart']['load_gb_s']} GB/s vs dd {r['dd_read_gb_s']}) "
                  f"| session 2 TTFT {r['session2']['ttft_s']}s ({r['session2']['reused']} of "
                  f"{r['session2']['prompt_tokens']} restored)", flush=True)
            save(results, args.out)
        results["writes"] = step_times_while_writing(loaded, args, root)
        print(f"stream step while entries are written: {results['writes']}", flush=True)
        save(results, args.out)
    except KeyboardInterrupt:
        return interrupted()
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def save(results: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
