"""`python -m mlx_engine.serve.load`: N concurrent streaming clients against the server, speculation on and off
(and, as a reference, mlx-lm's own server on the same model).

    python -m mlx_engine.serve.load [--clients 1,2,4,8] [--requests 2] [--max-tokens 64] [--phase-time 120]
                                    [--url http://127.0.0.1:8080] [--json out.json] [-- SERVE FLAGS ...]

Without --url it starts `python -m mlx_engine serve` itself, twice, on free loopback ports: one server with
speculation on (--num-draft auto, or --spec-num-draft) and one off (--num-draft 0), with the serve flags
given after `--`; the settings then alternate per client count (in alternating order), so a machine load
that drifts during the run favours neither. With --url it uses that server and switches speculation per
request (the `num_draft` field: 0 for off).

The setting `mlx-lm` (`--settings off,on,mlx-lm`) measures mlx-lm's own server beside ours: the bench
starts `python -m mlx_lm server --model M --host 127.0.0.1 --port P --max-tokens N` (M the --model of the
serve flags, N --max-tokens), so the same model folder answers the same requests from the same clients.
mlx-lm batches concurrent requests itself where the model's caches allow it and speculates not at all
(no draft model is given), so its rows carry no speculation figures (None).

Each phase runs C clients (threads with the real `openai` client), each sending streamed chat requests one
after another (prompts from the held-out set, the same order for every setting, temperature 0) until the
phase has sent `--requests` x C requests or `--phase-time` seconds have passed (no new request after
that). Reported per phase: requests/s and aggregate tok/s (completion tokens of all clients over the
phase's wall time), median time to first token, and the speculation figures the server sent back. Every
request asks for the usage chunk (`stream_options.include_usage`: mlx-lm sends usage only then).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..args import ArgumentParser, count, int_list

PROMPTS = Path(__file__).parents[1] / "train" / "data" / "prompts_eval.jsonl"
MLX_LM = "mlx-lm"  # the setting served by mlx-lm's own server
SETTINGS = ("off", "on", MLX_LM)


def prompts(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(row.get("prompt") or row["messages"][-1]["content"])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_model(flags: list[str]) -> str | None:
    """The --model of the serve flags (None when they name none)."""
    for i, flag in enumerate(flags):
        if flag == "--model" and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith("--model="):
            return flag.split("=", 1)[1]
    return None


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float, model: str | None = None,
               name: str = "the server") -> str:
    """Wait until the server answers; -> the model id to send. Ours: /health, which names its model. Given
    `model` (mlx-lm's server, which serves its --model under that name): /health, or /v1/models where an
    older mlx-lm has no /health (this one's /v1/models logs a traceback without a Hugging Face cache)."""
    import httpx2 as httpx

    paths = ("/health",) if model is None else ("/health", "/v1/models")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode} before answering "
                               f"{' or '.join(paths)} (--log FILE keeps its output)")
        for path in paths:
            try:
                r = httpx.get(url + path, timeout=2)
                if r.status_code == 200:
                    return model or r.json()["model"]
            except Exception:
                pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} at {url} did not answer {' or '.join(paths)} in {timeout:.0f} s")


class Phase:
    def __init__(self, url: str, model: str, clients: int, requests: int, max_tokens: int, limit: float,
                 texts: list[str], num_draft=None):
        self.url, self.model, self.clients, self.max_tokens, self.limit = url, model, clients, max_tokens, limit
        self.todo = list(range(requests))
        self.texts, self.num_draft = texts, num_draft
        self.lock = threading.Lock()
        self.results: list[dict] = []
        self.errors: list[str] = []

    def _next(self, t0: float) -> int | None:
        with self.lock:
            if not self.todo or time.perf_counter() - t0 > self.limit:
                return None
            return self.todo.pop(0)

    def _client(self, t0: float) -> None:
        import openai

        key = os.environ.get("MLX_ENGINE_API_KEY") or "none"  # the servers it starts read the same variable
        client = openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=600)
        while (i := self._next(t0)) is not None:
            extra = {"num_draft": self.num_draft} if self.num_draft is not None else None
            start = time.perf_counter()
            first, last = None, None
            try:
                stream = client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": self.texts[i % len(self.texts)]}],
                    max_tokens=self.max_tokens, temperature=0, stream=True, extra_body=extra,
                    stream_options={"include_usage": True})
                for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                    last = chunk
                tokens = last.usage.completion_tokens  # a stream that ended without usage: an error
            except Exception as e:  # reported, not raised: the phase goes on
                with self.lock:
                    self.errors.append(f"{type(e).__name__}: {e}")
                continue
            done = time.perf_counter()
            with self.lock:
                self.results.append({"tokens": tokens, "seconds": done - start, "ttft": (first or done) - start,
                                     "speculation": last.model_extra.get("speculation")})

    def run(self) -> dict:
        t0 = time.perf_counter()
        threads = [threading.Thread(target=self._client, args=(t0,)) for _ in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in self.results)
        return {
            "clients": self.clients, "requests": len(self.results), "errors": len(self.errors),
            "error_sample": self.errors[:2], "seconds": round(wall, 2), "tokens": tokens,
            "requests_per_s": round(len(self.results) / wall, 3), "aggregate_tps": round(tokens / wall, 2),
            "ttft_median_s": round(statistics.median(r["ttft"] for r in self.results), 3) if self.results else None,
            **self.speculation(),
        }

    def speculation(self) -> dict:
        """The speculation figures summed over the phase's answers; all None when no answer carried the
        field (mlx-lm's server sends none)."""
        spec = [r["speculation"] for r in self.results if r["speculation"] is not None]
        if not spec:
            return dict.fromkeys(("acceptance", "drafted", "accepted", "verify_passes", "tokens_per_verify"))
        drafted, accepted = sum(s.get("drafted", 0) for s in spec), sum(s.get("accepted", 0) for s in spec)
        passes = sum(s.get("verify_passes", 0) for s in spec)
        return {"acceptance": round(accepted / drafted, 3) if drafted else 0.0, "drafted": drafted,
                "accepted": accepted,
                "verify_passes": passes,  # steps that drafted; each emits its accepted drafts + 1
                "tokens_per_verify": round((accepted + passes) / passes, 3) if passes else 0.0}


def start_server(port: int, flags: list[str], log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "mlx_engine", "serve", "--port", str(port), *flags]
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)


def start_mlx_lm(port: int, model: str, max_tokens: int, log) -> subprocess.Popen:
    """mlx-lm's own server on the same model folder (no draft model: no speculation)."""
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--max-tokens", str(max_tokens)]
    return subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)


def label(setting: str, model: str | None) -> str:
    """The server of a setting, as an error names it."""
    if setting == MLX_LM:
        return f"mlx-lm's server (python -m mlx_lm server --model {model})"
    return f"the server with speculation {setting}"


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cell(row: dict | None, key: str) -> str:
    """A row's figure for the table ("-" when the row or the figure is missing)."""
    return f"{row[key]:.2f}" if row and row[key] is not None else "-"


def ratio(a: dict | None, b: dict | None) -> str:
    """a's aggregate tok/s over b's ("-" when either is missing or b's is 0)."""
    return f"{a['aggregate_tps'] / b['aggregate_tps']:.2f}" if a and b and b["aggregate_tps"] else "-"


def table(rows: list[dict]) -> str:
    by = {(r["speculation"], r["clients"]): r for r in rows}
    clients = sorted({r["clients"] for r in rows})
    mlx = any(r["speculation"] == MLX_LM for r in rows)  # then a column of its tok/s and on / mlx-lm
    extra = " tok/s mlx-lm | on / mlx-lm |" if mlx else ""
    lines = ["| clients | req/s off | tok/s off | req/s on | tok/s on | on/off | acceptance | tokens/verify |" + extra,
             "|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if mlx else "")]
    for c in clients:
        off, on, ref = by.get(("off", c)), by.get(("on", c)), by.get((MLX_LM, c))
        lines.append(f"| {c} | {cell(off, 'requests_per_s')} | {cell(off, 'aggregate_tps')} | "
                     f"{cell(on, 'requests_per_s')} | {cell(on, 'aggregate_tps')} | {ratio(on, off)} | "
                     f"{cell(on, 'acceptance')} | {cell(on, 'tokens_per_verify')} |"
                     + (f" {cell(ref, 'aggregate_tps')} | {ratio(on, ref)} |" if mlx else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_flags = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_flags = argv[:i], argv[i + 1 :]
    p = ArgumentParser(prog="python -m mlx_engine.serve.load", description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int_list(1), default=[1, 2, 4, 8], help="concurrent clients per phase")
    p.add_argument("--requests", type=count(1), default=2, help="requests per client per phase (default 2)")
    p.add_argument("--max-tokens", type=count(1), default=64, help="max_tokens of each request (default 64)")
    p.add_argument("--phase-time", type=float, default=120.0, help="no new request after this many seconds")
    p.add_argument("--url", help="a running server (default: start one per setting)")
    p.add_argument("--spec-num-draft", default="auto", help="num-draft with speculation on (default auto)")
    p.add_argument("--settings", default="off,on",
                   help="which settings, in order, among off,on,mlx-lm (default off,on; mlx-lm: mlx-lm's own "
                        "server on the --model given after --)")
    p.add_argument("--prompts", default=str(PROMPTS), help="jsonl with 'prompt' or 'messages' rows")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--log", default=None, help="server log file (default: discarded)")
    args = p.parse_args(argv)
    texts = prompts(Path(args.prompts))
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not texts or any(s not in SETTINGS for s in settings):
        return p.error("need prompts, and --settings among on,off,mlx-lm") or 2
    model = serve_model(serve_flags)
    if MLX_LM in settings and not model:
        return p.error("--settings mlx-lm needs the model folder after --: -- --model DIR ...") or 2
    rows = []
    log = open(args.log, "ab") if args.log else subprocess.DEVNULL
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers (finally below) when killed
    servers, procs = {}, []
    try:
        for name in settings:  # every server up first: the phases then interleave (see below)
            if name == MLX_LM:
                port = free_port()
                procs.append(start_mlx_lm(port, model, args.max_tokens, log))
                url = f"http://127.0.0.1:{port}"
                servers[name] = (url, wait_ready(url, procs[-1], 300, model, label(name, model)), None)
                print(f"{MLX_LM}: python -m mlx_lm server --model {model} on {url}", flush=True)
                continue
            nd = args.spec_num_draft if name == "on" else "0"
            if args.url:
                servers[name] = (args.url, wait_ready(args.url, None, 10), nd if nd == "auto" else int(nd))
                continue
            port = free_port()
            procs.append(start_server(port, [*serve_flags, "--num-draft", nd], log))
            url = f"http://127.0.0.1:{port}"
            servers[name] = (url, wait_ready(url, procs[-1], 300, name=label(name, model)), None)
            print(f"speculation {name}: server with --num-draft {nd} on {url}", flush=True)
        for name, (url, served, nd) in servers.items():  # the first cycles (lazy set-up) are not measured
            warm = Phase(url, served, 1, 1, 8, 60, texts[-1:], nd)
            warm.run()
            if warm.errors:  # e.g. mlx-lm's server answers /health even when its model failed to load
                raise RuntimeError(f"{label(name, model)} failed its first request: {warm.errors[0]} "
                                   "(--log FILE keeps its output)")
        # the settings alternate per client count, in alternating order, so a machine load that drifts
        # during the run favours neither
        for j, c in enumerate(args.clients):
            for name in (settings if j % 2 == 0 else settings[::-1]):
                url, served, nd = servers[name]
                row = Phase(url, served, c, args.requests * c, args.max_tokens, args.phase_time, texts, nd).run()
                row["speculation"] = name
                rows.append(row)
                print(f"  {name:>6}  {c} clients: {row['requests']} requests in {row['seconds']:.1f} s, "
                      f"{row['requests_per_s']:.2f} req/s, {row['aggregate_tps']:.1f} tok/s aggregate, "
                      f"acceptance {cell(row, 'acceptance')}, {cell(row, 'tokens_per_verify')} tokens/verify"
                      + (f", {row['errors']} errors ({row['error_sample'][0]})" if row["errors"] else ""), flush=True)
    except RuntimeError as e:  # a server that did not start: one line, the others stopped (finally)
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for proc in procs:
            stop_server(proc)
    print(table(rows))
    with open("/proc/loadavg") as f:
        print(f"load average at the end: {' '.join(f.read().split()[:3])}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
