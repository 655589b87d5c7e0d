"""A local HTTP server that answers as the Hugging Face hub does for huggingface_hub's own clients
(`hf_hub_download`, `snapshot_download`, `HfApi.list_repo_files`), serving folders on disk as repositories,
and recording every request so a test can count what was fetched, file by file.

    with FakeHub() as hub:               # then HF_ENDPOINT=hub.url
        hub.add("owner/name", folder)
        ...
        hub.fetched("owner/name")        # {filename: number of GET requests}

Routes (huggingface_hub 1.x / 2.x):
- HEAD / GET /{repo}/resolve/{revision}/{file}: X-Repo-Commit, ETag, Content-Length, then the bytes;
- GET /api/models/{repo}[/revision/{revision}]: the repository's info (sha, siblings);
- GET /api/models/{repo}/tree/{revision}: the file list with sizes.
Unknown repositories and files answer 404 with the hub's X-Error-Code, as the hub does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class FakeHub:
    def __init__(self):
        self.repos: dict[str, dict[str, Path]] = {}
        self.log: list[tuple[str, str]] = []  # (method, path)
        self._lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, folder) -> None:
        folder = Path(folder)
        self.repos[repo] = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(repo.encode()).hexdigest()

    def fetched(self, repo: str, method: str = "GET") -> Counter:
        """{file: requests} for one repository's files (downloads by default)."""
        pre = f"/{repo}/resolve/"
        with self._lock:
            return Counter(p[len(pre):].split("/", 1)[1] for m, p in self.log if m == method and p.startswith(pre))

    def requests(self, repo: str) -> int:
        with self._lock:
            return sum(1 for _, p in self.log if p.startswith(f"/{repo}/") or p.startswith(f"/api/models/{repo}"))

    # -- answering -------------------------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.log.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            return self._api(h, "/".join(parts[2:4]), parts[4:], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, "/".join(parts[:2]), "/".join(parts[4:]), body)
        self._send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)

    def _api(self, h, repo: str, rest: list[str], body: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._send(h, 404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
        if rest[:1] == ["tree"]:
            data = [{"type": "file", "path": f, "size": p.stat().st_size,
                     "oid": hashlib.sha1(p.read_bytes()).hexdigest()} for f, p in files.items()]
        else:
            data = {"id": repo, "modelId": repo, "sha": self.commit(repo), "private": False,
                    "siblings": [{"rfilename": f} for f in files]}
        self._send(h, 200, json.dumps(data).encode(), {"Content-Type": "application/json"}, body)

    def _file(self, h, repo: str, name: str, body: bool) -> None:
        files = self.repos.get(repo)
        if files is None:
            return self._send(h, 404, b"", {"X-Error-Code": "RepoNotFound"}, body)
        if name not in files:
            return self._send(h, 404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.commit(repo)}, body)
        data = files[name].read_bytes()
        self._send(h, 200, data, {"X-Repo-Commit": self.commit(repo), "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                                  "Content-Type": "application/octet-stream"}, body)

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
