"""Run inside a fresh network + mount namespace (`unshare -n -m`, see test_media_netns.py): brings up
`lo` with the addresses of an inside network, starts a tiny HTTP server on each (a redirecting
one on the stand-in public address 8.8.8.8), names some of them in a private /etc/hosts, then
fetches every URL with qv's MediaFetcher under three policies (default; inside ranges opened by
media_allowed_networks; a domain allow-list) and, given a model folder, through the real HTTP
API. Prints one JSON object: {"fetch": {policy: {url: "OK <body>" | "ERR <message>"}, policy + " hits":
{server: [paths]}}, "api": {...}, "hits": {server: [paths]} (of the API part)}. Nothing here can reach outside the namespace."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

V4 = {"169.254.169.254": "METADATA", "10.0.0.5": "TEN", "172.16.0.9": "SIXTEEN", "192.168.1.10": "HOME",
      "100.64.0.1": "CGNAT", "8.8.8.8": "PUBLIC"}
V6 = {"fd00::5": "ULA", "::1": "LOOPBACK6"}
HOSTS = ["127.0.0.1 localhost", "::1 localhost", "169.254.169.254 metadata.internal", "10.0.0.5 db.internal",
         "8.8.8.8 public.example"]
HITS: dict[str, list[str]] = {}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        name = self.server.name
        HITS.setdefault(name, []).append(self.path)
        redirects = {"/to-metadata": "http://169.254.169.254/latest/meta-data/", "/to-localhost": "http://localhost/x",
                     "/to-mapped": "http://[::ffff:10.0.0.5]/x", "/to-db": "http://db.internal/x"}
        if self.path in redirects:
            code, body, headers = 302, b"", {"Location": redirects[self.path]}
        elif self.path == "/missing":
            code, body, headers = 404, b"no such thing", {}
        elif self.path == "/img.png":
            code, body, headers = 200, self.server.png, {"Content-Type": "image/png"}
        else:
            code, body, headers = 200, self.server.body, {}
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def network_up(tmp: str) -> None:
    cmds = [["ip", "link", "set", "lo", "up"]]
    cmds += [["ip", "addr", "add", f"{a}/32", "dev", "lo"] for a in V4]
    cmds += [["ip", "-6", "addr", "add", f"{a}/128", "dev", "lo"] for a in V6 if a != "::1"]
    for c in cmds:
        subprocess.run(c, check=True, capture_output=True)
    with open(f"{tmp}/hosts", "w") as f:
        f.write("\n".join(HOSTS) + "\n")
    subprocess.run(["mount", "--bind", f"{tmp}/hosts", "/etc/hosts"], check=True, capture_output=True)


def servers(png: bytes) -> None:
    for addr, body in [*V4.items(), ("127.0.0.1", "LOOPBACK")]:
        srv = ThreadingHTTPServer((addr, 80), Handler)
        srv.name, srv.body, srv.png = addr, body.encode(), png
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    for addr, body in V6.items():
        srv = Server6((addr, 80), Handler)
        srv.name, srv.body, srv.png = addr, body.encode(), png
        threading.Thread(target=srv.serve_forever, daemon=True).start()


URLS = ["http://169.254.169.254/latest/meta-data/", "http://metadata.internal/latest/meta-data/", "http://10.0.0.5/",
        "http://db.internal/", "http://172.16.0.9/", "http://192.168.1.10/", "http://100.64.0.1/",
        "http://127.0.0.1/", "http://localhost/", "http://0.0.0.0/", "http://[::1]/", "http://[::]/",
        "http://[fd00::5]/", "http://[::ffff:127.0.0.1]/", "http://[::ffff:169.254.169.254]/", "http://2852039166/",
        "http://8.8.8.8/", "http://public.example/", "http://8.8.8.8/to-metadata", "http://public.example/to-localhost",
        "http://8.8.8.8/to-mapped", "http://8.8.8.8/to-db", "http://8.8.8.8/missing", "http://8.8.8.8:81/",
        "https://8.8.8.8/"]
POLICIES = {"default": {}, "opened": {"allowed_networks": "10.0.0.0/8,169.254.169.254/32,fd00::/8"},
            "domains": {"allowed_domains": "public.example", "allowed_networks": "10.0.0.0/8"}}


async def fetch_all() -> dict:
    from qv.server.errors import APIError
    from qv.server.media_fetch import MediaFetcher

    out: dict = {}
    for name, kw in POLICIES.items():
        f = MediaFetcher(1 << 16, 5.0, **kw)
        res = out[name] = {}
        HITS.clear()
        for url in URLS:
            try:
                res[url] = "OK " + (await f.fetch_bytes(url, "part")).decode("latin-1")
            except APIError as e:
                res[url] = "ERR " + e.message
        out[name + " hits"] = {k: list(v) for k, v in HITS.items()}
    return out


def api(model_dir: str) -> dict:
    """The real server (tiny model) in this namespace: a chat whose image is on the metadata
    address, by default (400) and with that address opened (200)."""
    import httpx
    import uvicorn

    from qv.config import EngineConfig
    from qv.server.app import build_app

    out = {}
    for name, nets in (("default", ""), ("opened", "169.254.169.254/32")):
        app = build_app(EngineConfig(model=model_dir, max_model_len=1024, media_allowed_networks=nets))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        while not server.started:
            th.join(0.05)
        body = {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "http://169.254.169.254/img.png"}}]}], "max_tokens": 2}
        r = httpx.post(f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions", json=body, timeout=120)
        out[name] = {"status": r.status_code, "message": r.json().get("error", {}).get("message")}
        server.should_exit = True
        th.join(30)
    return out


def main() -> None:
    tmp, png_path = sys.argv[1], sys.argv[2]
    network_up(tmp)
    with open(png_path, "rb") as f:
        servers(f.read())
    result = {"fetch": asyncio.run(fetch_all())}
    HITS.clear()
    if len(sys.argv) > 3:
        result["api"] = api(sys.argv[3])
    result["hits"] = HITS
    print(json.dumps(result))


if __name__ == "__main__":
    main()
