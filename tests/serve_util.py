"""Start the server in this process on a free loopback port (uvicorn in a thread), for the serve tests."""

import argparse
import socket
import threading
import time

from mlx_engine.serve.main import add_serve_args, build_service, make_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, *flags: str):
        p = argparse.ArgumentParser()
        add_serve_args(p)
        self.args = p.parse_args(["--port", str(free_port()), *flags])
        self.service, self.drafter = build_service(self.args)
        self.service.worker.start()
        self.server = make_server(self.service, self.args, self.args.port)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.args.port}"
        self.model = self.service.model_id

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", self.args.api_key or "none")
        return openai.OpenAI(base_url=self.base + "/v1", max_retries=0, timeout=120, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10 + self.args.shutdown_timeout)
        self.service.worker.stop()
