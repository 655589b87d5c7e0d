"""canitoolcall's live probe against `serve` on the embedded model, every scenario, written to
bench/results/toolcall-probe-cpu.json (which scenarios the server decides and which are the small model's choice:
tests/test_serve_probe.py asserts the first kind).

    python scripts/toolcall_probe.py [--out JSON] [serve flags...]
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    from canitoolcall.probe import probe

    from serve_util import RunningServer

    args = sys.argv[1:]
    out = ROOT / "bench/results/toolcall-probe-cpu.json"
    if args[:1] == ["--out"]:
        out, args = Path(args[1]), args[2:]
    server = RunningServer("--max-tokens", "96", *args)
    try:
        report = probe(server.base + "/v1", server.model, timeout_s=600, concurrency=1)
    finally:
        server.close()
    rows = [o.to_dict() for o in report.outcomes]
    for r in rows:
        print(f"{r['scenario_id']:22} {r['check']:24} stream={r['stream']!s:5} {r['status']:5} {r['detail'] or ''}"[:160])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out.write_text(json.dumps({"what": "canitoolcall probe against serve, the embedded model, temperature 0",
                               "command": "python scripts/toolcall_probe.py " + " ".join(args), "commit": commit.strip(),
                               "date": date.today().isoformat(), "machine": f"{platform.system()} {platform.machine()}",
                               "model": server.model, "outcomes": rows}, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
