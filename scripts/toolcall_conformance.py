"""canitoolcall's fixtures through the server's own path (tests/toolcall_replay.py), tallied per family as the
suite's matrix tallies an engine: pass / soft pass / fail / unsupported. Writes bench/results/toolcall-conformance.json
with the published engines' figures beside ours (canitoolcall's README, 2026-09-25 snapshot).

    python scripts/toolcall_conformance.py [--only FAMILY_OR_PROFILE ...] [--failures FILE] [--out JSON]
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import subprocess
import sys
import time
import traceback
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

PUBLISHED = {  # engine: (pass, soft pass, fail, fixtures supported) of canitoolcall's 469
    "vLLM 0.30.0": (268, 86, 115, 469), "SGLang 0.5.20": (189, 62, 197, 448),
    "llama.cpp a25c9865": (278, 46, 114, 438), "Ollama 7af39318": (224, 10, 27, 261),
    "HF transformers 5.17.0": (33, 7, 8, 48),
}


def main() -> None:
    import canitoolcall
    from canitoolcall.fixtures import load_fixtures

    import toolcall_replay as replay

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=[], help="families (qwen3-xml) or profiles (kimi-k3) to run")
    ap.add_argument("--failures", default=None, help="write each failing case's description here")
    ap.add_argument("--out", default=None, help="the results JSON (default: none when --only is given)")
    args = ap.parse_args()
    out = args.out or (None if args.only else str(ROOT / "bench/results/toolcall-conformance.json"))
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures, started = [], time.perf_counter()
    for f in load_fixtures():
        profile = replay.profile_name(f)
        if args.only and f.family not in args.only and profile not in args.only:
            continue
        try:
            obs = replay.observe(f)
            status, bad = replay.verdict(f, obs)
            table[f.family][status.value] += 1
            if status.value not in ("pass", "soft_pass"):
                failures.append(replay.describe(f, obs, bad))
        except Exception:
            table[f.family]["error"] += 1
            failures.append(f"{f.id}: harness error\n{traceback.format_exc()[-1500:]}")
    total = collections.Counter()
    for fam in sorted(table):
        total.update(table[fam])
        print(f"{fam:14} " + "  ".join(f"{k}={table[fam][k]}" for k in ("pass", "soft_pass", "fail", "error")))
    print(f"{'total':14} " + "  ".join(f"{k}={total[k]}" for k in ("pass", "soft_pass", "fail", "error"))
          + f"  ({time.perf_counter() - started:.1f} s)")
    if args.failures:
        Path(args.failures).write_text("\n\n".join(failures))
    if out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=ROOT).stdout.strip()
        Path(out).write_text(json.dumps({
            "what": "canitoolcall fixtures through serve.jobs.Output, non-streamed and every default grouping",
            "command": "python scripts/toolcall_conformance.py", "commit": commit, "date": date.today().isoformat(),
            "machine": f"{platform.system()} {platform.machine()}", "canitoolcall": canitoolcall.__version__,
            "families": {fam: dict(table[fam]) for fam in sorted(table)}, "total": dict(total),
            "unsupported": 0, "published": {k: dict(zip(("pass", "soft_pass", "fail", "supported"), v))
                                            for k, v in PUBLISHED.items()},
        }, indent=1) + "\n")


if __name__ == "__main__":
    main()
