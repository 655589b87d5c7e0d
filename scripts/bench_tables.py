"""The measured tables of README.md and docs/, written from bench/results/*.json, never typed by hand.

A page marks each table it shows:

    <!-- bench: KIND FILE [FILE ...] -->
    (generated: the table, then where it came from: machine, commit, date, command)
    <!-- /bench -->

    .venv/bin/python scripts/bench_tables.py            # rewrite every marked block from its JSON
    .venv/bin/python scripts/bench_tables.py --check    # exit 1 and name each block that differs (the test runs it)

KIND is one of the renderers below (modes, structured, best, serve-load, agent-server, restart, toolcalls); FILE is a
name in bench/results/. The commit is the one that added the JSON (git log), unless the JSON names its own;
the date is the JSON's, else the commit's. Figures are printed as the bench prints them (two decimals).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAGES = ("README.md", "docs")
BLOCK = re.compile(r"(<!-- bench: ([^>]*?) -->\n)(.*?)(<!-- /bench -->)", re.S)
UNKNOWN = "not recorded"


def load(name: str):
    return json.loads((RESULTS / name).read_text())


@lru_cache(maxsize=None)
def git_added(name: str) -> tuple[str, str] | None:
    """(short commit, date) of the commit that added bench/results/NAME, or None without git history."""
    try:
        out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h %ad", "--date=short", "-1", "--",
                              f"bench/results/{name}"], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    parts = out.stdout.split()
    return (parts[0], parts[1]) if out.returncode == 0 and len(parts) == 2 else None


def machine_text(m: dict | None, d: dict | None = None) -> str:
    if isinstance(m, str):  # a bench that writes the machine as one line
        return m
    if not m:
        versions = ", ".join(f"{k} {d[k]}" for k in ("mlx", "python_version") if d and d.get(k))
        return f"{UNKNOWN} in the JSON" + (f" ({versions})" if versions else "")
    bits = [f"{m.get('cpu_count', '?')}-core {m.get('processor', '?')}", str(m.get("device", "?")),
            f"mlx {m.get('mlx', '?')}", f"mlx-lm {m.get('mlx-lm', '?')}"]
    if m.get("openblas"):
        bits.append("OpenBLAS")
    return ", ".join(bits)


def provenance(name: str, data) -> dict:
    """machine, commit, date and command of one results file."""
    d = data if isinstance(data, dict) else (data[0] if data and isinstance(data[0], dict) else {})
    added = git_added(name)
    commit = d.get("commit") or (added[0] if added else "unknown")
    date = d.get("date") or d.get("started_utc") or (f"{added[1]} (committed)" if added else UNKNOWN)
    if not d.get("date") and d.get("started_utc"):
        date = d["started_utc"].replace("T", " ").rstrip("Z") + " UTC"
    return {"file": f"bench/results/{name}", "machine": machine_text(d.get("machine"), d), "commit": commit,
            "date": date, "command": d.get("command")}


def source_lines(name: str, data) -> list[str]:
    p = provenance(name, data)
    lines = ["", f"Source `{p['file']}`: machine {p['machine']}; commit {p['commit']}; date {p['date']}; command:"
             if p["command"] else
             f"Source `{p['file']}`: machine {p['machine']}; commit {p['commit']}; date {p['date']}; "
             f"command {UNKNOWN} in the JSON."]
    if p["command"]:
        lines += ["", "```sh", p["command"], "```"]
    return lines


def f2(x, suffix="") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def render_modes(names: list[str]) -> list[str]:
    """The bench's own table: every mode and temperature of one run, speedups paired against engine plain."""
    (name,) = names
    d = load(name)
    rows = [[r["mode"], f"{r['temp']:g}", f2(r["tok_s"]), f2(r.get("speedup_vs_engine_plain"), "x"),
             f2(r.get("E")), f2(r.get("acceptance"))] for r in d["results"]]
    return table(["mode", "T", "tok/s", "x engine plain (paired)", "tokens / verify", "acceptance"], rows) \
        + source_lines(name, d)


def valid_text(r: dict, prompts: int) -> str:
    v = r.get("valid")
    return "-" if v is None else f"{round(v * prompts)}/{prompts}"


def render_structured(names: list[str]) -> list[str]:
    """A json / tools suite run: constrained modes against plain constrained decoding."""
    (name,) = names
    d = load(name)
    n = d.get("prompts", 0)
    rows = [[r["mode"], f"{r['temp']:g}", f2(r["tok_s"]), f2(r.get("speedup_vs_plain_constrained"), "x"),
             f2(r.get("E")), f2(r.get("forced_share")), valid_text(r, n)] for r in d["results"]]
    return table(["mode", "T", "tok/s", "x plain constrained (paired)", "tokens / verify", "forced share",
                  "valid"], rows) + source_lines(name, d)


# The front door's table: the fastest drafter measured on each suite, at temperature 0 (file, mode, baseline).
BEST = [
    ("agent (coding-agent edits, 8 prompts)", "smollm2-agent-suffix-trees-cpu.json", "engine ngram auto", "plain"),
    ("edit (rewrite a snippet, 8 prompts)", "smollm2-edit-suffix-trees-cpu-v3.json", "engine suffix+mtp auto",
     "plain"),
    ("chat (held-out questions, 8 prompts)", "smollm2-chat-chains-cpu-v3-3trials.json", "engine ngram+mtp auto",
     "plain"),
    ("json (schema extraction, 8 prompts)", "structured-json-cpu-whole-run-2.json", "engine grammar",
     "plain constrained"),
    ("tools (a forced tool call, 8 prompts)", "structured-tools-cpu-whole-run.json", "engine grammar+mtp",
     "plain constrained"),
]


def find(d: dict, mode: str, temp: float = 0.0) -> dict:
    for r in d["results"]:
        if r["mode"] == mode and r["temp"] == temp:
            return r
    raise KeyError(f"{mode} at T={temp}")


def render_best(names: list[str]) -> list[str]:
    rows, sources = [], []
    for suite, name, mode, base in BEST:
        d = load(name)
        r = find(d, mode)
        b = find(d, "engine plain constrained" if base == "plain constrained" else "engine plain")
        key = "speedup_vs_plain_constrained" if base == "plain constrained" else "speedup_vs_engine_plain"
        rows.append([suite, f"`{mode.removeprefix('engine ')}`", f2(r["tok_s"]), f2(b["tok_s"]),
                     f"**{f2(r[key], 'x')}**", f"`{name}`"])
        p = provenance(name, d)
        sources.append(f"- `{name}`: {p['machine']}; commit {p['commit']}; {p['date']}; "
                       f"`{p['command']}`")
    return table(["suite", "drafter", "tok/s", "plain tok/s", "speedup (paired)", "results"], rows) \
        + ["", "Each at temperature 0, greedy, lossless (the same tokens as plain decoding); speedup is the "
               "bench's median of per-trial ratios against plain decoding through the engine (json and tools: "
               "against plain constrained decoding). Where each came from:", ""] + sources


def render_serve_load(names: list[str]) -> list[str]:
    """serve.load / agent-model loads: aggregate tok/s per client count and setting."""
    (name,) = names
    d = load(name)
    runs = sorted({r.get("run", 1) for r in d})
    settings = [s for s in ("off", "on", "mlx-lm") if any(r["speculation"] == s for r in d)]
    head = (["run"] if len(runs) > 1 else []) + ["clients"] + [f"tok/s {s}" for s in settings]
    head += ["on / off"] + (["on / mlx-lm"] if "mlx-lm" in settings else []) + ["acceptance", "tokens / verify",
                                                                                 "errors"]
    rows = []
    for run in runs:
        for c in sorted({r["clients"] for r in d if r.get("run", 1) == run}):
            cell = {r["speculation"]: r for r in d if r.get("run", 1) == run and r["clients"] == c}
            tps = {s: cell[s]["aggregate_tps"] for s in settings if s in cell}
            row = ([str(run)] if len(runs) > 1 else []) + [str(c)] + [f2(tps.get(s)) for s in settings]
            row.append(f2(tps["on"] / tps["off"], "x") if "on" in tps and "off" in tps else "-")
            if "mlx-lm" in settings:
                row.append(f2(tps["on"] / tps["mlx-lm"], "x") if "on" in tps and "mlx-lm" in tps else "-")
            on = cell.get("on", {})
            row += [f2(on.get("acceptance")), f2(on.get("tokens_per_verify")),
                    str(sum(r["errors"] for r in cell.values()))]
            rows.append(row)
    return table(head, rows) + source_lines(name, d)


def render_agent_server(names: list[str]) -> list[str]:
    """longctx --agent-server: short requests' time to first token while an agent's prompt is fed."""
    rows, srcs = [], []
    for name in names:
        d = load(name)
        for r in d["runs"]:
            c, n = r["cold"], r["next"]
            idle = r["idle_short_ttft_s"]
            rows.append([f"`{name}`", r["mode"], f"{idle:.2f} s", str(c["shorts"]),
                         f"{c['short_ttft_median_s']:.2f} s ({c['short_ttft_median_s'] / idle:.1f}x)",
                         f"{c['short_ttft_max_s']:.2f} s ({c['short_ttft_max_over_idle']:.1f}x)",
                         f"{c['ttft_s']:.1f} s", f"{n['ttft_s']:.2f} s"])
        srcs += source_lines(name, d)
    return table(["results", "drafter", "short TTFT idle", "shorts", "short TTFT while fed: median (x idle)",
                  "max (x idle)", "session TTFT", "next turn TTFT"], rows) + srcs


def render_restart(names: list[str]) -> list[str]:
    """bench.restart: an agent session's prompt after a restart, from the disk tier."""
    (name,) = names
    d = load(name)
    rows = [[r["mode"], str(r["cold"]["prompt_tokens"]), f"{r['cold']['ttft_s']:.1f} s",
             f"{r['restart']['ttft_s']:.2f} s", str(r["restart"]["reused"]), str(r["restart"]["equal_to_cold"]),
             f"{r['restart']['load_gb_s']:.2f} GB/s"] for r in d["runs"]]
    return table(["drafter", "prompt tokens", "cold TTFT", "TTFT after a restart", "tokens reused",
                  "same tokens as cold", "disk read"], rows) + source_lines(name, d)


def render_toolcalls(names: list[str]) -> list[str]:
    """canitoolcall's fixtures through the server's path: pass / soft / fail per family, the published engines'."""
    (name,) = names
    d = load(name)
    cells = lambda c: [str(c.get(k, 0)) for k in ("pass", "soft_pass", "fail")]  # noqa: E731
    rows = [[fam, *cells(c), "0"] for fam, c in d["families"].items()]
    rows.append(["**total (mlx-engine)**", *cells(d["total"]), str(d.get("unsupported", 0))])
    rows += [[f"{engine} (published)", str(p["pass"]), str(p["soft_pass"]), str(p["fail"]), str(469 - p["supported"])]
             for engine, p in d["published"].items()]
    return table(["family", "pass", "soft pass", "fail", "unsupported"], rows) + source_lines(name, d)


RENDER = {"modes": render_modes, "structured": render_structured, "best": render_best,
          "serve-load": render_serve_load, "agent-server": render_agent_server, "restart": render_restart,
          "toolcalls": render_toolcalls}


def render(spec: str) -> str:
    kind, *names = spec.split()
    if kind not in RENDER:
        raise ValueError(f"unknown table kind {kind!r} (one of {', '.join(RENDER)})")
    return "\n".join(RENDER[kind](names)) + "\n"


def pages(root: Path = REPO) -> list[Path]:
    out = [root / "README.md"]
    out += sorted((root / "docs").rglob("*.md"))
    return [p for p in out if p.exists()]


def blocks(text: str):
    """(spec, body as written) for every marked block of a page."""
    return [(m.group(2).strip(), m.group(3)) for m in BLOCK.finditer(text)]


def rewrite(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2).strip()) + m.group(4), text)


def differences(root: Path = REPO) -> list[str]:
    """One line per block whose text is not what its JSON gives, naming the first differing line."""
    bad = []
    for page in pages(root):
        for spec, body in blocks(page.read_text()):
            want = render(spec)
            if body != want:
                have_l, want_l = body.splitlines(), want.splitlines()
                i = next((i for i, (a, b) in enumerate(zip(have_l, want_l)) if a != b), min(len(have_l), len(want_l)))
                bad.append(f"{page.relative_to(root)}: bench: {spec}: line {i + 1} of the block reads\n"
                           f"    {have_l[i] if i < len(have_l) else '(nothing)'}\n"
                           f"  the JSON gives\n    {want_l[i] if i < len(want_l) else '(nothing)'}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs from its JSON")
    args = p.parse_args(argv)
    if args.check:
        bad = differences()
        for b in bad:
            print(b, file=sys.stderr)
        n = sum(len(blocks(pg.read_text())) for pg in pages())
        print(f"{n - len(bad)} of {n} measured tables match their JSON")
        return 1 if bad else 0
    for page in pages():
        text = page.read_text()
        new = rewrite(text)
        if new != text:
            page.write_text(new)
            print(f"wrote {page.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
