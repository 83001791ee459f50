"""Real servers for the API tests: uvicorn on a free loopback port, in a thread of the test process,
serving the tiny model through the real engine (no mocks)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

MAX_MODEL_LEN = 1024


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    app: object
    model_dir: str

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kw)

    def metric(self, name: str, **labels) -> float:
        """One sample of /metrics (summing over label sets that match `labels`)."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if all(f'{k}="{v}"' in line for k, v in labels.items()):
                    total += float(line.rsplit(" ", 1)[1])
                    found = True
        if not found and not labels:
            raise AssertionError(f"metric {name} is not exported")
        return total


def start_server(model_dir, max_model_len: int = MAX_MODEL_LEN, qv_connections: bool = False,
                 **levers) -> tuple[Running, callable]:
    """qv_connections: uvicorn with `qv serve`'s connection settings (timeouts, the connection cap)."""
    import uvicorn

    from qv.config import EngineConfig
    from qv.server.app import build_app, uvicorn_config

    cfg = EngineConfig(model=str(model_dir), max_model_len=max_model_len, **levers)
    app = build_app(cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = (uvicorn_config(app, cfg, log_level="warning") if qv_connections
              else uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    deadline = time.time() + 300
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()

    return Running(f"http://127.0.0.1:{port}", app, str(model_dir)), stop


@pytest.fixture(scope="session")
def tiny_model(tiny_dirs):
    return tiny_dirs("tiny")


@pytest.fixture(scope="session")
def server(tiny_model):
    """The shared server: default levers (thinking off, no API key)."""
    running, stop = start_server(tiny_model)
    yield running
    stop()


@pytest.fixture(scope="session")
def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)
